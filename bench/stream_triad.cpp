// bench/stream_triad.cpp: the STREAM-style triad (see stream_triad.hpp). Plain C++ with OpenMP, compiled with
// the baseline flags: a memory-bound loop gains nothing from wider vectors, so there is no per-ISA copy.
#include "bench/stream_triad.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>

namespace gpt2attn::bench {
namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Array = std::unique_ptr<float[], FreeDeleter>;

Array page_aligned(size_t n) {
  const size_t bytes = (n * sizeof(float) + 4095) / 4096 * 4096;
  auto* p = static_cast<float*>(std::aligned_alloc(4096, bytes));
  if (!p) throw std::bad_alloc();
  return Array(p);
}

// a[i] = b[i] + s*c[i] over [0, n) split statically across the team: the same split as the first touch, so
// each thread streams the pages it placed.
void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s, int64_t n,
           int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace

double stream_triad_gbps(int threads, size_t array_bytes, int trials) {
  if (threads < 1) throw std::invalid_argument("stream triad: threads must be >= 1");
  const auto n = static_cast<int64_t>(array_bytes / sizeof(float));
  if (n < 1) throw std::invalid_argument("stream triad: array_bytes too small");
  Array a = page_aligned(static_cast<size_t>(n)), b = page_aligned(static_cast<size_t>(n)),
        c = page_aligned(static_cast<size_t>(n));
  float* pa = a.get();
  float* pb = b.get();
  float* pc = c.get();
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) pa[i] = 0.0f, pb[i] = 1.0f, pc[i] = 2.0f;  // first touch, same split

  using Clock = std::chrono::steady_clock;
  triad(pa, pb, pc, 0.5f, n, threads);  // wakes the team and settles the clock
  double best = 0;
  for (int t = 0; t < std::max(trials, 1); ++t) {
    const auto t0 = Clock::now();
    triad(pa, pb, pc, 0.5f, n, threads);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, kTriadBytesPerElement * static_cast<double>(n) / s * 1e-9);
  }
  // Keeps the stores observable (a[] is otherwise never read).
  volatile float sink = pa[n / 2];
  (void)sink;
  return best;
}

}  // namespace gpt2attn::bench
