// kernels/bf16_dot.hpp: the bf16 dot-product step of the bf16 micro-kernels, in one small policy per instruction
// set: AVX512-BF16's vdpbf16ps and its portable twin, the same arithmetic on one lane in plain C++.
//
// A "pair" is two bf16 values in one 32-bit lane, element 2i in the low half and 2i + 1 in the high half (the layout
// vdpbf16ps reads). dot2(acc, a, b) = acc + a.lo * b.lo + a.hi * b.hi per lane, in f32: the products of two bf16
// values are exact in f32, so the only roundings are the two additions (vdpbf16ps also flushes denormal inputs
// and results to zero; the twin keeps them: a difference below 2^-126, far inside every tolerance).
// The kernels that use it keep every sum, the softmax and its statistics in f32; what enters a pair is rounded to
// bf16 to nearest even (to_bf16, or vcvtne2ps2bf16, which round alike).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/bf16.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {

// The pair (lo, hi); the two below build it from a row and from two f32 values.
inline uint32_t bf16_pair(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(lo.bits) | static_cast<uint32_t>(hi.bits) << 16;
}
// The pair of x[0] and x[1]; hi_present = false pairs x[0] with a zero (the odd tail of a row) and never reads x[1].
inline uint32_t bf16_pair(const bf16* x, bool hi_present = true) {
  return bf16_pair(x[0], hi_present ? x[1] : bf16{0});
}
inline uint32_t bf16_pair(float lo, float hi) { return bf16_pair(to_bf16(lo), to_bf16(hi)); }

template <class Arch>
struct Bf16Dot;

// The portable twin: one lane.
template <>
struct Bf16Dot<ScalarArch> {
  using B = float;
  using P = uint32_t;
  static constexpr int W = 1;
  static P load(const uint32_t* p) { return *p; }
  static P broadcast(uint32_t pair) { return pair; }
  static B dot2(B acc, P a, P b) {
    const float alo = widen(bf16{static_cast<uint16_t>(a)}), ahi = widen(bf16{static_cast<uint16_t>(a >> 16)});
    const float blo = widen(bf16{static_cast<uint16_t>(b)}), bhi = widen(bf16{static_cast<uint16_t>(b >> 16)});
    return acc + ahi * bhi + alo * blo;  // vdpbf16ps's order: the odd element first
  }
  // W pairs (lo[i], hi[i]) rounded to bf16, from W f32 values each.
  static void pack(const float* lo, const float* hi, uint32_t* dst) { *dst = bf16_pair(*lo, *hi); }
  // W f32 values rounded to bf16. dst may overlap src's first half (a row converted in place, ascending).
  static void narrow(const float* src, bf16* dst) {
    const bf16 x = to_bf16(*src);
    std::memcpy(dst, &x, sizeof x);
  }
  // dst[d] = (r0[d], r1[d]) for d < n; r1 null pairs r0 with zeros.
  static void interleave(const bf16* r0, const bf16* r1, int64_t n, uint32_t* dst) {
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_pair(r0[d], r1 ? r1[d] : bf16{0});
  }
};

#if defined(__AVX512BF16__) && !defined(GPT2ATTN_SCALAR_ONLY)
template <>
struct Bf16Dot<xsimd::avx512f> {
  using B = xsimd::batch<float, xsimd::avx512f>;
  using P = __m512i;
  static constexpr int W = 16;
  static P load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static P broadcast(uint32_t pair) { return _mm512_set1_epi32(static_cast<int>(pair)); }
  static B dot2(B acc, P a, P b) { return B(_mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b)); }
  static void pack(const float* lo, const float* hi, uint32_t* dst) {
    // vcvtne2ps2bf16 puts lo in words 0-15 and hi in words 16-31; vpermw interleaves them into pairs.
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi), _mm512_loadu_ps(lo));
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(order, both));
  }
  static void narrow(const float* src, bf16* dst) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
  }
  static void interleave(const bf16* r0, const bf16* r1, int64_t n, uint32_t* dst) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      auto widen16 = [](const bf16* p) {  // 16 bf16 -> the low halves of 16 lanes
        return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      };
      const __m512i lo = widen16(r0 + d);
      const __m512i hi = r1 ? _mm512_slli_epi32(widen16(r1 + d), 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, hi));
    }
    Bf16Dot<ScalarArch>::interleave(r0 + d, r1 ? r1 + d : nullptr, n - d, dst + d);
  }
};
#endif

}  // namespace gpt2attn::kernels
