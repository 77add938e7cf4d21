// bench/harness.hpp: the one bench harness, linked by `gpt2attn bench` (tools/cli/bench.cpp) and by bench_gpt2attn:
// case sizes (checked before anything is allocated), flop and byte counts, cache flushing, decode steps taken one
// at a time (back to back, or interleaved across cases), medians, and the check against the naive reference.
// Public API only (include/gpt2attn/): what it times is what a server embedding the library would run.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpt2attn/gpt2attn.hpp"
#ifdef GPT2ATTN_HAVE_MPI
#include "gpt2attn/parallel.hpp"
#endif

namespace gpt2attn::bench {

// a * b for element and byte counts, or an invalid_argument error naming `what` when it overflows int64: a
// size from the command line or a file must never wrap into a small allocation that is then overrun.
int64_t checked_mul(int64_t a, int64_t b, const std::string& what);
// a + b, likewise.
int64_t checked_add(int64_t a, int64_t b, const std::string& what);

// The machine's physical memory in bytes (INT64_MAX when the system cannot say).
int64_t physical_memory_bytes();
// The process's peak resident memory so far, in MB (getrusage): for a bench of one case, that case's, inputs,
// weights, KV pool and activations included; over several cases, the largest so far.
double peak_rss_mb();
// The peak resident memory since the last reset_peak_rss(), in MB, less the cache-flush buffer (flush_caches) where
// one is resident: a case's own peak when the reset came before it (Linux: /proc/self/clear_refs, VmHWM); the
// process's peak (peak_rss_mb) where the kernel offers no reset.
void reset_peak_rss();
double case_peak_rss_mb();
// The CPU's model name ("AMD EPYC 7B13"), as /proc/cpuinfo gives it; "unknown" elsewhere.
std::string cpu_model();

// The median of the timed runs. Callers time at least one; an empty list is still refused (Error internal) rather
// than read past its end.
double median(std::vector<double> ms);
// n standard normal floats drawn from rng.
std::vector<float> random_normal(size_t n, std::mt19937& rng);

// Flop counts. Causal attention is counted once (the lower triangle); KW is the K/V width (E unless the config
// groups K/V heads).
//   projections: 2*B*T*d_in*(E+2KW) + 2*B*T*E*E      causal attention: 4*E*B*T*(T+1)/2
//   decode step (one token for each of B sequences over T cached ones): 2*B*d_in*(E+2KW) + 2*B*E*E + 4*E*B*(T+1)
double projection_flops(const Config& c, int64_t B, int64_t T);
double causal_attention_flops(const Config& c, int64_t B, int64_t T);
double causal_layer_flops(const Config& c, int64_t B, int64_t T);  // the two above
double decode_step_flops(const Config& c, int64_t B, int64_t T);
// What one decode step has to read from memory: every weight once (QKV and output projections; biases ignored) in
// the compute type, and the cached K and V of every sequence (plus int8's two f32 scales per token and K/V head). T
// is the nominal cached length; the cache grows by one token per step, which the figure ignores (it understates the
// traffic by (warm-up + repeats) / T at most).
// How a case's layer holds its numbers: the compute type, and the projection weights' format (EngineOptions). A plain
// DType converts to one with weights in the compute type.
struct Precision {
  DType compute = DType::f32;
  WeightFormat weights = WeightFormat::compute;
  Precision(DType c = DType::f32, WeightFormat w = WeightFormat::compute) : compute(c), weights(w) {}  // NOLINT
  // "f32", "bf16", or with quantized weights "bf16/int8w"
  std::string name() const;
};

// Bytes of an (N, K) weight matrix held as p: the codes, and the quantized formats' f32 scales (int8 one a row, int4
// one a row per kWeightGroup inputs); the compute type's values otherwise.
double matrix_bytes(double N, double K, Precision p);
double decode_weight_bytes(const Config& c, Precision p);
double decode_kv_bytes(const Config& c, int64_t B, int64_t T, DType kv_dtype);
double decode_step_bytes(const Config& c, int64_t B, int64_t T, Precision p, DType kv_dtype);  // the two above

constexpr int kDecodeWarmup = 2;  // untimed decode steps: the first touches the new blocks and the decode primitives

// A bench case's buffers in elements, and the bytes it allocates for certain whatever the library's workspace
// adds, from one function so that the sizes checked are the sizes allocated. Every product is checked: a
// --batch and --seq whose product wraps int64 is refused, never allocated small and then overrun.
//   prefill: x (B, T, d_in), y (B, T, E); bytes add the layer's projected Q, K, V and attention output
//            (4 x (B, T, E), an upper bound with grouped K/V heads) and the weights (3E x d_in + E x E + 4E, ditto).
//   decode:  x (B, d_in), y (B, E) per step; the prompt (T, d_in) and its output (T, E); the KV cache of
//            kv_tokens = B x ceil((T + steps) / block) x block tokens (K and V, KW floats each); the weights.
struct BenchSizes {
  int64_t x = 0, y = 0, prompt_x = 0, prompt_y = 0, kv_tokens = 0, bytes = 0;
};
BenchSizes bench_sizes(const std::string& name, const Config& cfg, int64_t B, int64_t T, bool decode, int repeats);

// Evicts the CPU caches by reading (on `threads`) a buffer far larger than any last-level cache: flush_bytes(),
// 256 MiB or twice the last-level cache the CPU reports where that is more. See harness.cpp for why it reads and why
// on the step's threads.
size_t flush_bytes();
void flush_caches(int threads);

struct BenchResult {
  std::string preset;
  DType compute;
  int64_t B, T;
  int threads;
  double median_ms, gflops;  // median_ms and the spread below: of the `repeats` timed runs
  std::string isa, impl;
  bool checked = false;
  double max_abs_err = 0, mean_abs_err = 0, allowed = 0;  // allowed < 0: the check failed
  // decode only
  double tokens_per_s = 0, bytes_per_step = 0, gb_per_s = 0;
  // tensor parallel (mpirun): ranks, and the median time of a call's all-reduce on rank 0 (which includes waiting
  // for the slowest rank)
  int ranks = 1;
  double allreduce_ms = 0;
  // decode interleaved only: the median over the timed steps of the first case's step time over this case's
  double x_first = 0;
  double min_ms = 0, max_ms = 0;
  int repeats = 0;
  // step only: the step's tokens and entries, and the same work as separate extend() / decode() calls timed in the
  // same run (each call after its own cache flush with --cache cold): the median of their summed times, and the
  // median over the repeats of separate / step
  int64_t step_tokens = 0, entries = 0;
  double separate_ms = 0, x_separate = 0;
  double bound = 0;  // checked: the largest error the tolerance allowed (atol + rtol * max |reference|)
  // The share of the case's thread time spent runnable but waiting for a CPU (run_delay_s over the case's wall time
  // times its threads), set by whoever times the case; above kBusyShare another process took the CPU. The spread
  // of the runs cannot tell: a quiet 0.2 ms decode step's slowest run took 2-3.5x its fastest, as a busy one's did.
  double waited_share = 0;
  bool busy() const { return waited_share > kBusyShare; }
  static constexpr double kBusyShare = 0.15;
  WeightFormat weights = WeightFormat::compute;  // the layer's weight format (set after the positional fields)
};

// Seconds this process's threads have spent runnable but not running, as the scheduler counts them
// (/proc/self/task/*/schedstat); 0 where the kernel does not say.
double run_delay_s();

// r's median, min, max and repeats from its timed runs.
void set_times(BenchResult& r, const std::vector<double>& ms);

// The bench's layers run at the given precision, thread count and instruction set.
EngineOptions engine_options(Precision p, int threads, Isa isa);

// The check both modes share: `got` against the reference rows `ref`, with the library's one tolerance for
// chained reductions of `reduction_length`, scaled by the largest reference value compared.
void check_rows(BenchResult& r, const float* got, const std::vector<double>& ref, int64_t reduction_length,
                DType kv = DType::f32, int64_t head_dim = 1);

// A case's timings, whatever runs it: one process (CausalSelfAttention) or tensor parallel over MPI
// (ShardedAttention, whose calls take the same arguments). `sync` runs before each timed call (a barrier across
// ranks, or nothing); `allreduce_ms` reads the last call's all-reduce time (tensor parallel only).
struct Timings {
  std::vector<double> ms, allreduce_ms;
};

// A forward() call: a warm-up, then `repeats` timed calls.
template <class Forward, class Sync, class Allreduce>
Timings time_prefill(int repeats, Forward&& forward, Sync&& sync, Allreduce&& allreduce_ms) {
  forward();  // warm-up: the workspace, the GEMM primitives, the caches
  Timings t;
  for (int r = 0; r < repeats; ++r) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    forward();
    t.ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    t.allreduce_ms.push_back(allreduce_ms());
  }
  return t;
}

// Causal rows t < Tc depend only on tokens < Tc, so the reference on batch 0's first Tc tokens checks those rows
// exactly at a cost the naive loops can afford (~2 GFLOP in double).
void check_prefill(BenchResult& r, const Config& cfg, const Weights& w, const std::vector<float>& x,
                   const std::vector<float>& y, int64_t T);

// B sequences of T tokens through forward() of a CausalSelfAttention on random weights: a warm-up, then `repeats`
// timed calls; with `check`, the first rows of batch 0 against the naive reference.
BenchResult bench_prefill(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p, int threads,
                          Isa isa, int repeats, bool check);

// B sequences of T cached tokens in a paged cache (prefilled one by one with extend()), then warm-up and `repeats`
// timed decode steps, each appending one token to every sequence (after a cache flush with `cold`). The cache and the
// context length are sized so that the last step still fits. With check, sequence 0's history and first timed
// output are kept.
struct DecodeRun {
  Timings t;
  std::vector<float> history, first_out;  // sequence 0's inputs (T + kDecodeWarmup + 1, d_in) and its output (E)
};
// One case's decode steps, taken one at a time by the caller: time_decode takes them back to back, an interleaved
// run takes a step of each case in turn. The constructor prefills the B sequences.
template <class Layer, class Cache>
class DecodeSteps {
 public:
  DecodeSteps(Layer& layer, Cache& cache, const BenchSizes& sizes, int64_t B, int64_t T, int64_t d_in, int64_t E,
              bool check)
      : layer_(layer), cache_(cache), B_(B), d_in_(d_in), E_(E), check_(check), seqs_(static_cast<size_t>(B)),
        x_(static_cast<size_t>(sizes.x)), y_(static_cast<size_t>(sizes.y)) {
    std::vector<float> prompt_out(static_cast<size_t>(sizes.prompt_y));
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<float> prompt = random_normal(static_cast<size_t>(sizes.prompt_x), rng_);
      seqs_[b] = cache.create();
      layer.extend(cache, seqs_[b], prompt.data(), T, prompt_out.data());
      if (b == 0 && check) run_.history = prompt;
    }
  }
  // The next step: the first kDecodeWarmup are not timed.
  template <class Sync, class Allreduce>
  void step(int threads, bool cold, Sync&& sync, Allreduce&& allreduce_ms) {
    const int64_t s = taken_++;
    x_ = random_normal(x_.size(), rng_);  // a new token per sequence, drawn outside the timed region
    if (check_ && s <= kDecodeWarmup) run_.history.insert(run_.history.end(), x_.begin(), x_.begin() + d_in_);
    if (cold) flush_caches(threads);
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    layer_.decode(cache_, seqs_.data(), B_, x_.data(), y_.data());
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s < kDecodeWarmup) return;
    run_.t.ms.push_back(t);
    run_.t.allreduce_ms.push_back(allreduce_ms());
    if (s == kDecodeWarmup) run_.first_out.assign(y_.begin(), y_.begin() + E_);
  }
  const DecodeRun& run() const { return run_; }

 private:
  Layer& layer_;
  Cache& cache_;
  int64_t B_, d_in_, E_;
  bool check_;
  std::mt19937 rng_{42};  // the prompts, then each step's tokens
  std::vector<SequenceId> seqs_;
  std::vector<float> x_, y_;
  DecodeRun run_;
  int64_t taken_ = 0;
};

template <class Layer, class Cache, class Sync, class Allreduce>
DecodeRun time_decode(Layer& layer, Cache& cache, const BenchSizes& sizes, int64_t B, int64_t T, int64_t d_in,
                      int64_t E, int threads, int repeats, bool check, bool cold, Sync&& sync,
                      Allreduce&& allreduce_ms) {
  DecodeSteps<Layer, Cache> steps(layer, cache, sizes, B, T, d_in, E, check);
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) steps.step(threads, cold, sync, allreduce_ms);
  return steps.run();
}

// The decode figures of a timed run, and with `check` sequence 0's first timed output against the last row of the
// reference run causally over its whole token history: exactly what decode computed for it.
void finish_decode(BenchResult& r, const Config& cfg, const DecodeRun& run, int64_t B, int64_t T, bool check,
                   Precision p, DType kv_dtype, const std::function<Weights()>& weights);

// One process's decode case: B sequences of T cached tokens, `repeats` timed steps after kDecodeWarmup.
BenchResult bench_decode(const std::string& name, const Config& cfg, int64_t B, int64_t T, Precision p, int threads,
                         Isa isa, int repeats, bool check, bool cold, DType kv_dtype);

// Interleaved decode: every case is set up first, then the cases take their steps in turn (step s of each, then
// step s + 1 of each), so that all of them meet the same minutes of a shared machine, whose speed drifts by more
// than most differences between them. Each result also carries x_first, the median over the timed steps of the
// first case's step time over this case's, the two steps of each pair taken milliseconds apart.
struct DecodeSpec {
  std::string name;
  Config cfg;
  int64_t T;
  Precision precision;
  DType kv_dtype;
};
std::vector<BenchResult> bench_decode_interleaved(const std::vector<DecodeSpec>& specs, int64_t B, int threads,
                                                  Isa isa, int repeats, bool check, bool cold);

// A continuous-batching step (CausalSelfAttention::step), as `gpt2attn bench --mode step` describes it on its command
// line: prefill_n sequences each appending a chunk of prefill_t tokens, decode_n sequences one token each, and draft_n
// sequences draft_k tokens each (a speculative draft to verify); every sequence holds T cached tokens before it.
struct StepMix {
  int64_t prefill_n = 0, prefill_t = 0, decode_n = 0, draft_n = 0, draft_k = 0;
  int64_t entries() const { return prefill_n + decode_n + draft_n; }
  int64_t tokens() const { return prefill_n * prefill_t + decode_n + draft_n * draft_k; }
  std::string describe() const;  // e.g. "prefill 16x32 + decode 16 + draft 4x4"
};
// The mix's sequences prefilled with T tokens each; then, `repeats` times after a warm-up, the step and the same work as
// separate calls (an extend() per chunk, one decode() of the decode sequences, draft_k successive decode() steps of the
// draft sequences), one right after the other, each sequence truncated back to T after each (KvCache::truncate), so
// every repeat does the same work. With `cold`, the caches are flushed before the step and before each separate call.
// With `check`, the step's rows of its first entry against the naive reference over that sequence's history.
BenchResult bench_step(const std::string& name, Config cfg, const StepMix& mix, int64_t T, Precision p, int threads,
                       Isa isa, int repeats, bool check, bool cold, DType kv_dtype);

#ifdef GPT2ATTN_HAVE_MPI
// The cases tensor parallel over MPI_COMM_WORLD (under mpirun): every rank generates and holds only its heads'
// weights (ShardedAttention::random, the same values as Weights::random) and its heads' KV cache, and draws the same
// inputs. Each call is timed on every rank after a barrier; rank 0's median is reported: a call ends with the
// all-reduce, which waits for the slowest rank. `check` compares on rank 0 against the reference over the whole
// layer's weights, which it then generates. `deadline_s` bounds every wait in a collective (the layer's, and the
// barrier's).
BenchResult bench_prefill_sharded(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p,
                                  int threads, Isa isa, int repeats, bool check,
                                  double deadline_s = kCollectiveDeadlineS);
BenchResult bench_decode_sharded(const std::string& name, Config cfg, int64_t B, int64_t T, Precision p,
                                 int threads, Isa isa, int repeats, bool check, bool cold, DType kv_dtype,
                                 double deadline_s = kCollectiveDeadlineS);
#endif

}  // namespace gpt2attn::bench
