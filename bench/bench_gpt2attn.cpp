// bench/bench_gpt2attn.cpp: Google Benchmark suite for causal prefill (B = 1): the whole layer
// (CausalSelfAttention: QKV projection, attention, output projection) and the attention core alone (the
// tiled kernel driven over (H, query tiles) as engine/attention.cpp drives it), each reported as GFLOP/s and
// as a fraction of the FMA peak measured in the same run; and decode steps over a paged KV cache, reported
// as tokens/s and bytes/s against the STREAM-style triad bandwidth measured in the same run. It does not
// check results: the tests do.
//
// Cases (names are what --benchmark_filter matches):
//   Layer/<preset>/T:<T>/threads:<n>     GPT-2 presets x T in {128, 512, 1024, 2048} x {1, 2} threads
//   Core/<preset>/T:<T>/threads:<n>      same grid, attention core alone; also gpt2-small and gpt2-xl at
//                                        T = 4096 and 8192, and on 2 threads 16384 and 32768 (long context)
//   Projections/<preset>/T:<T>/threads:<n>  the layer's GEMMs alone (oneDNN, as the engine runs them), gpt2-small and
//                                        gpt2-xl at T = 1024 and 8192: what the layer's peak_frac can reach
//   Bf16/<layer|core>/<preset>/T:<T>/... bf16 compute (EngineOptions::compute), every GPT-2 preset at T = 1024
//                                        and gpt2-small at T = 4096, 2 threads, beside the same f32 cases
//                                        (F32/...): bf16_peak_frac against the vdpbf16ps peak
//   Layer/gpt3-175b/T:128/threads:2      the largest preset (~5 GB of weights in memory)
//   Isa/core/gpt2-small/<isa>/T:<T>/...  avx512 vs avx2 at T = 1024 and 256, scalar at T = 256 only
//   IsaRatio/core/gpt2-small/T:<T>/...   the avx512 and avx2 cores timed alternately inside one benchmark, T in
//                                        {1024, 4096}, 1 and 2 threads: ratio = avx2 ms / avx512 ms
//   ThreadScaling/<layer|core>/...       1 and 2 threads timed alternately inside one benchmark (gpt2-small
//                                        T = 1024; the core also at T = 4096 for gpt2-small and gpt2-xl)
//   PeakFrac/<core|layer>/...            peak-fraction floors: each run's GFLOP/s over an FMA probe run after it
//                                        (core: gpt2-small and gpt2-xl at T = 1024 and 4096; layer: gpt2-small at
//                                        T = 1024 and 8192), medians over the runs
//   Tiles/<isa>/BQ:../BK:../D:<D>/...    the compiled tile shape at D = 64 and 128 (tiles.hpp cites this)
//   Decode/<preset>/B:<B>/T:<T>/threads:2  one decode step, gpt2-small, B in {1, 4, 16, 64} x T cached tokens
//                                          in {128, 1024, 4096}
//   FewRows/<f32|bf16>/N:<N>/K:<K>/M:<M>/threads:<n>  the public Linear on its few-row kernel (a decode step's
//                                        projections: gpt2-small's c_fc and LM head shapes, M in {1, 16, 64} rows),
//                                        weights warm; peak_frac against the FMA peak
//
// FLOPs (bench/harness.hpp, as `gpt2attn bench` counts them), causal work counted once:
//   layer  2*T*E*3E + 2*T*E*E + 4*E*T(T+1)/2,  core  4*E*T(T+1)/2,  projections  2*T*E*3E + 2*T*E*E.
// Bytes of a decode step: weights 4*E*E*4 + K/V read 2*B*T*E*4 (what the step must read; see decode below).
#include <benchmark/benchmark.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench/fma_peak.hpp"
#include "bench/harness.hpp"
#include "bench/stream_triad.hpp"
#include "engine/buffer.hpp"
#include "engine/dispatch.hpp"
#include "engine/linear.hpp"
#include "engine/query_tiles.hpp"
#include "engine/team.hpp"
#include "gpt2attn/attention.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/linear.hpp"
#include "gpt2attn/weights.hpp"
#include "kernels/attention.hpp"
#include "kernels/bf16.hpp"

namespace {

namespace ga = gpt2attn;
namespace gb = gpt2attn::bench;
namespace gk = gpt2attn::kernels;
using Clock = std::chrono::steady_clock;

const std::vector<std::string> kGpt2Presets = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"};
const std::vector<int64_t> kSeqs = {128, 512, 1024, 2048};
const std::vector<int> kThreads = {1, 2};  // this machine's two cores

// Measured once at start-up: threads -> GFLOP/s, for the best ISA (the machine's peak; 0 on a CPU without
// AVX2, where no peak_frac is reported) and per vector ISA; and the vdpbf16ps peak where the CPU has AVX512-BF16.
std::map<int, double> g_machine_peak;
std::map<int, double> g_bf16_peak;
std::map<std::pair<ga::Isa, int>, double> g_isa_peak;
// Measured once at start-up: threads -> STREAM-style triad GB/s (bench/stream_triad.hpp), bw_frac's denominator.
std::map<int, double> g_triad_gbps;

// The attention core's flops (bench/harness.hpp counts them for every mode, from a config; the core has only E).
double core_flops(int64_t E, int64_t T) {
  ga::Config c;
  c.d_model = E;
  return gb::causal_attention_flops(c, 1, T);
}

// GFLOP/s of the benchmark's iterations, `flops` each, in `seconds` of wall time in all.
double gflops_of(const benchmark::State& state, double flops, double seconds) {
  return flops * static_cast<double>(state.iterations()) / seconds * 1e-9;
}

// CPU seconds used by the whole process so far (all threads).
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Wall and process CPU time of a timed loop.
struct Span {
  Clock::time_point wall0 = Clock::now();
  double cpu0 = process_cpu_seconds();
  double wall() const { return std::chrono::duration<double>(Clock::now() - wall0).count(); }
  double cpu() const { return process_cpu_seconds() - cpu0; }
};

// Sets GFLOP/s from the wall time of the timed loop, and peak_frac against the machine's FMA peak; for a
// forced weaker ISA also isa_peak_frac against that ISA's own peak. cpu_util = process CPU time / (wall x
// threads): OpenMP threads spin between regions, so it stays near 1 while every thread has a core of its
// own, and falls towards 1/threads when another process shares the cores (then the case is not worth quoting).
void report(benchmark::State& state, double flops, const Span& span, int threads, ga::Isa isa = ga::Isa::best,
            ga::DType compute = ga::DType::f32) {
  const double seconds = span.wall();
  state.counters["cpu_util"] = span.cpu() / (seconds * threads);
  const double rate = gflops_of(state, flops, seconds);
  state.counters["GFLOP/s"] = rate;
  if (g_machine_peak.at(threads) > 0) state.counters["peak_frac"] = rate / g_machine_peak.at(threads);
  if (compute == ga::DType::bf16 && g_bf16_peak.count(threads)) {
    state.counters["bf16_peak_frac"] = rate / g_bf16_peak.at(threads);
  }
  if (isa != ga::Isa::best && isa != ga::best_supported_isa()) {
    const auto it = g_isa_peak.find({isa, threads});
    if (it != g_isa_peak.end()) state.counters["isa_peak_frac"] = rate / it->second;
  }
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  return gb::random_normal(n, rng);
}

// n floats from the engine's own allocator (engine/buffer.hpp: 64-byte aligned, on huge pages when large), so the
// core is timed over memory placed as the engine's workspace is.
ga::detail::Buffer aligned_floats(size_t n) { return ga::detail::allocate_buffer(n * sizeof(float), "bench"); }
float* floats(const ga::detail::Buffer& b) { return reinterpret_cast<float*>(b.get()); }

// ---- the whole layer ----------------------------------------------------------------------------------

// One layer at a time is kept (gpt3-175b alone is ~5 GB); cases sharing (preset, T, isa) run back to back.
struct LayerFixture {
  std::string preset;
  int64_t T = 0;
  ga::Isa isa = ga::Isa::best;
  ga::DType compute = ga::DType::f32;
  ga::Config cfg;
  std::unique_ptr<ga::CausalSelfAttention> layer;
  std::vector<float> x, y;  // (T, E) each
  std::set<int> warmed;     // thread counts whose oneDNN primitives and workspace exist
};
std::unique_ptr<LayerFixture> g_layer;

LayerFixture& layer_for(const std::string& preset, int64_t T, ga::Isa isa, int threads,
                        ga::DType compute = ga::DType::f32) {
  if (!g_layer || g_layer->preset != preset || g_layer->T != T || g_layer->isa != isa || g_layer->compute != compute) {
    g_layer.reset();  // free the previous layer before building the next
    auto f = std::make_unique<LayerFixture>();
    f->preset = preset, f->T = T, f->isa = isa, f->compute = compute;
    f->cfg = ga::preset(preset);
    f->cfg.context_length = std::max(f->cfg.context_length, T);
    {
      const ga::Weights w = ga::Weights::random(f->cfg, 1234);  // copied by the layer; freed at scope end
      ga::EngineOptions opts;
      opts.isa = isa;
      opts.compute = compute;
      f->layer = std::make_unique<ga::CausalSelfAttention>(f->cfg, w, opts);
    }
    f->x = random_floats(static_cast<size_t>(T * f->cfg.query_width()), 42);
    f->y.resize(static_cast<size_t>(T * f->cfg.d_model));
    g_layer = std::move(f);
  }
  LayerFixture& f = *g_layer;
  if (!f.warmed.count(threads)) {
    ga::RunOptions run;
    run.threads = threads;
    f.layer->forward(f.x.data(), 1, T, f.y.data(), run);  // creates primitives, grows the workspace
    f.warmed.insert(threads);
  }
  return f;
}

void bm_layer(benchmark::State& state, const std::string& preset, int64_t T, int threads,
              ga::DType compute = ga::DType::f32) {
  LayerFixture& f = layer_for(preset, T, ga::Isa::best, threads, compute);
  ga::RunOptions run;
  run.threads = threads;
  const Span span;
  for (auto _ : state) {
    f.layer->forward(f.x.data(), 1, T, f.y.data(), run);
    benchmark::ClobberMemory();
  }
  report(state, gb::causal_layer_flops(f.cfg, 1, T), span, threads, ga::Isa::best, compute);
  state.SetLabel(f.layer->layer().implementation());
}

// ---- the attention core alone --------------------------------------------------------------------------

const gk::AttentionKernel& kernel_for(ga::Isa isa, ga::DType compute = ga::DType::f32) {
  return *ga::detail::kernels_for(ga::detail::resolve_isa(isa), compute, compute).prefill;
}

// Q, K, V as the engine's projections leave them: one buffer of 3 T E elements, head-major (3, H, T, D), each head's
// rows D apart; the output (T, E) with heads concatenated.
// Q, K, V and the output are of the compute type (bf16: the random values rounded, as the projections leave them).
struct Core {
  int64_t H, D, E, T;
  ga::DType compute;
  const gk::AttentionKernel* kernel;
  ga::detail::Buffer qkv, ctx, scratch;  // qkv and ctx hold compute-type elements (float-sized buffers, bf16 uses half)
  int64_t scratch_stride;

  Core(int64_t H_, int64_t D_, int64_t T_, ga::Isa isa, int max_threads, ga::DType compute_)
      : H(H_), D(D_), E(H_ * D_), T(T_), compute(compute_), kernel(&kernel_for(isa, compute_)) {
    const std::vector<float> r = random_floats(static_cast<size_t>(T * 3 * E), 7);
    qkv = aligned_floats(r.size());
    if (compute == ga::DType::bf16) {
      auto* q = reinterpret_cast<gk::bf16*>(qkv.get());
      for (size_t i = 0; i < r.size(); ++i) q[i] = gk::to_bf16(r[i]);
    } else {
      std::copy(r.begin(), r.end(), floats(qkv));
    }
    ctx = aligned_floats(static_cast<size_t>(T * E));
    scratch_stride = (static_cast<int64_t>(kernel->scratch_floats(D)) + 15) / 16 * 16;
    scratch = aligned_floats(static_cast<size_t>(max_threads * scratch_stride));
  }

  // engine/attention.cpp's forward() core for B = 1, causal, no mask, no dropout, through the engine's own
  // run_query_tiles (engine/query_tiles.hpp). Q, K and V head-major as the projections leave them, qkv (3, H, T, D):
  // each head's rows contiguous, D apart; the output (T, E).
  void run(int threads) {
    gk::AttentionArgs base;
    base.ldq = base.kv.ldk = base.kv.ldv = D;
    base.ldo = E;
    base.T = T, base.Tk = T, base.D = D;
    base.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    base.causal = true;
    base.causal_offset = 0;
    const auto* qp = reinterpret_cast<const std::byte*>(qkv.get());
    auto* out = reinterpret_cast<std::byte*>(ctx.get());
    const int64_t es = static_cast<int64_t>(ga::size_of(compute));  // bytes per element
    ga::detail::run_query_tiles(*kernel, H, T, base, floats(scratch), scratch_stride, threads,
                                [&](gk::AttentionArgs& a, int64_t h) {
                                  a.q = qp + h * T * D * es;
                                  a.kv.k = qp + (H + h) * T * D * es;
                                  a.kv.v = qp + (2 * H + h) * T * D * es;
                                  a.out = out + h * D * es;
                                });
  }
};

std::unique_ptr<Core> g_core;
Core& core_for(int64_t H, int64_t D, int64_t T, ga::Isa isa, ga::DType compute = ga::DType::f32) {
  if (!g_core || g_core->H != H || g_core->D != D || g_core->T != T || g_core->kernel != &kernel_for(isa, compute)) {
    g_core.reset();
    g_core = std::make_unique<Core>(H, D, T, isa, std::max(omp_get_num_procs(), 2), compute);
    g_core->run(1);  // first touch of the buffers
  }
  return *g_core;
}

void bm_core(benchmark::State& state, int64_t H, int64_t D, int64_t T, int threads, ga::Isa isa,
             ga::DType compute = ga::DType::f32) {
  Core& c = core_for(H, D, T, isa, compute);
  c.run(threads);  // warm caches and the thread team at this size
  const Span span;
  for (auto _ : state) {
    c.run(threads);
    benchmark::ClobberMemory();
  }
  report(state, core_flops(c.E, T), span, threads, isa, compute);
  state.SetLabel(std::string(ga::to_string(c.kernel->isa)) + " " + ga::to_string(compute));
}

// ---- the layer's projections alone -----------------------------------------------------------------------

// The GEMMs of a layer's forward() as engine/attention.cpp runs them (f32): the Q, K and V projections as 3H per-head
// GEMMs (T, E) x (E, D), taken dynamically one thread each, writing Q, K and V head-major (3, H, T, D); then the
// output projection (T, E) x (E, E) on oneDNN's own threads, over ctx (random here; in the layer, the core's
// output). x is f32 and contiguous, so forward() packs nothing: a layer's time is about this plus Core's, and
// Projections' peak_frac and Core's bound the layer's.
struct Projections {
  std::string preset;
  int64_t T, E, D, H;
  std::vector<ga::detail::Linear> heads;  // q_0..q_{H-1}, k_0.., v_0..
  std::unique_ptr<ga::detail::Linear> out;
  ga::detail::ExecContext exec;
  ga::detail::Buffer x, qkv, ctx, y;

  Projections(const std::string& p, int64_t T_) : preset(p), T(T_) {
    const ga::Config c = ga::preset(p);
    E = c.d_model, H = c.num_heads, D = c.head_dim();
    const std::vector<float> w = random_floats(static_cast<size_t>(4 * E * E), 11), b(static_cast<size_t>(E), 0.5f);
    for (int64_t i = 0; i < 3 * H; ++i) heads.emplace_back(ga::TensorView::f32(w.data() + i * D * E, {D, E}), b.data());
    out = std::make_unique<ga::detail::Linear>(ga::TensorView::f32(w.data() + 3 * E * E, {E, E}), b.data());
    const std::vector<float> r = random_floats(static_cast<size_t>(T * E), 12);
    x = aligned_floats(r.size());
    std::copy(r.begin(), r.end(), floats(x));
    qkv = aligned_floats(static_cast<size_t>(3 * T * E));
    ctx = aligned_floats(static_cast<size_t>(T * E));
    y = aligned_floats(static_cast<size_t>(T * E));
    std::copy(r.begin(), r.end(), floats(ctx));  // any finite values: the output projection's input
  }

  void run(int threads) {
    const float* xp = floats(x);
    float* q = floats(qkv);
    ga::detail::team_for(threads, 3 * H, [&](int64_t i, int thread) {
      heads[static_cast<size_t>(i)].run(exec, xp, T, E, q + i * T * D, D, 1, thread);
    });
    out->run(exec, floats(ctx), T, E, floats(y), E, threads, 0);
  }
};

std::unique_ptr<Projections> g_projections;

void bm_projections(benchmark::State& state, const std::string& preset, int64_t T, int threads) {
  if (!g_projections || g_projections->preset != preset || g_projections->T != T) {
    g_projections.reset();
    g_projections = std::make_unique<Projections>(preset, T);
  }
  Projections& pr = *g_projections;
  pr.run(threads);  // creates this thread count's primitives, warms caches
  const Span span;
  for (auto _ : state) {
    pr.run(threads);
    benchmark::ClobberMemory();
  }
  report(state, gb::projection_flops(ga::preset(pr.preset), 1, T), span, threads);
  state.SetLabel("onednn-matmul/" + pr.out->implementation());
}

// ---- the few-row projection kernel (decode's projections and a model's MLP and LM head) ----------------------
// M rows through an (N, K) public Linear holding only its few-row panels, as a model's LM head does; the weights stay
// warm in the caches they fit (the LM head's 77-154 MB come from the last-level cache or memory). The layer is built
// once per compute type and shape (Google Benchmark calls a case several times while it sizes its loop), as
// g_projections is.
struct FewRows {
  ga::DType compute;
  int64_t N, K;
  ga::Linear lin;
  std::vector<float> x;  // kFewRowsMaxM rows

  static constexpr int64_t kFewRowsMaxM = 64;
  static ga::Linear make(ga::DType compute, int64_t N, int64_t K) {
    const std::vector<float> w = random_floats(static_cast<size_t>(N * K), 11);
    ga::EngineOptions o;
    o.compute = compute;
    return ga::Linear(ga::TensorView::f32(w.data(), {N, K}), {}, o, ga::LinearPaths::few_rows);
  }
  FewRows(ga::DType c, int64_t n, int64_t k)
      : compute(c), N(n), K(k), lin(make(c, n, k)), x(random_floats(static_cast<size_t>(kFewRowsMaxM * k), 12)) {}
};
std::unique_ptr<FewRows> g_few_rows;

void bm_few_rows(benchmark::State& state, ga::DType compute, int64_t N, int64_t K, int64_t M, int threads) {
  if (!g_few_rows || g_few_rows->compute != compute || g_few_rows->N != N || g_few_rows->K != K) {
    g_few_rows.reset();
    g_few_rows = std::make_unique<FewRows>(compute, N, K);
  }
  FewRows& f = *g_few_rows;
  std::vector<float> y(static_cast<size_t>(M * N));
  ga::Workspace ws;
  ga::RunOptions run;
  run.threads = threads;
  f.lin.forward(f.x.data(), M, y.data(), run, &ws);
  const Span span;
  for (auto _ : state) {
    f.lin.forward(f.x.data(), M, y.data(), run, &ws);
    benchmark::ClobberMemory();
  }
  report(state, 2.0 * static_cast<double>(M * N * K), span, threads);
  state.SetLabel(f.lin.implementation());
}

// ---- two runs alternated inside each iteration (thread scaling, and the ISA ratio below): one clock ------

// Runs run_a() then run_b() in every iteration of the benchmark loop and sums each side's wall time (and run_b's
// process CPU time): the pair shares one clock, whatever the machine does from one minute to the next.
struct Alternated {
  double wall_a = 0, wall_b = 0, cpu_b = 0;
};
template <class RunA, class RunB>
Alternated alternate(benchmark::State& state, RunA&& run_a, RunB&& run_b) {
  Alternated t;
  for (auto _ : state) {
    const Span a;
    run_a();
    benchmark::ClobberMemory();
    t.wall_a += a.wall();
    const Span b;
    run_b();
    benchmark::ClobberMemory();
    t.wall_b += b.wall();
    t.cpu_b += b.cpu();
  }
  return t;
}

template <class RunWith>
void scaling(benchmark::State& state, double flops, RunWith&& run_with) {
  const Alternated t = alternate(state, [&] { run_with(1); }, [&] { run_with(2); });
  const double t1 = t.wall_a, t2 = t.wall_b, cpu2 = t.cpu_b;
  const double n = static_cast<double>(state.iterations());
  state.counters["cpu_util_2t"] = cpu2 / (t2 * 2);
  state.counters["ms_1t"] = t1 / n * 1e3;
  state.counters["ms_2t"] = t2 / n * 1e3;
  state.counters["speedup"] = t1 / t2;
  state.counters["efficiency"] = t1 / t2 / 2;
  state.counters["peak_frac_1t"] = gflops_of(state, flops, t1) / g_machine_peak.at(1);
  state.counters["peak_frac_2t"] = gflops_of(state, flops, t2) / g_machine_peak.at(2);
}

void bm_scaling_layer(benchmark::State& state, const std::string& preset, int64_t T) {
  LayerFixture& f = layer_for(preset, T, ga::Isa::best, 1);
  layer_for(preset, T, ga::Isa::best, 2);
  scaling(state, gb::causal_layer_flops(f.cfg, 1, T), [&](int threads) {
    ga::RunOptions run;
    run.threads = threads;
    f.layer->forward(f.x.data(), 1, T, f.y.data(), run);
  });
}

void bm_scaling_core(benchmark::State& state, int64_t H, int64_t D, int64_t T) {
  Core& c = core_for(H, D, T, ga::Isa::best);
  scaling(state, core_flops(c.E, T), [&](int threads) { c.run(threads); });
}

// ---- AVX2 against AVX-512: the two cores alternate inside each iteration, so both see the same clock ---------

// Counters ms_avx512, ms_avx2 and ratio = ms_avx2 / ms_avx512 (the floor: within 2.1x, for half the lanes), and
// each side's fraction of its own ISA's FMA peak. Two Core fixtures of the same shape, one per kernel.
void bm_isa_ratio(benchmark::State& state, int64_t H, int64_t D, int64_t T, int threads) {
  const int max_threads = std::max(omp_get_num_procs(), 2);
  Core wide(H, D, T, ga::Isa::avx512, max_threads, ga::DType::f32);
  Core narrow(H, D, T, ga::Isa::avx2, max_threads, ga::DType::f32);
  wide.run(threads);
  narrow.run(threads);
  const Alternated t = alternate(state, [&] { wide.run(threads); }, [&] { narrow.run(threads); });
  const double t512 = t.wall_a, t2 = t.wall_b;
  const double n = static_cast<double>(state.iterations());
  const double flops = core_flops(wide.E, T);
  state.counters["ms_avx512"] = t512 / n * 1e3;
  state.counters["ms_avx2"] = t2 / n * 1e3;
  state.counters["ratio"] = t2 / t512;
  state.counters["isa_peak_frac_avx512"] = gflops_of(state, flops, t512) / g_isa_peak.at({ga::Isa::avx512, threads});
  state.counters["isa_peak_frac_avx2"] = gflops_of(state, flops, t2) / g_isa_peak.at({ga::Isa::avx2, threads});
}

// ---- the peak-fraction floors against a probe beside every run --------------------------------------------

// On a shared VM the FMA probe's rate moves by a quarter from one minute to the next (bench/README, "Reading the
// numbers"), so a fraction of a peak measured minutes away mixes two machines. Each iteration here times one run
// of the workload, then probes the FMA peak at once (the best of 3 trials of 20 ms: the start-up probe's method,
// shorter), and takes that iteration's fraction against that probe. Counters: peak_frac, the median of the
// iterations' fractions, with peak_frac_min and peak_frac_max; ms, the median run; probe_gflops, the median probe.
// The probe gets no credit for a slow minute of the workload's own: a neighbour that takes the caches and not the
// FMA units lowers the fraction.
constexpr gpt2attn::bench::ProbeSpec kAdjacentProbe{3, 0.02};

template <class Run>
void peak_frac_adjacent(benchmark::State& state, double flops, int threads, Run&& run) {
  std::vector<double> frac, ms, probe;
  for (auto _ : state) {
    const Span span;
    run();
    benchmark::ClobberMemory();
    const double seconds = span.wall();
    const double peak = gpt2attn::bench::measured_fma_peak_gflops(threads, ga::Isa::best, kAdjacentProbe);
    frac.push_back(flops / seconds * 1e-9 / peak);
    ms.push_back(seconds * 1e3);
    probe.push_back(peak);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  state.counters["peak_frac"] = median(frac);
  state.counters["peak_frac_min"] = *std::min_element(frac.begin(), frac.end());
  state.counters["peak_frac_max"] = *std::max_element(frac.begin(), frac.end());
  state.counters["ms"] = median(ms);
  state.counters["probe_gflops"] = median(probe);
}

void bm_peak_frac_core(benchmark::State& state, int64_t H, int64_t D, int64_t T, int threads) {
  Core& c = core_for(H, D, T, ga::Isa::best);
  c.run(threads);
  peak_frac_adjacent(state, core_flops(c.E, T), threads, [&] { c.run(threads); });
  state.SetLabel(ga::to_string(c.kernel->isa));
}

void bm_peak_frac_layer(benchmark::State& state, const std::string& preset, int64_t T, int threads) {
  LayerFixture& f = layer_for(preset, T, ga::Isa::best, threads);
  ga::RunOptions run;
  run.threads = threads;
  peak_frac_adjacent(state, gb::causal_layer_flops(f.cfg, 1, T), threads,
                     [&] { f.layer->forward(f.x.data(), 1, T, f.y.data(), run); });
  state.SetLabel(f.layer->layer().implementation());
}

// ---- decode: one step of B sequences over a paged KV cache ------------------------------------------------

// B sequences of T cached tokens each are prefilled once (extend(), one sequence at a time; the cache and the
// layer are shared by every B at that T, sequences added as a larger B needs them). An iteration forks each
// of the first B base sequences, times one decode() of one new token per fork, and releases the forks: the
// cached length stays T however many iterations run, and since every T here is a multiple of the block size
// (64) the fork's new token lands in a fresh block (no copy-on-write copy in the step). Only decode() is timed
// (UseManualTime); fork and release are bookkeeping outside it.
const std::vector<int64_t> kDecodeBatches = {1, 4, 16, 64};
const std::vector<int64_t> kDecodeSeqs = {128, 1024, 4096};
constexpr int64_t kDecodeMaxBatch = 64;
constexpr int64_t kDecodeMaxSeq = 4096;

struct DecodeFixture {
  std::string preset;
  ga::Config cfg;
  std::unique_ptr<ga::CausalSelfAttention> layer;
  int64_t T = 0;                       // cached tokens of every base sequence
  std::unique_ptr<ga::KvCache> cache;  // room for kDecodeMaxBatch base sequences plus one fork block each
  std::vector<ga::SequenceId> base;
  std::vector<float> x, y;  // (kDecodeMaxBatch, E) each
};
std::unique_ptr<DecodeFixture> g_decode;

DecodeFixture& decode_for(const std::string& preset, int64_t B, int64_t T, int threads) {
  if (!g_decode || g_decode->preset != preset) {
    g_decode.reset();
    g_layer.reset();  // the prefill fixtures' memory is not needed while decode runs
    g_projections.reset();
    auto f = std::make_unique<DecodeFixture>();
    f->preset = preset;
    f->cfg = ga::preset(preset);
    f->cfg.context_length = std::max(f->cfg.context_length, kDecodeMaxSeq + 1);
    {
      const ga::Weights w = ga::Weights::random(f->cfg, 1234);
      f->layer = std::make_unique<ga::CausalSelfAttention>(f->cfg, w, ga::EngineOptions{});
    }
    f->layer->reserve_serving(kDecodeMaxSeq, kDecodeMaxBatch, threads);
    f->x = random_floats(static_cast<size_t>(kDecodeMaxBatch * f->cfg.query_width()), 43);
    f->y.resize(static_cast<size_t>(kDecodeMaxBatch * f->cfg.d_model));
    g_decode = std::move(f);
  }
  DecodeFixture& f = *g_decode;
  if (!f.cache || f.T != T) {
    f.base.clear();
    f.cache.reset();
    // The library's default block size for this config, read from a one-block probe cache.
    const int64_t bt = ga::KvCache(f.cfg, ga::KvCacheOptions{.capacity_tokens = 1}).block_tokens();
    ga::KvCacheOptions opts;
    opts.capacity_tokens = kDecodeMaxBatch * ((T + bt - 1) / bt + 1) * bt;
    f.cache = std::make_unique<ga::KvCache>(f.cfg, opts);
    f.T = T;
  }
  ga::RunOptions run;
  run.threads = threads;
  std::vector<float> prompt_out(static_cast<size_t>(T * f.cfg.d_model));
  while (static_cast<int64_t>(f.base.size()) < B) {
    const std::vector<float> prompt =
        random_floats(static_cast<size_t>(T * f.cfg.query_width()), 100 + static_cast<uint32_t>(f.base.size()));
    const ga::SequenceId s = f.cache->create();
    f.layer->extend(*f.cache, s, prompt.data(), T, prompt_out.data(), run);
    f.base.push_back(s);
  }
  return f;
}

// Bytes a decode step must read (bench/harness.hpp: writes of the new K/V and of the output are a few KB and not
// counted, as the triad does not count write-allocate traffic): every projection weight once (biases ignored) and
// the cached K and V of every sequence. Caches are not modelled: a step whose K/V fit in the last-level cache
// (B * T small) can report more than the DRAM bandwidth.
void bm_decode(benchmark::State& state, const std::string& preset, int64_t B, int64_t T, int threads) {
  DecodeFixture& f = decode_for(preset, B, T, threads);
  ga::RunOptions run;
  run.threads = threads;
  std::vector<ga::SequenceId> seqs(static_cast<size_t>(B));
  double wall = 0, cpu = 0;
  auto step = [&]() {
    for (int64_t b = 0; b < B; ++b) seqs[b] = f.cache->fork(f.base[b]);
    const Span span;
    f.layer->decode(*f.cache, seqs.data(), B, f.x.data(), f.y.data(), run);
    const double s = span.wall();
    cpu += span.cpu();
    for (int64_t b = 0; b < B; ++b) f.cache->release(seqs[b]);
    return s;
  };
  for (int i = 0; i < 3; ++i) step();  // this B's primitives, the thread team, the fork blocks
  cpu = 0;
  for (auto _ : state) {
    const double s = step();
    benchmark::ClobberMemory();
    wall += s;
    state.SetIterationTime(s);
  }
  const double n = static_cast<double>(state.iterations());
  const double kv = gb::decode_kv_bytes(f.cfg, B, T, ga::DType::f32);
  const double bytes = gb::decode_weight_bytes(f.cfg, ga::DType::f32) + kv;
  state.counters["cpu_util"] = cpu / (wall * threads);
  const double flops = gb::decode_step_flops(f.cfg, B, T);
  state.counters["GFLOP/s"] = gflops_of(state, flops, wall);
  state.counters["tokens_per_s"] = static_cast<double>(B) * n / wall;
  state.counters["kv_bytes_per_s"] = kv * n / wall;
  state.counters["bytes_per_s"] = bytes * n / wall;
  if (g_triad_gbps.count(threads)) state.counters["bw_frac"] = bytes * n / wall * 1e-9 / g_triad_gbps.at(threads);
  state.SetLabel(ga::to_string(f.layer->layer().isa()));
}

// ---- registration --------------------------------------------------------------------------------------

// Three repetitions of >= 0.25 s each, medians reported (with mean/stddev/cv): the full suite stays at a few
// minutes on two cores.
benchmark::internal::Benchmark* standard(benchmark::internal::Benchmark* b) {
  return b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.25)->Repetitions(3)->ReportAggregatesOnly(true);
}

std::string ts(int64_t v) { return std::to_string(v); }

void register_all() {
  for (const auto& p : kGpt2Presets)
    for (int64_t T : kSeqs)
      for (int n : kThreads)
        standard(benchmark::RegisterBenchmark(("Layer/" + p + "/T:" + ts(T) + "/threads:" + ts(n)).c_str(),
                                              [p, T, n](benchmark::State& s) { bm_layer(s, p, T, n); }));
  for (const auto& p : kGpt2Presets) {
    const ga::Config c = ga::preset(p);
    const int64_t H = c.num_heads, D = c.head_dim();
    for (int64_t T : kSeqs)
      for (int n : kThreads)
        standard(benchmark::RegisterBenchmark(
            ("Core/" + p + "/T:" + ts(T) + "/threads:" + ts(n)).c_str(),
            [H, D, T, n](benchmark::State& s) { bm_core(s, H, D, T, n, ga::Isa::best); }));
  }
  // Long context: the core alone at T = 4096 to 32768 for the smallest and largest head counts; past
  // 8192 on 2 threads only (gpt2-xl at T = 32768 is 3.4 TFLOP a run).
  for (const char* p : {"gpt2-small", "gpt2-xl"}) {
    const ga::Config c = ga::preset(p);
    const int64_t H = c.num_heads, D = c.head_dim();
    for (int64_t T : {4096, 8192, 16384, 32768})
      for (int n : kThreads)
        if (T <= 8192 || n == 2)
          standard(benchmark::RegisterBenchmark(
              (std::string("Core/") + p + "/T:" + ts(T) + "/threads:" + ts(n)).c_str(),
              [H, D, T, n](benchmark::State& s) { bm_core(s, H, D, T, n, ga::Isa::best); }));
  }

  // The layer's GEMMs alone, beside Layer and Core at the lengths the peak-fraction floors name.
  for (const char* p : {"gpt2-small", "gpt2-xl"})
    for (int64_t T : {1024, 8192})
      for (int n : kThreads)
        standard(benchmark::RegisterBenchmark(
            (std::string("Projections/") + p + "/T:" + ts(T) + "/threads:" + ts(n)).c_str(),
            [p, T, n](benchmark::State& s) { bm_projections(s, p, T, n); }));

  // bf16 compute beside f32, interleaved per case so each pair sees the same machine: the layer at every GPT-2
  // preset (T = 1024) and gpt2-small at T = 4096, and the core at T = 1024 and 4096.
  struct DtypeCase {
    std::string preset;
    int64_t T;
  };
  std::vector<DtypeCase> dtype_cases;
  for (const auto& p : kGpt2Presets) dtype_cases.push_back({p, 1024});
  dtype_cases.push_back({"gpt2-small", 4096});
  for (const DtypeCase& dc : dtype_cases) {
    const ga::Config c = ga::preset(dc.preset);
    const int64_t H = c.num_heads, D = c.head_dim(), T = dc.T;
    for (ga::DType dt : {ga::DType::f32, ga::DType::bf16}) {
      const std::string tag = dt == ga::DType::bf16 ? "Bf16/" : "F32/";
      standard(benchmark::RegisterBenchmark((tag + "layer/" + dc.preset + "/T:" + ts(T) + "/threads:2").c_str(),
                                            [=](benchmark::State& s) { bm_layer(s, dc.preset, T, 2, dt); }));
    }
    for (ga::DType dt : {ga::DType::f32, ga::DType::bf16}) {
      const std::string tag = dt == ga::DType::bf16 ? "Bf16/" : "F32/";
      standard(benchmark::RegisterBenchmark((tag + "core/" + dc.preset + "/T:" + ts(T) + "/threads:2").c_str(),
                                            [=](benchmark::State& s) { bm_core(s, H, D, T, 2, ga::Isa::best, dt); }));
    }
  }

  // ~1 s per forward: one iteration per repetition is plenty.
  benchmark::RegisterBenchmark("Layer/gpt3-175b/T:128/threads:2",
                               [](benchmark::State& s) { bm_layer(s, "gpt3-175b", 128, 2); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->Iterations(1)
      ->Repetitions(3)
      ->ReportAggregatesOnly(true);

  const ga::Config small = ga::preset("gpt2-small");
  const int64_t sH = small.num_heads, sD = small.head_dim();
  struct IsaCase {
    ga::Isa isa;
    int64_t T;
  };
  for (const IsaCase ic : {IsaCase{ga::Isa::avx512, 1024}, IsaCase{ga::Isa::avx2, 1024}, IsaCase{ga::Isa::avx512, 256},
                           IsaCase{ga::Isa::avx2, 256}, IsaCase{ga::Isa::scalar, 256}}) {
    if (!ga::isa_supported(ic.isa)) continue;
    const ga::Isa isa = ic.isa;
    const int64_t T = ic.T;
    standard(benchmark::RegisterBenchmark(
        (std::string("Isa/core/gpt2-small/") + ga::to_string(isa) + "/T:" + ts(T) + "/threads:2").c_str(),
        [=](benchmark::State& s) { bm_core(s, sH, sD, T, 2, isa); }));
  }

  if (ga::isa_supported(ga::Isa::avx512)) {  // AVX2 comes with it
    for (int64_t T : {1024, 4096})
      for (int n : kThreads)
        standard(benchmark::RegisterBenchmark(
            ("IsaRatio/core/gpt2-small/T:" + ts(T) + "/threads:" + ts(n)).c_str(),
            [=](benchmark::State& s) { bm_isa_ratio(s, sH, sD, T, n); }));
  }

  standard(benchmark::RegisterBenchmark("ThreadScaling/layer/gpt2-small/T:1024",
                                        [](benchmark::State& s) { bm_scaling_layer(s, "gpt2-small", 1024); }));
  standard(benchmark::RegisterBenchmark("ThreadScaling/core/gpt2-small/T:1024",
                                        [=](benchmark::State& s) { bm_scaling_core(s, sH, sD, 1024); }));
  // The scaling floor (2 threads >= 1.9x one at T = 4096), each pair of runs side by side in time.
  for (const char* p : {"gpt2-small", "gpt2-xl"}) {
    const ga::Config c = ga::preset(p);
    const int64_t H = c.num_heads, D = c.head_dim();
    standard(benchmark::RegisterBenchmark((std::string("ThreadScaling/core/") + p + "/T:4096").c_str(),
                                          [=](benchmark::State& s) { bm_scaling_core(s, H, D, 4096); }));
  }

  // The peak-fraction floors, each run beside its own probe (the core: gpt2-small and gpt2-xl at T = 1024 and
  // 4096; the layer: gpt2-small at T = 1024 and 8192). A fixed count of iterations: the probes dominate short runs.
  if (g_machine_peak.at(2) > 0) {
    for (const char* p : {"gpt2-small", "gpt2-xl"}) {
      const ga::Config c = ga::preset(p);
      const int64_t H = c.num_heads, D = c.head_dim();
      for (int64_t T : {1024, 4096})
        benchmark::RegisterBenchmark((std::string("PeakFrac/core/") + p + "/T:" + ts(T) + "/threads:2").c_str(),
                                     [=](benchmark::State& s) { bm_peak_frac_core(s, H, D, T, 2); })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(T == 1024 ? 31 : 11);
    }
    for (int64_t T : {1024, 8192})
      benchmark::RegisterBenchmark(("PeakFrac/layer/gpt2-small/T:" + ts(T) + "/threads:2").c_str(),
                                   [=](benchmark::State& s) { bm_peak_frac_layer(s, "gpt2-small", T, 2); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->Iterations(T == 1024 ? 31 : 7);
  }

  // Tile shapes are compile-time (kernels/tiles.hpp): each ISA's compiled shape at head sizes 64 and 128
  // (H = 12), the figure that justifies it; variants the lead adds get their own Tiles/ names.
  for (ga::Isa isa : {ga::Isa::avx512, ga::Isa::avx2}) {
    if (!ga::isa_supported(isa)) continue;
    const gk::TileShape t = kernel_for(isa).tiles;
    for (int64_t D : {64, 128})
      for (int n : kThreads)
        standard(benchmark::RegisterBenchmark((std::string("Tiles/") + ga::to_string(isa) + "/BQ:" + ts(t.query_tile) +
                                               "/BK:" + ts(t.key_tile) + "/D:" + ts(D) + "/T:1024/threads:" + ts(n))
                                                  .c_str(),
                                              [=](benchmark::State& s) { bm_core(s, 12, D, 1024, n, isa); }));
  }

  // Decode: T outer so one prefilled cache serves every B at that T. Manual time (only decode() is timed),
  // otherwise as standard().
  for (int64_t T : kDecodeSeqs)
    for (int64_t B : kDecodeBatches)
      benchmark::RegisterBenchmark(("Decode/gpt2-small/B:" + ts(B) + "/T:" + ts(T) + "/threads:2").c_str(),
                                   [B, T](benchmark::State& s) { bm_decode(s, "gpt2-small", B, T, 2); })
          ->Unit(benchmark::kMillisecond)
          ->UseManualTime()
          ->MinTime(0.25)
          ->Repetitions(3)
          ->ReportAggregatesOnly(true);
  for (ga::DType dt : {ga::DType::f32, ga::DType::bf16})
    for (const auto& [N, K] : {std::pair<int64_t, int64_t>{3072, 768}, {50257, 768}})
      for (int64_t M : {int64_t{1}, int64_t{16}, FewRows::kFewRowsMaxM})
        for (int n : kThreads)
          standard(benchmark::RegisterBenchmark(
              (std::string("FewRows/") + ga::to_string(dt) + "/N:" + ts(N) + "/K:" + ts(K) + "/M:" + ts(M) +
               "/threads:" + ts(n)).c_str(),
              [dt, N, K, M, n](benchmark::State& s) { bm_few_rows(s, dt, N, K, M, n); }));
}

void measure_peaks(const char* when) {
  // The machine's f32 peak: the strongest level with f32 kernels (avx512_bf16's f32 FMAs are avx512's).
  const ga::Isa best = ga::detail::kernels_for(ga::best_supported_isa(), ga::DType::f32, ga::DType::f32).isa;
  for (int n : kThreads) {
    for (ga::Isa isa : {ga::Isa::avx512, ga::Isa::avx2})
      if (ga::isa_supported(isa)) g_isa_peak[{isa, n}] = gpt2attn::bench::measured_fma_peak_gflops(n, isa);
    g_machine_peak[n] = g_isa_peak.count({best, n}) ? g_isa_peak[{best, n}] : 0.0;
  }
  if (ga::isa_supported(ga::Isa::avx512_bf16)) {
    for (int n : kThreads) {
      g_bf16_peak[n] = gpt2attn::bench::measured_bf16_dot_peak_gflops(n);
      std::fprintf(stderr, "bf16 dot peak (%s): %d thread(s): %.1f GFLOP/s\n", when, n, g_bf16_peak[n]);
    }
  }
  for (const auto& [key, gflops] : g_isa_peak)
    std::fprintf(stderr, "fma peak (%s): %s, %d thread(s): %.1f GFLOP/s\n", when, ga::to_string(key.first), key.second,
                 gflops);
  for (int n : kThreads) {
    g_triad_gbps[n] = gpt2attn::bench::stream_triad_gbps(n);
    std::fprintf(stderr, "stream triad (%s): %d thread(s): %.1f GB/s\n", when, n, g_triad_gbps[n]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  measure_peaks("start");
  benchmark::AddCustomContext("gpt2attn_isa", ga::to_string(ga::best_supported_isa()));
  for (const auto& [n, gflops] : g_machine_peak)
    benchmark::AddCustomContext("fma_peak_gflops_threads_" + std::to_string(n), std::to_string(gflops));
  for (const auto& [n, gbps] : g_triad_gbps)
    benchmark::AddCustomContext("stream_triad_gbps_threads_" + std::to_string(n), std::to_string(gbps));
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // Measured again at the end: a drop means other load (or the clock) moved during the run, and peak_frac
  // and the timings of that stretch are suspect.
  const auto start = g_machine_peak;
  const auto triad_start = g_triad_gbps;
  measure_peaks("end");
  for (const auto& [n, gflops] : start)
    if (g_machine_peak[n] < 0.9 * gflops)
      std::fprintf(stderr, "WARNING: the %d-thread FMA peak fell from %.1f to %.1f GFLOP/s during the run: other load?\n",
                   n, gflops, g_machine_peak[n]);
  for (const auto& [n, gbps] : triad_start)
    if (g_triad_gbps[n] < 0.9 * gbps)
      std::fprintf(stderr, "WARNING: the %d-thread triad bandwidth fell from %.1f to %.1f GB/s during the run: other load?\n",
                   n, gbps, g_triad_gbps[n]);
  return 0;
}
