// bench/int8_dot_peak_avx512vnni.cpp: the int8 dot-product peak, vpdpbusd chains (compiled with AVX512-VNNI): the
// ceiling of int8 weights' integer GEMMs (oneDNN's u8 x s8 matmul runs on it). 16 accumulators cover its latency x
// ports; the operands stay constant so the loop is nothing but vpdpbusd.
#include <immintrin.h>

#include "bench/fma_peak.hpp"
#include "bench/fma_peak_impl.hpp"

namespace gpt2attn::bench {
namespace {

template <int A>
float dpbusd_chains(long iters, float seed) {
  __m512i acc[A];
  for (int i = 0; i < A; ++i) acc[i] = _mm512_set1_epi32(static_cast<int>(seed) + i);
  // Each step adds 4 x 1 x 1 to a lane: far from int32's range in a trial of ~10^8 steps.
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < A; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i sum = acc[0];
  for (int i = 1; i < A; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  alignas(64) int lanes[16];
  _mm512_store_si512(lanes, sum);
  long total = 0;
  for (int v : lanes) total += v;
  return static_cast<float>(total);
}

}  // namespace

double int8_dot_peak_gops_avx512vnni(int threads) {
  constexpr int A = 16;
  // 64 byte products a vpdpbusd, each a multiply and an add: 128 operations.
  return team_peak_gflops(threads, 128.0 * A, dpbusd_chains<A>, ProbeSpec{});
}

}  // namespace gpt2attn::bench
