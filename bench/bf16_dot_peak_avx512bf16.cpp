// bench/bf16_dot_peak_avx512bf16.cpp: the bf16 dot-product peak, vdpbf16ps chains (compiled with AVX512-BF16).
// 16 accumulators cover its latency x 2 ports; the operands stay constant so the loop is nothing but vdpbf16ps.
#include <immintrin.h>

#include "bench/fma_peak.hpp"
#include "bench/fma_peak_impl.hpp"

namespace gpt2attn::bench {
namespace {

template <int A>
float dpbf16_chains(long iters, float seed) {
  __m512 acc[A];
  for (int i = 0; i < A; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  // 2^-10 * 2^-10 per product: the sums grow by 2^-15 a lane each step and stay normal and exact for ~2^39 steps.
  const __m512 x = _mm512_set1_ps(0x1p-10f);
  const __m512bh a = _mm512_cvtne2ps_pbh(x, x), b = a;
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < A; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 sum = acc[0];
  for (int i = 1; i < A; ++i) sum = _mm512_add_ps(sum, acc[i]);
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12 warns inside it (PR 105593)
  _mm512_store_ps(lanes, sum);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

}  // namespace

double bf16_dot_peak_gflops_avx512bf16(int threads) {
  constexpr int A = 16;
  return team_peak_gflops(threads, 64.0 * A, dpbf16_chains<A>, ProbeSpec{});
}

}  // namespace gpt2attn::bench
