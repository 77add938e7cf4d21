// bench/fma_peak_impl.hpp: the FMA peak loop, written once over xsimd::batch<float, Arch>, and the team timing every
// peak probe shares. Included only by the per-ISA files (fma_peak_<isa>.cpp, bf16_dot_peak_avx512bf16.cpp);
// internal linkage keeps ISA-flagged code out of other TUs.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "bench/fma_peak.hpp"
#include "engine/team.hpp"

namespace gpt2attn::bench {
namespace {

// A independent chains acc = acc * b + c. A must cover FMA latency x FMA ports (4 cycles x 2 on Sapphire
// Rapids = 8 in flight) and, with b and c, fit the register file (AVX-512: 16 + 2 of 32 zmm;
// AVX2: 12 + 2 of 16 ymm) so the loop is nothing but FMAs. b < 1 keeps the values finite and normal.
template <class Arch, int A>
float fma_chains(long iters, float seed) {
  using B = xsimd::batch<float, Arch>;
  B acc[A];
  for (int i = 0; i < A; ++i) acc[i] = B(seed + static_cast<float>(i));
  const B b(0.999999f), c(1e-3f);
  // Without -ffast-math the compiler may not reassociate or fold the chains; the sum below keeps them live.
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < A; ++i) acc[i] = xsimd::fma(acc[i], b, c);
  B sum = acc[0];
  for (int i = 1; i < A; ++i) sum += acc[i];
  return xsimd::hadd(sum);
}

using Clock = std::chrono::steady_clock;

// The rate of a team of `threads` OpenMP threads (engine/team.hpp's team_run, the threads the layer's calls use),
// each running chains(iters, seed) (flops_per_iter FLOPs an iteration) for spec.trial_seconds: the best of
// spec.trials trials (other load only lowers a trial). Shared by every probe (fma_peak_<isa>.cpp,
// bf16_dot_peak_avx512bf16.cpp), so their figures are measured alike.
template <class Chains>
double team_peak_gflops(int threads, double flops_per_iter, Chains chains, ProbeSpec spec) {
  volatile float sink = 0;
  // Calibrate the iteration count to a trial's length on one thread (also wakes the cores and settles the clock).
  long iters = 1 << 20;
  for (;;) {
    const auto t0 = Clock::now();
    sink = sink + chains(iters, 1.0f);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0.01) {
      iters = std::max(1L, static_cast<long>(static_cast<double>(iters) * spec.trial_seconds / s));
      break;
    }
    iters *= 4;
  }
  // The rate of the team: all FLOPs over the span from the first thread's start to the last one's end, so
  // threads that were time-sliced rather than run side by side are not counted as parallel.
  double best = 0;
  for (int trial = 0; trial < spec.trials; ++trial) {
    std::vector<Clock::time_point> start(static_cast<size_t>(threads)), end(start);
    const int team = gpt2attn::detail::team_run(threads, [&](int t, int) {
      const auto i = static_cast<size_t>(t);
      start[i] = Clock::now();
      const float r = chains(iters, static_cast<float>(t));
      end[i] = Clock::now();
      sink = sink + r;
    });
    const auto ran = static_cast<std::ptrdiff_t>(team);  // the threads OpenMP granted: only their times were set
    const double s = std::chrono::duration<double>(*std::max_element(end.begin(), end.begin() + ran) -
                                                   *std::min_element(start.begin(), start.begin() + ran))
                         .count();
    best = std::max(best, flops_per_iter * static_cast<double>(iters) * team / s * 1e-9);
  }
  return best;
}

template <class Arch, int A>
double fma_peak_gflops(int threads, ProbeSpec spec) {
  return team_peak_gflops(threads, 2.0 * A * xsimd::batch<float, Arch>::size, fma_chains<Arch, A>, spec);
}

}  // namespace
}  // namespace gpt2attn::bench
