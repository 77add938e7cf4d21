// tools/cli/bench.cpp: `gpt2attn bench`: the options expanded into cases (presets x --kv-heads x --kv-dtype x
// --dtype), each run by the bench harness (bench/harness.hpp), and the report: a table or JSON rows on stdout,
// progress on stderr.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <tuple>
#include <utility>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "gpt2attn/gpt2attn.h"
#include "tools/cli/commands.hpp"

namespace gpt2attn::cli {

int run_model_bench(const Args& a);  // tools/cli/bench_model.cpp

namespace {

const char* kAbout = R"(bench    times the whole layer (QKV projection, causal attention, output projection) on random weights for
         each preset (default: gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b; gpt3-175b at
         min(T, 128) unless --preset names it), and --config's layer (a Hugging Face GPT-2 config.json or
         one of configs/*.json, run causal; its row's preset is the path); each --seq in turn (default
         1024); the median of --repeats runs (default 5). --dtype (f32 or
         bf16, default f32) is the compute type; given more than once, every preset runs in each, in the
         order given, and each row says which. --kv-heads N gives
         every preset N K/V heads (grouped-query attention; N must divide its heads; default: as many as heads);
         given more than once, every case runs with each (the kvh column).
         --mode prefill (default): B sequences of T tokens through forward(). GFLOP/s counts causal
         attention once (the lower triangle): 2*B*T*d_in*(E+2KW) + 2*B*T*E*E + 4*E*B*T*(T+1)/2, where KW = E
         unless --kv-heads groups K/V heads (KW = N*D). --check (default
         in the table, off with --json) compares the first rows of batch 0 with the naive reference.
         --mode decode: B sequences in a KV cache, each prefilled with T tokens by extend(); one timed step
         is decode() of one new token for each of the B sequences (QKV projection, attention over the cache,
         output projection); every step appends, so the cache grows by 2 + repeats tokens per sequence
         (context length raised to fit). GFLOP/s: 2*B*d_in*(E+2KW) + 2*B*E*E + 4*E*B*(T+1); tokens/s = B / step;
         bytes per step = weights ((E+2KW)*d_in + E*E)*(4 or 2 by --dtype; 1 with --weights-dtype int8, 0.5 with
         int4, plus their f32 scales: one per output row, int4 one per row and 32 inputs) + K/V read
         B*T*2*KW*(4, 2 or 1 by --kv-dtype), plus for int8 and fp8 B*T*2*N*4 of scales (N K/V heads); GB/s =
         bytes per step / step. --weights-dtype int8 or int4 quantizes the projection weights when the layer is
         built (gpt2attn/dtype.hpp, WeightFormat); f32 or bf16 (the --dtype) keeps them in the compute type;
         given more than once, every case runs with each, and the dtype column says "bf16/int8w".
         --kv-dtype bf16 stores the cache's K/V in bf16 (half the K/V bytes); int8 in symmetric int8 with one
         f32 scale per token and K/V head (about a quarter); fp8 in e4m3, rounded to nearest even after a
         power-of-two scale per token and K/V head (about a quarter); default f32. Given more than once (like
         --dtype), every case runs with each cache, so one run compares them. --interleave (with --cache
         cold) sets every case up first and then takes one step of each case in turn, so that all of them
         meet the same minutes of a shared machine; each row then also carries x_first, the median over the
         timed steps of the first case's step time over this case's (the first case's is 1).
         --mode step: one continuous-batching step (step() of the library) of --prefill NxT (N sequences each
         appending a chunk of T tokens), --decode N (N sequences one token each) and --draft NxK (N sequences K
         draft tokens each, to verify), in any mix, over sequences that each hold --seq cached tokens. The same
         work also runs as separate calls in the same run: an extend() per chunk, one decode() of the decode
         tokens, K decode() steps of the drafts, each after its own flush with --cache cold; step and separate
         calls alternate which goes first, and every sequence is truncated back to --seq after each, so every
         repeat does the same work. separate_ms is the median of the separate calls' summed times, x_sep the
         median over the repeats of separate / step, tokens/s the step's tokens / median_ms. --check compares
         the first entry's rows with the naive reference over its sequence.
         --mode model: a whole GPT-2 (--model DIR, a Hugging Face checkpoint, or each --preset gpt2-small ..
         gpt2-xl with random weights): per --batch B (a comma-separated list), B prompts of --seq tokens (default
         128) prefilled in one step, then --new-tokens (default 128) greedy decode steps of one token each; each
         run twice, the first untimed. Reports prefill_ms, the decode step's median (min, max), tokens/s = B /
         step, and the bytes a step streams (every layer's weights once in their format, the LM head's, and
         every layer's K/V at the mean length) over the median: GB/s. bench/model_table.py adds the same run's
         STREAM triad and the fraction of it.
         A sweep of several presets reports each finished case on stderr (one line rewritten in place on a
         terminal) when its rows go to --json or to a pipe; stdout carries the rows alone.
         --check compares sequence 0's output of the first timed step with the last row of the naive
         reference run causally over that sequence's whole token history (with a bf16, int8 or fp8 cache,
         within the bound of gpt2attn/tolerance.hpp's kv_storage_tolerance). --cache warm (default) runs the
         steps back to back, so a small case's weights and K/V stay in the CPU caches; --cache cold streams
         256 MiB (or twice the reported last-level cache, if more) through the caches before each timed step,
         as a model's other layers would (GPT-2 small's 12 layers move about 190 MB per step), so every byte
         comes from memory. A case whose weights and activations (and KV cache) need more bytes than the
         machine's physical memory is refused before anything is allocated. --json rows carry min_ms,
         median_ms and max_ms of the repeats timed runs, cpu (the model name), isa, threads, version, commit
         (the one the build was configured at), timestamp (UTC) and peak_rss_mb, the case's own peak resident
         memory (the process's peak reset before each case, less --cache cold's flush buffer). A case whose
         threads waited for a CPU more than 15% of their time (waited_share, from the scheduler's
         /proc/self/task/*/schedstat) ran beside another busy process: its row says busy (the table marks
         its median with *) and a warning goes to stderr. The table's last column is the largest error of
         the check and, in parentheses, the largest the tolerance allowed.
)";

// The options, checked.
struct Request {
  std::vector<DType> computes;
  std::vector<std::string> weights;  // --weights-dtype as given
  std::string mode, cache;
  bool decode = false, step = false, interleave = false, json = false, check = false;
  bench::StepMix mix;  // --mode step
  std::vector<std::string> kv_names;  // as given: "int8" is reported as such
  int64_t B = 1;
  std::vector<int64_t> seqs;  // --seq, each in turn
  int threads = 0, repeats = 5;
  double mpi_timeout_s = 0;  // under mpirun: the sharded layer's deadline of one wait in a collective
  Isa isa = Isa::best;
  std::vector<int64_t> kv_heads;  // 0: as many as the preset's heads
  std::vector<std::string> presets;
  bool explicit_presets = false;
  std::string config_path;  // --config: a layer of its own, after the presets named
  std::optional<Config> config;
};

// One case: a preset with one --kv-heads value, in one --kv-dtype, in one --dtype, with one --weights-dtype.
struct Case {
  bench::Precision precision;
  std::string kv_name, preset;
  Config cfg;  // the preset with this case's --kv-heads
  int64_t T;
};

// A preset (or --config's layer, named by its path) with a --kv-heads value applied; a count that does not divide
// its heads is refused naming the flag.
Config config_for(const Request& r, const std::string& name, int64_t kv_heads) {
  Config c = r.config && name == r.config_path ? *r.config : preset(name);
  if (kv_heads > 0 && c.num_heads % kv_heads != 0) {
    throw UsageError("--kv-heads " + std::to_string(kv_heads) + " does not divide " + name + "'s " +
                     std::to_string(c.num_heads) + " heads");
  }
  c.num_kv_heads = kv_heads;
  return c;
}

// "AxB" of --prefill and --draft: two counts in [1, 1 << 20].
std::pair<int64_t, int64_t> count_pair(const Args& a, const std::string& k) {
  const std::string s = a.get(k);
  const size_t x = s.find('x');
  const auto count = [&](const std::string& part) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (part.empty() || ec != std::errc() || end != part.data() + part.size() || v < 1 || v > (int64_t{1} << 20)) {
      throw UsageError("--" + k + " " + s + ": expected NxT, two counts from 1 to 1048576 (e.g. 16x32)");
    }
    return v;
  };
  if (x == std::string::npos) count("");  // refused with the message above
  return {count(s.substr(0, x)), count(s.substr(x + 1))};
}

Request read_request(const Args& a) {
  Request r;
  r.computes = compute_dtypes(a);
  r.weights = weights_dtype_names(a);
  for (const DType c : r.computes) {
    for (const std::string& w : r.weights) (void)weight_format_for(w, c);  // a mismatch fails before any timing
  }
  r.mode = choice("mode", a.get("mode", "prefill"), {"prefill", "decode", "step", "model"});
  if (a.flag("batch-invariant")) throw UsageError("--batch-invariant applies to --mode model only");
  for (const char* k : {"model", "new-tokens"}) {
    if (a.has(k)) throw UsageError(std::string("--") + k + " applies to --mode model only");
  }
  r.decode = r.mode == "decode";
  r.step = r.mode == "step";
  for (const char* k : {"prefill", "decode", "draft"}) {
    if (a.has(k) && !r.step) throw UsageError(std::string("--") + k + " applies to --mode step only");
  }
  if (r.step) {
    if (a.has("prefill")) std::tie(r.mix.prefill_n, r.mix.prefill_t) = count_pair(a, "prefill");
    r.mix.decode_n = a.integer<int64_t>("decode", 0, 1, int64_t{1} << 20);
    if (a.has("draft")) std::tie(r.mix.draft_n, r.mix.draft_k) = count_pair(a, "draft");
    if (r.mix.entries() == 0) throw UsageError("--mode step needs at least one of --prefill, --decode, --draft");
    if (a.has("batch")) throw UsageError("--batch does not apply to --mode step: its entries say how many sequences");
    if (world().parallel()) throw UsageError("--mode step is not supported under mpirun");
  }
  r.cache = a.get("cache", "warm");
  if (r.cache != "warm" && r.cache != "cold") throw UsageError("--cache must be warm or cold, got " + r.cache);
  if (a.has("cache") && !r.decode && !r.step) throw UsageError("--cache applies to --mode decode and step only");
  if (a.has("kv-dtype") && !r.decode && !r.step) throw UsageError("--kv-dtype applies to --mode decode and step only");
  r.interleave = a.flag("interleave");
  if (r.interleave && (!r.decode || r.cache != "cold")) {
    throw UsageError("--interleave applies to --mode decode --cache cold only (warm cases would evict each other)");
  }
  if (r.interleave && world().parallel()) throw UsageError("--interleave is not supported under mpirun");
  // --kv-dtype, like --dtype, may repeat: every case runs with each cache, so one run compares them.
  r.kv_names = kv_dtype_names(a);
  r.B = a.integer<int64_t>("batch", 1, 1);
  r.seqs = a.integers<int64_t>("seq", r.step ? 0 : 1);  // a step may start fresh prompts: 0 cached tokens
  if (r.seqs.empty()) r.seqs = {1024};
  r.threads = threads_option(a);
  r.repeats = a.integer<int>("repeats", 5, 1);
  r.mpi_timeout_s = mpi_timeout_option(a);
  r.json = a.flag("json");
  if (a.flag("check") && a.flag("no-check")) throw UsageError("--check and --no-check contradict each other");
  r.check = a.flag("check") || (!r.json && !a.flag("no-check"));
  r.isa = isa_option(a);
  // --kv-heads may repeat too.
  r.kv_heads = a.integers<int64_t>("kv-heads", 1);
  if (r.kv_heads.empty()) r.kv_heads = {0};
  r.explicit_presets = a.has("preset");
  if (r.explicit_presets) {
    r.presets = a.distinct<std::string>("preset", [](const std::string& p) { return p; });
  } else if (!a.has("config")) {
    r.presets = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b"};
  }
  if (a.has("config")) {  // a Hugging Face GPT-2 config.json or ours: its layer, causal as every bench case
    r.config_path = a.get("config");
    Config c = load_any_config(r.config_path);
    c.causal = true;
    c.validate();
    r.config = c;
    r.presets.push_back(r.config_path);
  }
  // Unknown names and bad --kv-heads fail before any timing.
  for (const auto& p : r.presets) {
    for (const int64_t h : r.kv_heads) (void)config_for(r, p, h);
  }
  return r;
}

// Every preset with each --kv-heads, in each --kv-dtype, in each --dtype, in the order given. gpt3-175b's weights
// are 2.4 GB and its layer ~100x gpt2-small's: by default it runs at a small T.
std::vector<Case> expand(const Request& r) {
  std::vector<Case> cases;
  for (const DType compute : r.computes) {
    for (const std::string& weights : r.weights) {
      const bench::Precision p(compute, weight_format_for(weights, compute));
      for (const std::string& kv : r.kv_names) {
        for (const int64_t h : r.kv_heads) {
          for (const auto& name : r.presets) {
            for (const int64_t seq : r.seqs) {
              const int64_t T = (!r.explicit_presets && name == "gpt3-175b") ? std::min<int64_t>(seq, 128) : seq;
              cases.push_back({p, kv, name, config_for(r, name, h), T});
            }
          }
        }
      }
    }
  }
  return cases;
}

// Every case is sized before any runs: one this machine cannot hold is refused up front, naming the bytes, rather
// than failing (or swapping) partway through the table. --interleave holds every case at once: their sum is
// checked too.
void check_memory(const Request& r, const std::vector<Case>& cases) {
  const int64_t physical = bench::physical_memory_bytes();
  int64_t all_cases = 0;
  for (const Case& c : cases) {
    // A step: as a decode of its entries over the cache they reach (an upper bound for its few activations).
    const int64_t need = r.step ? bench::bench_sizes(c.preset, c.cfg, r.mix.entries(),
                                                     c.T + std::max({r.mix.prefill_t, r.mix.draft_k, int64_t{1}}),
                                                     true, r.repeats).bytes
                                : bench::bench_sizes(c.preset, c.cfg, r.B, c.T, r.decode, r.repeats).bytes;
    if (need > physical) {
      invalid(c.preset + " at --batch " + std::to_string(r.B) + " --seq " + std::to_string(c.T) +
              ": needs at least " + std::to_string(need) + " bytes for weights, activations" +
              (r.decode || r.step ? " and KV cache" : "") + ", more than the " + std::to_string(physical) +
              " bytes of physical memory");
    }
    all_cases = bench::checked_add(all_cases, need, "--interleave: bytes");
  }
  if (r.interleave && all_cases > physical) {
    invalid("--interleave: the cases together need at least " + std::to_string(all_cases) +
            " bytes, more than the " + std::to_string(physical) + " bytes of physical memory");
  }
}

DType kv_dtype_of(const std::string& name) { return dtype_from_string(name); }

bench::BenchResult run_case(const Request& r, const Case& c) {
  const bool cold = r.cache == "cold";
#ifdef GPT2ATTN_HAVE_MPI
  if (world().parallel()) {
    return r.decode ? bench::bench_decode_sharded(c.preset, c.cfg, r.B, c.T, c.precision, r.threads, r.isa, r.repeats,
                                                  r.check, cold, kv_dtype_of(c.kv_name), r.mpi_timeout_s)
                    : bench::bench_prefill_sharded(c.preset, c.cfg, r.B, c.T, c.precision, r.threads, r.isa,
                                                   r.repeats, r.check, r.mpi_timeout_s);
  }
#endif
  if (r.step) {
    return bench::bench_step(c.preset, c.cfg, r.mix, c.T, c.precision, r.threads, r.isa, r.repeats, r.check, cold,
                             kv_dtype_of(c.kv_name));
  }
  return r.decode ? bench::bench_decode(c.preset, c.cfg, r.B, c.T, c.precision, r.threads, r.isa, r.repeats, r.check,
                                        cold, kv_dtype_of(c.kv_name))
                  : bench::bench_prefill(c.preset, c.cfg, r.B, c.T, c.precision, r.threads, r.isa, r.repeats, r.check);
}

// The rows, on rank 0: a table or JSON lines on stdout, and progress on stderr, never on stdout: a line per
// finished case, or one line rewritten in place when stderr is a terminal; only for a sweep of several cases whose
// rows are not already appearing on that terminal.
class Report {
 public:
  Report(const Request& r, size_t n_cases)
      : r_(r), n_cases_(n_cases), progress_(n_cases > 1 && (r.json || isatty(STDOUT_FILENO) == 0)),
        bar_(progress_ && isatty(STDERR_FILENO) != 0) {}

  void header() const {
    if (r_.json || !world().prints()) return;
    if (r_.step) {
      std::printf("step: %s over T cached tokens each\n", r_.mix.describe().c_str());
      std::printf("%-12s %-10s %-4s %3s %6s %6s %7s %10s %11s %6s %10s %-11s %s\n", "preset", "dtype", "kv", "kvh", "T",
                  "tokens", "threads", "median_ms", "separate_ms", "x_sep", "tokens/s", "ISA",
                  r_.check ? "max_err (allowed)" : "");
      return;
    }
    std::printf("%-12s %-8s %-10s %3s %3s %6s %7s %10s %9s ", "preset", "mode", "dtype", "kvh", "B", "T", "threads",
                "median_ms", "GFLOP/s");
    if (r_.decode) std::printf("%-4s %10s %9s %7s ", "kv", "tokens/s", "MB/step", "GB/s");
    if (r_.interleave) std::printf("%7s ", "x_first");
    std::printf("%-11s %s\n", "ISA", r_.check ? "max_err (allowed)" : "");
  }

  // Before each case: its peak resident memory starts from what the process holds now.
  void start_case() const { bench::reset_peak_rss(); }

  void row(const Case& c, const bench::BenchResult& res) {
    if (!world().prints()) return;
    const std::string dtype_name = c.precision.name();  // "bf16", or "bf16/int8w" with quantized weights
    const char* dtype = dtype_name.c_str();
    const bool ok = !res.checked || res.allowed >= 0;
    all_ok_ = all_ok_ && ok;
    if (r_.json) {
      nlohmann::json j = {{"preset", res.preset}, {"mode", r_.mode}, {"dtype", to_string(c.precision.compute)},
                          {"weights_dtype", to_string(c.precision.weights)}, {"kv_heads", c.cfg.kv_heads()},
                          {"batch", res.B}, {"seq", res.T}, {"threads", res.threads}, {"median_ms", res.median_ms},
                          {"min_ms", res.min_ms}, {"max_ms", res.max_ms}, {"repeats", res.repeats},
                          {"busy", res.busy()}, {"waited_share", res.waited_share}, {"gflops", res.gflops},
                          {"isa", res.isa},
                          {"implementation", res.impl}, {"cpu", cpu_}, {"version", gpt2attn_version()},
                          {"commit", GPT2ATTN_COMMIT}, {"timestamp", utc_now()},
                          {"peak_rss_mb", bench::case_peak_rss_mb()}};
      if (world().parallel()) {
        j["ranks"] = res.ranks;
        j["allreduce_ms"] = res.allreduce_ms;
      }
      if (r_.step) {
        j["mix"] = r_.mix.describe();
        j["entries"] = res.entries;
        j["step_tokens"] = res.step_tokens;
        j["separate_ms"] = res.separate_ms;
        j["separate_tokens_per_s"] = static_cast<double>(res.step_tokens) / (res.separate_ms * 1e-3);
        j["x_separate"] = res.x_separate;
        j["cache"] = r_.cache;
        j["kv_dtype"] = c.kv_name;
        j["tokens_per_s"] = res.tokens_per_s;
      }
      if (r_.decode) {
        j["cache"] = r_.cache;
        j["kv_dtype"] = c.kv_name;
        j["tokens_per_s"] = res.tokens_per_s;
        j["bytes_per_step"] = res.bytes_per_step;
        j["gb_per_s"] = res.gb_per_s;
        if (r_.interleave) j["x_first"] = res.x_first;
      }
      if (res.checked) {
        j["max_abs_err"] = res.max_abs_err;
        j["mean_abs_err"] = res.mean_abs_err;
        j["allowed_abs_err"] = res.bound;
        j["check"] = ok ? "ok" : "FAIL";
      }
      std::printf("%s\n", j.dump().c_str());
    } else {
      char err[96] = "";
      if (res.checked) {
        std::snprintf(err, sizeof err, "%.2e (%.1e) %s", res.max_abs_err, res.bound, ok ? "ok" : "FAIL");
      }
      if (r_.step) {
        std::printf("%-12s %-10s %-4s %3ld %6ld %6ld %7d %9.3f%s %11.3f %6.2f %10.0f %-11s %s\n", res.preset.c_str(), dtype,
                    c.kv_name.c_str(), static_cast<long>(c.cfg.kv_heads()), static_cast<long>(res.T),
                    static_cast<long>(res.step_tokens), res.threads, res.median_ms, res.busy() ? "*" : " ",
                    res.separate_ms, res.x_separate, res.tokens_per_s, res.isa.c_str(), err);
        std::fflush(stdout);
        return;
      }
      std::printf("%-12s %-8s %-10s %3ld %3ld %6ld %7d %9.3f%s %9.1f ", res.preset.c_str(), r_.mode.c_str(), dtype,
                  static_cast<long>(c.cfg.kv_heads()), static_cast<long>(res.B), static_cast<long>(res.T), res.threads,
                  res.median_ms, res.busy() ? "*" : " ", res.gflops);
      if (r_.decode) {
        std::printf("%-4s %10.0f %9.1f %7.1f ", c.kv_name.c_str(), res.tokens_per_s, res.bytes_per_step * 1e-6,
                    res.gb_per_s);
        if (r_.interleave) std::printf("%7.2f ", res.x_first);
      }
      std::printf("%-11s %s\n", res.isa.c_str(), err);
    }
    std::fflush(stdout);
    if (res.busy()) {
      std::fprintf(stderr, "gpt2attn bench: warning: %s %s B=%ld T=%ld: its threads waited for a CPU %.0f%% of the "
                   "time (another process shared the cores): the timings are not this machine's speed\n",
                   res.preset.c_str(), r_.mode.c_str(), static_cast<long>(res.B), static_cast<long>(res.T),
                   100 * res.waited_share);
    }
    if (progress_) {
      std::fprintf(stderr, "%sgpt2attn bench: [%zu/%zu] %s %s B=%ld T=%ld: %.3f ms%s", bar_ ? "\r\033[K" : "",
                   ++done_, n_cases_, res.preset.c_str(), r_.mode.c_str(), static_cast<long>(res.B),
                   static_cast<long>(res.T), res.median_ms, bar_ ? "" : "\n");
      if (bar_ && done_ == n_cases_) std::fputc('\n', stderr);
      std::fflush(stderr);
    }
  }

  // The table ends with the implementation each compute type (and weight format) runs on.
  void footer() const {
    if (r_.json || !world().prints()) return;
    for (const DType compute : r_.computes) {
      for (const std::string& w : r_.weights) {
        const bench::Precision p(compute, weight_format_for(w, compute));
        const bench::BenchResult res =
            bench::bench_prefill("gpt2-small", preset("gpt2-small"), 1, 1, p, r_.threads, r_.isa, 1, false);
        std::printf("implementation (%s): %s\n", p.name().c_str(), res.impl.c_str());
      }
    }
  }

  bool all_ok() const { return all_ok_; }

 private:
  static std::string utc_now() {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&now, &tm);
    char text[32];
    std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return text;
  }

  std::string cpu_ = bench::cpu_model();
  const Request& r_;
  size_t n_cases_;
  bool progress_, bar_;
  size_t done_ = 0;
  bool all_ok_ = true;
};

// The share of `threads` threads' time since construction spent waiting for a CPU (BenchResult::waited_share).
class Waited {
 public:
  double share(int threads) const {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    return (bench::run_delay_s() - waited0_) / (wall * std::max(threads, 1));
  }

 private:
  double waited0_ = bench::run_delay_s();
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

int run_bench(const Args& a) {
  if (a.get("mode") == "model") return run_model_bench(a);
  const Request r = read_request(a);
  limit_gemm_isa(r.isa);  // as forward does: the whole layer at --isa, GEMMs included
  const std::vector<Case> cases = expand(r);
  check_memory(r, cases);
  Report report(r, cases.size());
  report.header();
  if (r.interleave) {
    std::vector<bench::DecodeSpec> specs;
    for (const Case& c : cases) specs.push_back({c.preset, c.cfg, c.T, c.precision, kv_dtype_of(c.kv_name)});
    report.start_case();
    const Waited waited;
    std::vector<bench::BenchResult> results =
        bench::bench_decode_interleaved(specs, r.B, r.threads, r.isa, r.repeats, r.check, true);
    for (size_t i = 0; i < cases.size(); ++i) {
      results[i].waited_share = waited.share(results[i].threads);  // the cases shared the same minutes
      report.row(cases[i], results[i]);
    }
  } else {
    for (const Case& c : cases) {
      report.start_case();
      const Waited waited;
      bench::BenchResult res = run_case(r, c);
      res.waited_share = waited.share(res.threads);
      report.row(c, res);
    }
  }
  report.footer();
  if (!report.all_ok()) {
    std::fprintf(stderr, "gpt2attn: bench: check against the naive reference FAILED\n");
    return 1;
  }
  return 0;
}

}  // namespace

const Command& bench_command() {
  static const Command c{
      "bench",
      "times the whole layer over the presets (see below).",
      {
          values("preset", "NAME", "a preset (gpt2attn presets); default: the GPT-2 sizes and gpt3-175b."),
          value("config", "config.json", "a layer of a Hugging Face GPT-2 config.json or configs/*.json, after any "
                                         "--preset (alone without one)."),
          value("batch", "B", "sequences; default 1 (model: a comma-separated list, e.g. 1,16)."),
          values("seq", "T", "tokens per sequence (decode, step: cached tokens, step from 0); default 1024. Repeat to sweep."),
          value("mode", "prefill|decode|step|model", "what is timed; default prefill."),
          value("model", "DIR", "model: a Hugging Face GPT-2 checkpoint directory (else --preset: random weights)."),
          value("new-tokens", "N", "model: decode steps after the prompt; default 128."),
          flag("batch-invariant", "model: RunOptions::batch_invariant (a token's bits independent of its batch)."),
          value("prefill", "NxT", "step: N sequences each appending a chunk of T tokens."),
          value("decode", "N", "step: N sequences each appending one token."),
          value("draft", "NxK", "step: N sequences each appending K draft tokens to verify."),
          compute_row(true),
          weights_row(true),
          values("kv-heads", "N", "K/V heads of every preset (grouped-query attention); default: as many as heads."),
          kv_dtype_row(),
          flag("interleave", "decode --cache cold: one step of each case in turn (the x_first column)."),
          threads_row(),
          isa_row(),
          mpi_timeout_row(),
          value("repeats", "N", "timed runs, of which the median is reported; default 5."),
          value("cache", "warm|cold", "decode, step: whether the CPU caches are flushed before each call; default warm."),
          flag("check", "compare with the naive reference (default in the table)."),
          flag("no-check", "do not compare (default with --json)."),
          flag("json", "one JSON row per case instead of the table."),
      },
      kAbout,
      run_bench};
  return c;
}

}  // namespace gpt2attn::cli
