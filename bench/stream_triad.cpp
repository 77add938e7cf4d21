// bench/stream_triad.cpp: the STREAM-style triad (see stream_triad.hpp). Plain C++ on the engine's OpenMP team
// (engine/team.hpp), compiled with the baseline flags: a memory-bound loop gains nothing from wider vectors, so
// there is no per-ISA copy.
#include "bench/stream_triad.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>

#include "engine/team.hpp"

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

// a[i] = b[i] + s*c[i] over [begin, end).
void triad_range(float* __restrict a, const float* __restrict b, const float* __restrict c, float s, int64_t begin,
                 int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

// The triad over [0, n), each thread of the team its static share: the same cut as the first touch, so each thread
// streams the pages it placed.
void triad(float* a, const float* b, const float* c, float s, int64_t n, int threads) {
  gpt2attn::detail::team_run(threads, [&](int t, int team) {
    const auto [begin, end] = gpt2attn::detail::static_share(n, team, t);
    triad_range(a, b, c, s, begin, end);
  });
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
  gpt2attn::detail::team_run(threads, [&](int t, int team) {  // first touch, the triad's cut
    const auto [begin, end] = gpt2attn::detail::static_share(n, team, t);
    for (int64_t i = begin; i < end; ++i) pa[i] = 0.0f, pb[i] = 1.0f, pc[i] = 2.0f;
  });

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
