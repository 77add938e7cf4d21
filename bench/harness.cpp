// bench/harness.cpp: the bench harness (bench/harness.hpp), over the public API only.
#include "bench/harness.hpp"

#include <dirent.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>

namespace gpt2attn::bench {

int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    invalid(what + " overflows int64 (" + std::to_string(a) + " x " + std::to_string(b) + ")");
  }
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    invalid(what + " overflows int64 (" + std::to_string(a) + " + " + std::to_string(b) + ")");
  }
  return r;
}

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t r = 0;
  if (pages <= 0 || page <= 0 || __builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page), &r)) {
    return INT64_MAX;
  }
  return r;
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

namespace {
bool flush_buffer_resident = false;
}  // namespace

void reset_peak_rss() {
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);  // 5: reset the peak resident set size (proc(5))
    std::fclose(f);
  }
}

double case_peak_rss_mb() {
  double kb = -1;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f)) {
      if (std::sscanf(line, "VmHWM: %lf kB", &kb) == 1) break;
    }
    std::fclose(f);
  }
  const double mb = kb >= 0 ? kb / 1024.0 : peak_rss_mb();
  return mb - (flush_buffer_resident ? static_cast<double>(flush_bytes()) / (1 << 20) : 0.0);
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t first = line.find_first_not_of(" \t", colon + 1);
    return first == std::string::npos ? "unknown" : line.substr(first);
  }
  return "unknown";
}

double run_delay_s() {
  double total = 0;
  DIR* dir = opendir("/proc/self/task");
  if (!dir) return 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const std::string path = std::string("/proc/self/task/") + e->d_name + "/schedstat";
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      unsigned long long on_cpu = 0, waited = 0;
      if (std::fscanf(f, "%llu %llu", &on_cpu, &waited) == 2) total += static_cast<double>(waited) * 1e-9;
      std::fclose(f);
    }
  }
  closedir(dir);
  return total;
}

void set_times(BenchResult& r, const std::vector<double>& ms) {
  r.median_ms = median(ms);
  r.min_ms = *std::min_element(ms.begin(), ms.end());
  r.max_ms = *std::max_element(ms.begin(), ms.end());
  r.repeats = static_cast<int>(ms.size());
}

double median(std::vector<double> ms) {
  if (ms.empty()) fail(ErrorCode::internal, "bench: no timed runs to take the median of");
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<float> random_normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) f = nd(rng);
  return v;
}

double projection_flops(const Config& c, int64_t B, int64_t T) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  const double b = static_cast<double>(B), t = static_cast<double>(T);
  return 2 * b * t * d_in * (E + 2 * KW) + 2 * b * t * E * E;
}

double causal_attention_flops(const Config& c, int64_t B, int64_t T) {
  const double E = static_cast<double>(c.d_model);
  const double b = static_cast<double>(B), t = static_cast<double>(T);
  return 4 * E * b * t * (t + 1) / 2;
}

double causal_layer_flops(const Config& c, int64_t B, int64_t T) {
  return projection_flops(c, B, T) + causal_attention_flops(c, B, T);
}

double decode_step_flops(const Config& c, int64_t B, int64_t T) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  const double b = static_cast<double>(B), t = static_cast<double>(T);
  return 2 * b * d_in * (E + 2 * KW) + 2 * b * E * E + 4 * E * b * (t + 1);
}

std::string Precision::name() const {
  std::string s = to_string(compute);
  if (weights != WeightFormat::compute) s += std::string("/") + to_string(weights) + "w";
  return s;
}

double matrix_bytes(double N, double K, Precision p) {
  switch (p.weights) {
    case WeightFormat::int8: return N * K + 4 * N;
    case WeightFormat::int4: return N * K / 2 + 4 * N * std::ceil(K / static_cast<double>(kWeightGroup));
    case WeightFormat::compute: break;
  }
  return N * K * static_cast<double>(size_of(p.compute));
}

double decode_weight_bytes(const Config& c, Precision p) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  return matrix_bytes(E + 2 * KW, d_in, p) + matrix_bytes(E, E, p);
}

double decode_kv_bytes(const Config& c, int64_t B, int64_t T, DType kv_dtype) {
  // Per token, what a cache of this format stores: K and V rows of every K/V head, and the row scales of the
  // formats that carry them; read off a one-block pool, so that every format's layout counts as it is.
  KvCacheOptions o;
  o.dtype = kv_dtype;
  o.capacity_tokens = 1;
  const KvCache one(c, o);
  const double per_token = static_cast<double>(one.block_bytes()) / static_cast<double>(one.block_tokens());
  return static_cast<double>(B) * static_cast<double>(T) * per_token;
}

double decode_step_bytes(const Config& c, int64_t B, int64_t T, Precision p, DType kv_dtype) {
  return decode_weight_bytes(c, p) + decode_kv_bytes(c, B, T, kv_dtype);
}

BenchSizes bench_sizes(const std::string& name, const Config& cfg, int64_t B, int64_t T, bool decode, int repeats) {
  const std::string what = name + " at --batch " + std::to_string(B) + " --seq " + std::to_string(T);
  const int64_t E = cfg.d_model, d_in = cfg.query_width();
  auto mul = [&](int64_t a, int64_t b, const char* q) { return checked_mul(a, b, what + ": " + q); };
  auto add = [&](int64_t a, int64_t b, const char* q) { return checked_add(a, b, what + ": " + q); };
  BenchSizes s;
  int64_t floats = add(mul(mul(3, E, "weights"), d_in, "weights"), mul(E, E + 4, "weights"), "weights");
  if (!decode) {
    const int64_t BT = mul(B, T, "B*T");
    s.x = mul(BT, d_in, "input B*T*d_in");
    s.y = mul(BT, E, "output B*T*E");
    floats = add(add(floats, s.x, "activations"), mul(s.y, 5, "activations"), "activations");
  } else {
    const int64_t bt = KvCache::default_block_tokens(cfg);
    const int64_t tokens = add(T, kDecodeWarmup + repeats, "cached tokens T + steps");
    s.kv_tokens = mul(B, mul(tokens / bt + (tokens % bt != 0), bt, "cached tokens"), "KV cache tokens");
    s.x = mul(B, d_in, "step input B*d_in");
    s.y = mul(B, E, "step output B*E");
    s.prompt_x = mul(T, d_in, "prompt T*d_in");
    s.prompt_y = mul(T, E, "prompt output T*E");
    floats = add(floats, mul(mul(2, s.kv_tokens, "KV cache"), cfg.kv_width(), "KV cache"), "KV cache");
    floats = add(add(floats, s.prompt_x, "activations"), s.prompt_y, "activations");
  }
  s.bytes = mul(floats, sizeof(float), "bytes");
  return s;
}

// The flush reads only: the caches are left full of clean lines, as after the other layers of a model, which mostly
// read weights and K/V. A flush that writes leaves them full of dirty lines instead, whose write-back then shares the
// memory bus with the timed step (measured: it cost a gpt2-small B=16 int8-cache decode step a quarter of its time).
// The buffer is written once, at its first use, so that its pages are real pages rather than the shared zero page.
// The read runs on the step's `threads`, each a share of the buffer: so every core's private L2 is evicted, not only
// the calling thread's, and the step finds the team as a server's back-to-back layer calls leave it, awake.
// Read by one thread, the flush left the other cores' L2 warm and their threads asleep: every cold step then began
// with a futex wake-up, which cost 150-270 us on this 2-vCPU VM under libgomp (measured by timing each thread's
// entry into the step's parallel region; a server that idles between steps pays a wake-up too, docs/serving.md
// "Sharing cores").
// Its size: 256 MiB, or twice the last-level cache the CPU reports where that is more (a 2-vCPU VM on a 5th-generation
// Xeon reports its host's 300 MiB L3).
size_t flush_bytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::max(size_t{256} << 20, llc > 0 ? 2 * static_cast<size_t>(llc) : 0);
}

void flush_caches(int threads) {
  static const std::vector<uint64_t> buffer = [] {
    std::vector<uint64_t> b(flush_bytes() / sizeof(uint64_t));
    for (size_t i = 0; i < b.size(); ++i) b[i] = i;
    flush_buffer_resident = true;
    return b;
  }();
  const int64_t lines = static_cast<int64_t>(buffer.size() / 8);
  // The library's own team, every thread released together; each reads its schedule(static) share of the lines.
  run_on_threads(threads, [&](int t, int team) {
    const int64_t q = lines / team, rem = lines % team;
    const int64_t begin = t * q + (t < rem ? t : rem), end = begin + q + (t < rem ? 1 : 0);
    uint64_t sum = 0;
    for (int64_t i = begin; i < end; ++i) sum += buffer[static_cast<size_t>(i) * 8];
    asm volatile("" : : "r"(sum));  // keep the reads
  });
}

EngineOptions engine_options(Precision p, int threads, Isa isa) {
  EngineOptions o;
  o.threads = threads, o.isa = isa, o.compute = p.compute, o.weights = p.weights;
  return o;
}

void check_rows(BenchResult& r, const float* got, const std::vector<double>& ref, int64_t reduction_length, DType kv,
                int64_t head_dim) {
  double max_ref = 0;
  for (double e : ref) max_ref = std::max(max_ref, std::fabs(e));
  const Tolerance tol = weights_tolerance(r.weights, r.compute, kv, head_dim, reduction_length, max_ref);
  r.checked = true;
  r.allowed = tol.atol;
  r.bound = tol.atol + tol.rtol * max_ref;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    r.max_abs_err = std::isnan(err) ? INFINITY : std::max(r.max_abs_err, err);
    r.mean_abs_err += err / static_cast<double>(ref.size());
    if (!tol.accepts(got[i], ref[i])) r.allowed = -1;  // marks failure
  }
}

void check_prefill(BenchResult& r, const Config& cfg, const Weights& w, const std::vector<float>& x,
                   const std::vector<float>& y, int64_t T) {
  const double E = static_cast<double>(cfg.d_model);
  const int64_t tc = std::min(T, std::clamp<int64_t>(static_cast<int64_t>(2e9 / (8 * E * E)), 4, 64));
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, tc, cfg.query_width()});
  check_rows(r, y.data(), reference_forward(cfg, w, in), std::max(cfg.query_width(), T));
}

BenchResult bench_prefill(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p, int threads,
                          Isa isa, int repeats, bool check) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, false, repeats);
  cfg.context_length = std::max(cfg.context_length, T);
  Weights w = Weights::random(cfg, 1234);
  CausalSelfAttention layer(cfg, w, engine_options(p, threads, isa));
  if (!check) w = {};  // the layer holds its own copies; without --check the process holds no more than a server
  std::vector<float> y(static_cast<size_t>(sizes.y));
  std::mt19937 rng(42);
  const std::vector<float> x = random_normal(static_cast<size_t>(sizes.x), rng);
  layer.layer().reserve(B, T, T);  // the workspace and every thread's GEMM primitives
  const Timings t = time_prefill(repeats, [&] { layer.forward(x.data(), B, T, y.data()); }, [] {}, [] { return 0.0; });
  BenchResult r{name, p.compute, B, T, layer.layer().default_threads(), 0, 0,
                to_string(layer.layer().isa()), layer.layer().implementation()};
  r.weights = p.weights;
  set_times(r, t.ms);
  r.gflops = causal_layer_flops(cfg, B, T) / (r.median_ms * 1e6);
  if (check) check_prefill(r, cfg, w, x, y, T);
  return r;
}

void finish_decode(BenchResult& r, const Config& cfg, const DecodeRun& run, int64_t B, int64_t T, bool check,
                   Precision p, DType kv_dtype, const std::function<Weights()>& weights) {
  r.gflops = decode_step_flops(cfg, B, T) / (r.median_ms * 1e6);
  r.tokens_per_s = static_cast<double>(B) / (r.median_ms * 1e-3);
  r.bytes_per_step = decode_step_bytes(cfg, B, T, p, kv_dtype);
  r.gb_per_s = r.bytes_per_step / (r.median_ms * 1e6);
  if (!check) return;
  const int64_t d_in = cfg.query_width(), E = cfg.d_model, n = static_cast<int64_t>(run.history.size()) / d_in;
  AttentionInputs in;
  in.query = TensorView::f32(run.history.data(), {1, n, d_in});
  const std::vector<double> ref = reference_forward(cfg, weights(), in);
  check_rows(r, run.first_out.data(), std::vector<double>(ref.end() - E, ref.end()), std::max(d_in, n), kv_dtype,
             cfg.head_dim());
}

namespace {

// A single-process decode case, set up to be stepped: its layer (random weights), its cache, its B prefilled
// sequences of T tokens.
class DecodeCase {
 public:
  DecodeCase(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p, int threads, Isa isa,
             int repeats, bool check, DType kv_dtype)
      : name_(name), B_(B), T_(T), precision_(p), kv_dtype_(kv_dtype), check_(check) {
    const BenchSizes sizes = bench_sizes(name, cfg, B, T, true, repeats);
    cfg.context_length = std::max(cfg.context_length, T + kDecodeWarmup + repeats + 1);
    cfg_ = cfg;
    w_ = Weights::random(cfg, 1234);
    layer_ = std::make_unique<CausalSelfAttention>(cfg, w_, engine_options(p, threads, isa));
    if (!check) w_ = {};  // the layer holds its own copies; without --check the process holds no more than a server
    // Blocks are per sequence, so each needs ceil((T + steps) / block_tokens) of them.
    KvCacheOptions kv_opts;
    kv_opts.capacity_tokens = sizes.kv_tokens;
    kv_opts.dtype = kv_dtype;
    cache_ = std::make_unique<KvCache>(cfg, kv_opts);
    layer_->reserve_serving(T, B);
    steps_ = std::make_unique<DecodeSteps<CausalSelfAttention, KvCache>>(*layer_, *cache_, sizes, B, T,
                                                                          cfg.query_width(), cfg.d_model, check);
  }
  void step(bool cold) { steps_->step(layer_->layer().default_threads(), cold, [] {}, [] { return 0.0; }); }
  const std::vector<double>& step_ms() const { return steps_->run().t.ms; }
  BenchResult result() const {
    BenchResult r{name_, precision_.compute, B_, T_, layer_->layer().default_threads(), 0, 0,
                  to_string(layer_->layer().isa()), layer_->layer().implementation()};
    r.weights = precision_.weights;
    set_times(r, step_ms());
    finish_decode(r, cfg_, steps_->run(), B_, T_, check_, precision_, kv_dtype_, [&] { return w_; });
    return r;
  }

 private:
  std::string name_;
  Config cfg_;
  int64_t B_, T_;
  Precision precision_;
  DType kv_dtype_;
  bool check_;
  Weights w_;
  std::unique_ptr<CausalSelfAttention> layer_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<DecodeSteps<CausalSelfAttention, KvCache>> steps_;
};

}  // namespace

BenchResult bench_decode(const std::string& name, const Config& cfg, int64_t B, int64_t T, Precision p, int threads,
                         Isa isa, int repeats, bool check, bool cold, DType kv_dtype) {
  DecodeCase c(name, cfg, B, T, p, threads, isa, repeats, check, kv_dtype);
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) c.step(cold);
  return c.result();
}

std::vector<BenchResult> bench_decode_interleaved(const std::vector<DecodeSpec>& specs, int64_t B, int threads,
                                                  Isa isa, int repeats, bool check, bool cold) {
  std::vector<std::unique_ptr<DecodeCase>> cases;
  for (const DecodeSpec& c : specs) {
    cases.push_back(
        std::make_unique<DecodeCase>(c.name, c.cfg, B, c.T, c.precision, threads, isa, repeats, check, c.kv_dtype));
  }
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) {
    for (const auto& c : cases) c->step(cold);
  }
  std::vector<BenchResult> out;
  const std::vector<double>& first = cases.front()->step_ms();
  for (const auto& c : cases) {
    BenchResult r = c->result();
    std::vector<double> ratios;
    for (size_t i = 0; i < first.size(); ++i) ratios.push_back(first[i] / c->step_ms()[i]);
    r.x_first = median(ratios);
    out.push_back(r);
  }
  return out;
}

std::string StepMix::describe() const {
  std::string s;
  const auto part = [&](const std::string& p) { s += (s.empty() ? "" : " + ") + p; };
  if (prefill_n) part("prefill " + std::to_string(prefill_n) + "x" + std::to_string(prefill_t));
  if (decode_n) part("decode " + std::to_string(decode_n));
  if (draft_n) part("draft " + std::to_string(draft_n) + "x" + std::to_string(draft_k));
  return s;
}

BenchResult bench_step(const std::string& name, Config cfg, const StepMix& mix, int64_t T, Precision p, int threads,
                       Isa isa, int repeats, bool check, bool cold, DType kv_dtype) {
  const int64_t B = mix.entries(), M = mix.tokens(), d_in = cfg.query_width(), E = cfg.d_model;
  if (B < 1) invalid("bench: a step needs at least one entry (--prefill, --decode or --draft)");
  const int64_t most = std::max({mix.prefill_t, mix.draft_k, int64_t{1}});
  cfg.context_length = std::max(cfg.context_length, checked_add(T, most, "--seq plus a step's tokens"));
  const Weights w = Weights::random(cfg, 1234);
  CausalSelfAttention layer(cfg, w, engine_options(p, threads, isa));
  const int team = layer.layer().default_threads();
  KvCacheOptions kv_opts;
  const int64_t bt = KvCache::default_block_tokens(cfg);
  kv_opts.capacity_tokens = checked_mul(B, (T + most + bt - 1) / bt * bt + bt, "the step's KV cache tokens");
  kv_opts.dtype = kv_dtype;
  KvCache cache(cfg, kv_opts);
  layer.reserve_step(M, B);
  layer.reserve_serving(std::min(std::max(mix.prefill_t, T), cfg.context_length), std::max(mix.decode_n, mix.draft_n));

  // The entries in the order the step takes them: chunks, decode tokens, drafts.
  std::mt19937 rng(42);
  std::vector<SequenceId> seqs;
  std::vector<int64_t> tokens;
  std::vector<float> history;  // entry 0's prompt, then its step tokens (check)
  {
    std::vector<float> prompt_out(static_cast<size_t>(checked_mul(T, E, "the prompt's output")));
    const auto add = [&](int64_t n, int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        const std::vector<float> prompt = random_normal(static_cast<size_t>(T * d_in), rng);
        seqs.push_back(cache.create());
        if (T > 0) layer.extend(cache, seqs.back(), prompt.data(), T, prompt_out.data());
        if (seqs.size() == 1 && check) history = prompt;
        tokens.push_back(n);
      }
    };
    add(mix.prefill_t, mix.prefill_n);
    add(1, mix.decode_n);
    add(mix.draft_k, mix.draft_n);
  }
  const std::vector<float> x = random_normal(static_cast<size_t>(M * d_in), rng);  // the step's tokens, packed
  std::vector<float> y(static_cast<size_t>(M * E)), y_sep(y.size());
  const auto rewind = [&] {
    for (SequenceId s : seqs) cache.truncate(s, T);
  };
  const auto timed = [&](auto&& call) {
    if (cold) flush_caches(team);
    const auto t0 = std::chrono::steady_clock::now();
    call();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  // The separate calls, over the same rows of x and y: each chunk's extend, the decode tokens' decode, then draft_k
  // decode steps of the draft sequences whose token j is row j of each draft (gathered outside the timed calls).
  const int64_t first_decode = mix.prefill_n, first_draft = first_decode + mix.decode_n;
  std::vector<float> draft_x(static_cast<size_t>(mix.draft_n * d_in)), draft_y(static_cast<size_t>(mix.draft_n * E));
  const auto separate = [&] {
    double ms = 0;
    int64_t row = 0;
    for (int64_t i = 0; i < mix.prefill_n; ++i, row += mix.prefill_t) {
      ms += timed([&] { layer.extend(cache, seqs[i], x.data() + row * d_in, mix.prefill_t, y_sep.data() + row * E); });
    }
    if (mix.decode_n) {
      ms += timed([&] {
        layer.decode(cache, seqs.data() + first_decode, mix.decode_n, x.data() + row * d_in, y_sep.data() + row * E);
      });
      row += mix.decode_n;
    }
    for (int64_t j = 0; j < mix.draft_k; ++j) {
      for (int64_t i = 0; i < mix.draft_n; ++i) {
        std::copy_n(x.data() + (row + i * mix.draft_k + j) * d_in, d_in, draft_x.data() + i * d_in);
      }
      ms += timed([&] { layer.decode(cache, seqs.data() + first_draft, mix.draft_n, draft_x.data(), draft_y.data()); });
      for (int64_t i = 0; i < mix.draft_n; ++i) {
        std::copy_n(draft_y.data() + i * E, E, y_sep.data() + (row + i * mix.draft_k + j) * E);
      }
    }
    return ms;
  };
  const auto step = [&] {
    return timed([&] { layer.step(cache, seqs.data(), tokens.data(), B, x.data(), y.data()); });
  };

  std::vector<double> step_ms, separate_ms, ratios;
  for (int r = -kDecodeWarmup; r < repeats; ++r) {
    // Alternating which goes first, so that neither always meets the other's leftovers.
    double a = 0, b = 0;
    if (r % 2 == 0) {
      a = step(), rewind(), b = separate(), rewind();
    } else {
      b = separate(), rewind(), a = step(), rewind();
    }
    if (r < 0) continue;
    step_ms.push_back(a), separate_ms.push_back(b), ratios.push_back(b / a);
  }
  BenchResult res{name, p.compute, B, T, team, 0, 0, to_string(layer.layer().isa()), layer.layer().implementation()};
  res.weights = p.weights;
  set_times(res, step_ms);
  res.step_tokens = M, res.entries = B;
  res.separate_ms = median(separate_ms);
  res.x_separate = median(ratios);
  res.tokens_per_s = static_cast<double>(M) / (res.median_ms * 1e-3);
  double flops = 0;
  for (int64_t i = 0; i < B; ++i) {
    flops += projection_flops(cfg, 1, tokens[i]) + 4.0 * static_cast<double>(E) * static_cast<double>(tokens[i]) *
                                                      (static_cast<double>(T) + static_cast<double>(tokens[i] + 1) / 2);
  }
  res.gflops = flops / (res.median_ms * 1e6);
  if (check) {
    history.insert(history.end(), x.begin(), x.begin() + tokens[0] * d_in);
    const int64_t n = T + tokens[0];
    AttentionInputs in;
    in.query = TensorView::f32(history.data(), {1, n, d_in});
    const std::vector<double> ref = reference_forward(cfg, w, in);
    check_rows(res, y.data(), std::vector<double>(ref.end() - tokens[0] * E, ref.end()), std::max(d_in, n), kv_dtype,
               cfg.head_dim());
  }
  return res;
}

#ifdef GPT2ATTN_HAVE_MPI
namespace {

// The threads a sharded layer's calls run on, given --threads (0: the OpenMP default, within the library's limit).
int sharded_team(int threads) { return threads > 0 ? threads : std::min(omp_get_max_threads(), max_threads()); }

// The barrier before each timed call, waited for with the layer's deadline: a stopped rank must not hang the others
// here either.
void barrier(double deadline_s) {
  run_agreed(MPI_COMM_WORLD, "bench: the barrier before a timed call", [] {}, deadline_s);
}

bool rank0() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank == 0;
}

BenchResult sharded_result(const std::string& name, Precision p, int64_t B, int64_t T, int threads,
                           const ShardedAttention& layer, const Timings& t) {
  BenchResult r{name, p.compute, B, T, sharded_team(threads), 0, 0, to_string(layer.isa()), layer.implementation()};
  r.weights = p.weights;
  set_times(r, t.ms);
  r.ranks = layer.ranks();
  r.allreduce_ms = median(t.allreduce_ms);
  return r;
}

}  // namespace

BenchResult bench_prefill_sharded(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p,
                                  int threads, Isa isa, int repeats, bool check, double deadline_s) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, false, repeats);
  cfg.context_length = std::max(cfg.context_length, T);
  ShardedAttention layer =
      ShardedAttention::random(cfg, 1234, MPI_COMM_WORLD, engine_options(p, threads, isa), deadline_s);
  std::vector<float> y(static_cast<size_t>(sizes.y));
  std::mt19937 rng(42);
  const std::vector<float> x = random_normal(static_cast<size_t>(sizes.x), rng);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, cfg.query_width()});
  const Timings t = time_prefill(
      repeats, [&] { layer.forward(in, y.data()); }, [&] { barrier(deadline_s); },
      [&] { return layer.last_call_times().allreduce_s * 1e3; });
  BenchResult r = sharded_result(name, p, B, T, threads, layer, t);
  r.gflops = causal_layer_flops(cfg, B, T) / (r.median_ms * 1e6);
  if (check && rank0()) check_prefill(r, cfg, Weights::random(cfg, 1234), x, y, T);
  return r;
}

BenchResult bench_decode_sharded(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p,
                                 int threads, Isa isa, int repeats, bool check, bool cold, DType kv_dtype,
                                 double deadline_s) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, true, repeats);
  cfg.context_length = std::max(cfg.context_length, T + kDecodeWarmup + repeats + 1);
  ShardedAttention layer =
      ShardedAttention::random(cfg, 1234, MPI_COMM_WORLD, engine_options(p, threads, isa), deadline_s);
  KvCacheOptions kv_opts;
  kv_opts.capacity_tokens = sizes.kv_tokens;
  kv_opts.dtype = kv_dtype;
  ShardedKvCache cache(layer, kv_opts);
  const DecodeRun run = time_decode(
      layer, cache, sizes, B, T, cfg.query_width(), cfg.d_model, sharded_team(threads), repeats, check, cold,
      [&] { barrier(deadline_s); }, [&] { return layer.last_call_times().allreduce_s * 1e3; });
  BenchResult r = sharded_result(name, p, B, T, threads, layer, run.t);
  finish_decode(r, cfg, run, B, T, check && rank0(), p, kv_dtype, [&] { return Weights::random(cfg, 1234); });
  return r;
}
#endif

}  // namespace gpt2attn::bench
