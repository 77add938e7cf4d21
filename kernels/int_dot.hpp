// kernels/int_dot.hpp: the integer dot products of decode's score side over an int8 K cache: a query row quantised
// once to int16 against int8 key rows, summed exactly in int32, in one small policy per instruction set (AVX-512BW
// vpmovsxbw + vpmaddwd + vpaddd, or vpmovsxbw + vpdpwssd with AVX512-VNNI; AVX2 the first on 256 bits) and its
// portable twin, the same integer arithmetic on one lane in plain C++. Integer sums are exact, so every instruction
// set gives the twin's result bit for bit.
// It does not scale or convert: the caller multiplies a dot by the query's and the key's scales.
//
// Overflow: |q| <= 32767 (symmetric, quantize_query_i16) and |k| <= 128, so a dot over n elements is bounded by
// n * 32767 * 128, below 2^31 for n <= 512 (kIntDotMaxLen), whatever the order of the partial sums. Longer rows are
// summed by the caller in chunks of at most kIntDotMaxLen, each chunk's int32 converted to f32 and added.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/decode_attention.hpp"  // kIntDotMaxLen, IntDotKernel: what the tests see of this header
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {

inline constexpr float kQueryI16Levels = 32767.0f;

// Internal linkage, like the kernels that include it: each instruction set's translation unit keeps its own copy,
// compiled with its own flags (an inline function shared across them could be linked from the wrong one).
namespace {

// q[d] = round(x[d] * c / scale) with scale = c * max|x| / 32767, symmetric (|q| <= 32767), returned; each value is
// off by at most half a step, max|x * c| / 65534 (about 2^-16 of the row's largest value). A row of zeros gives
// scale 0 (exact); a row holding inf or NaN gives a non-finite scale and zeros, so its scores read back NaN.
// Plain comparisons and the 1.5 * 2^23 rounding, not library calls (as kernels/kv_codec.hpp's store_kv_row).
// The largest |x * c| is found W lanes at a time (a max is exact in any order, so every instruction set finds the
// same one): one float at a time it was a chain of dependent maxima, 10% of the int8 kernel's run loop at T = 256.
// Alongside, 0 * |x * c| summed: NaN when some value is NaN or infinite, which then makes the scale NaN.
template <class Arch>
float quantize_query_i16(const float* x, float c, int64_t n, int16_t* q) {
  using V = Vec<Arch>;
  using B = typename V::B;
  const B cv = V::set1(c), zero = V::set1(0.0f);
  B mv = zero, bad = zero;
  int64_t d = 0;
  for (; d + V::W <= n; d += V::W) {
    const B a = V::abs(V::load(x + d) * cv);
    mv = V::max(mv, a);
    bad = V::fma(a, zero, bad);
  }
  float amax = V::reduce_max(mv), tail_bad = 0.0f;
  for (; d < n; ++d) {
    const float a = std::fabs(x[d] * c);
    amax = a > amax ? a : amax;
    tail_bad += a * 0.0f;
  }
  if (V::sum(bad) + tail_bad != 0.0f) amax = NAN;
  const float scale = amax / kQueryI16Levels, levels_per_amax = kQueryI16Levels / amax;
  if (std::isfinite(scale) && scale > 0.0f && !std::isfinite(levels_per_amax)) {
    // amax below 32767 / FLT_MAX (denormal-sized rows): the factor overflows float, so the row is scaled in double.
    const double inv_wide = kQueryI16Levels / static_cast<double>(amax) * c;
    for (int64_t d = 0; d < n; ++d) q[d] = static_cast<int16_t>(std::nearbyint(x[d] * inv_wide));
  } else if (std::isfinite(scale) && scale > 0.0f) {
    const float inv = levels_per_amax * c;
    constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to nearest even
    for (int64_t d = 0; d < n; ++d) {
      const float r = (x[d] * inv + kMagic) - kMagic;
      q[d] = static_cast<int16_t>(r > kQueryI16Levels ? kQueryI16Levels : r < -kQueryI16Levels ? -kQueryI16Levels : r);
    }
  } else {
    for (int64_t d = 0; d < n; ++d) q[d] = 0;
  }
  return scale;
}

template <class Arch>
struct IntDot;

// The portable twin: out[r] = sum_{d < n} q[d] * k[r * ldk + d] for r < keys, in int32 (n <= kIntDotMaxLen).
template <>
struct IntDot<ScalarArch> {
  static constexpr int kKeys = 1;  // keys a full call scores
  static void dots(const int16_t* q, const int8_t* k, int64_t ldk, int64_t n, int keys, int32_t* out) {
    for (int r = 0; r < keys; ++r) {
      int32_t t = 0;
      for (int64_t d = 0; d < n; ++d) t += static_cast<int32_t>(q[d]) * static_cast<int32_t>(k[r * ldk + d]);
      out[r] = t;
    }
  }
};

#if !defined(GPT2ATTN_SCALAR_ONLY)
// AVX-512BW (16 int32 lanes) and AVX2 (8): a step widens L int8 key values to int16 (vpmovsxbw) and multiplies them
// pairwise with L int16 query values into L/2 int32 lanes (vpmaddwd), added to the key's accumulator. A full call
// scores kKeys = the int32 lanes keys, 8 accumulators at a time, and reduces them all at once by a transpose-add
// (fold4, sum_folds: the integer copy of Vec's, decode_attention_impl.hpp dots_w) rather than one horizontal sum per
// key. Fewer keys (a run's ragged end) take one horizontal sum each.
// The int32 register (not std::conditional_t: a vector type as a template argument loses its attributes).
template <bool k512>
struct IntReg {
  using type = __m512i;
};
template <>
struct IntReg<false> {
  using type = __m256i;
};

template <class Arch>
struct IntDot {
  static constexpr bool k512 = std::is_same_v<Arch, xsimd::avx512f>;
  using I = typename IntReg<k512>::type;
  static constexpr int kKeys = k512 ? 16 : 8;
  static constexpr int L = 2 * kKeys;  // elements per step

  static I zero() {
    if constexpr (k512) return _mm512_setzero_si512(); else return _mm256_setzero_si256();
  }
  static I add(I a, I b) {
    if constexpr (k512) return _mm512_add_epi32(a, b); else return _mm256_add_epi32(a, b);
  }
  // acc + q . kw pairwise into the int32 lanes: one vpdpwssd where the translation unit is compiled for AVX512-VNNI
  // (the avx512_bf16 level), else vpmaddwd and vpaddd. The same integers either way: |q| <= 32767 keeps vpmaddwd's
  // pair sum in range, and both would wrap alike on the add (the overflow bound above keeps it from happening).
  static I madd_add(I acc, I q, I kw) {
    if constexpr (k512) {
#if defined(__AVX512VNNI__)
      return _mm512_dpwssd_epi32(acc, q, kw);
#else
      return _mm512_add_epi32(acc, _mm512_madd_epi16(q, kw));
#endif
    } else {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(q, kw));
    }
  }
  // acc + pairwise q[i] * k[i] over L elements.
  static I step(I acc, const int16_t* q, const int8_t* k) {
    if constexpr (k512) {
      const I kw = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
      return madd_add(acc, _mm512_loadu_si512(q), kw);
    } else {
      const I kw = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
      return madd_add(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), kw);
    }
  }
  // The last m < L elements: AVX-512 masked loads (masked-out bytes are never read); AVX2 leaves them to tail().
  static I step_tail(I acc, const int16_t* q, const int8_t* k, int64_t m) {
    if constexpr (k512) {
      const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << m) - 1);
      const I kw = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, k));
      return madd_add(acc, _mm512_maskz_loadu_epi16(mask, q), kw);
    } else {
      (void)q, (void)k, (void)m;
      return acc;
    }
  }
  static int32_t tail(const int16_t* q, const int8_t* k, int64_t m) {
    int32_t t = 0;
    if constexpr (!k512) {
      for (int64_t d = 0; d < m; ++d) t += static_cast<int32_t>(q[d]) * static_cast<int32_t>(k[d]);
    } else {
      (void)q, (void)k, (void)m;
    }
    return t;
  }
  static I fold4(I a, I b, I c, I d) {
    if constexpr (k512) {
      const I ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
      const I cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
      return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    } else {
      const I ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
      const I cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
      return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    }
  }
  static I sum_folds(const I* f) {
    if constexpr (k512) {
      const I w0 = _mm512_add_epi32(_mm512_shuffle_i32x4(f[0], f[1], 0x88), _mm512_shuffle_i32x4(f[0], f[1], 0xDD));
      const I w1 = _mm512_add_epi32(_mm512_shuffle_i32x4(f[2], f[3], 0x88), _mm512_shuffle_i32x4(f[2], f[3], 0xDD));
      return _mm512_add_epi32(_mm512_shuffle_i32x4(w0, w1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0xDD));
    } else {
      return _mm256_add_epi32(_mm256_permute2x128_si256(f[0], f[1], 0x20), _mm256_permute2x128_si256(f[0], f[1], 0x31));
    }
  }
  static int32_t reduce(I a) {
    if constexpr (k512) {
      return _mm512_reduce_add_epi32(a);
    } else {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      return _mm_cvtsi128_si32(s);
    }
  }

  // Inlined into the decode kernel's score loop (GCC kept it out of line: a call per 16 keys and head). One-thread
  // scratch harness, int8 cache, 12 K/V heads, 7 alternated rounds: 6.71 -> 6.51 ns per head-key with the K/V in L2,
  // 11.14 -> 10.85 cold; a gpt2-small B=16 decode step within its noise.
  [[gnu::always_inline]] static void dots(const int16_t* q, const int8_t* k, int64_t ldk, int64_t n, int keys,
                                          int32_t* out) {
    const int64_t nv = n / L * L;  // elements in whole steps
    if (keys == kKeys) {
      I folds[kKeys / 4];
      for (int r0 = 0; r0 < kKeys; r0 += 8) {
        const int8_t* k0 = k + r0 * ldk;
        I a0 = zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < nv; d += L) {
          a0 = step(a0, q + d, k0 + d);
          a1 = step(a1, q + d, k0 + ldk + d);
          a2 = step(a2, q + d, k0 + 2 * ldk + d);
          a3 = step(a3, q + d, k0 + 3 * ldk + d);
          a4 = step(a4, q + d, k0 + 4 * ldk + d);
          a5 = step(a5, q + d, k0 + 5 * ldk + d);
          a6 = step(a6, q + d, k0 + 6 * ldk + d);
          a7 = step(a7, q + d, k0 + 7 * ldk + d);
        }
        if constexpr (k512) {
          if (nv < n) {
            const int64_t m = n - nv;
            a0 = step_tail(a0, q + nv, k0 + nv, m);
            a1 = step_tail(a1, q + nv, k0 + ldk + nv, m);
            a2 = step_tail(a2, q + nv, k0 + 2 * ldk + nv, m);
            a3 = step_tail(a3, q + nv, k0 + 3 * ldk + nv, m);
            a4 = step_tail(a4, q + nv, k0 + 4 * ldk + nv, m);
            a5 = step_tail(a5, q + nv, k0 + 5 * ldk + nv, m);
            a6 = step_tail(a6, q + nv, k0 + 6 * ldk + nv, m);
            a7 = step_tail(a7, q + nv, k0 + 7 * ldk + nv, m);
          }
        }
        folds[r0 / 4] = fold4(a0, a1, a2, a3);
        folds[r0 / 4 + 1] = fold4(a4, a5, a6, a7);
      }
      if constexpr (k512) {
        _mm512_storeu_si512(out, sum_folds(folds));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), sum_folds(folds));
        if (nv < n) {
          for (int r = 0; r < kKeys; ++r) out[r] += tail(q + nv, k + r * ldk + nv, n - nv);
        }
      }
      return;
    }
    for (int r = 0; r < keys; ++r) {
      const int8_t* kr = k + r * ldk;
      I a = zero();
      for (int64_t d = 0; d < nv; d += L) a = step(a, q + d, kr + d);
      if (nv < n) a = step_tail(a, q + nv, kr + nv, n - nv);
      out[r] = reduce(a) + tail(q + nv, kr + nv, n - nv);
    }
  }
};
#endif

// The integer lanes of the quantized few-row projections (kernels/linear_impl.hpp): W int32 lanes, each adding an
// int16 pair of x (broadcast) times a pair of weights widened to int16 (IntDot::madd_add: vpdpwssd with AVX512-VNNI,
// else vpmaddwd + vpaddd), and the loads that widen a panel's 2W bytes (kernels/linear.hpp's layout): int8 codes
// into one pair a lane, int4 nibbles (code + 8, in [0, 15]) into two. The scalar twin: one lane, the same integers.
// Overflow: |x| <= 32767 and |w| <= 127 keep a pair's sum in range and a sum over n <= 512 inputs below 2^31;
// the kernel converts its sums to f32 at least every kLinearKChunk = 256 inputs.
template <class Arch>
struct IntLanes;

template <>
struct IntLanes<ScalarArch> {
  struct Pair {
    int32_t a, b;
  };
  using I = int32_t;
  using X = Pair;  // x's pair
  using Wt = Pair;  // the weights' pair
  static I set1(int32_t v) { return v; }
  static X pair(const int16_t* x) { return {x[0], x[1]}; }
  static I dot(I acc, X x, Wt w) { return acc + x.a * w.a + x.b * w.b; }
  static Wt load_int8(const int8_t* p) { return {p[0], p[1]}; }
  static void load_int4(const uint8_t* p, Wt& lo, Wt& hi) {
    lo = {p[0] & 0x0f, p[1] & 0x0f};
    hi = {p[0] >> 4, p[1] >> 4};
  }
  static float to_float(I v) { return static_cast<float>(v); }
};

#if !defined(GPT2ATTN_SCALAR_ONLY)
template <class Arch>
struct IntLanes {
  static constexpr bool k512 = IntDot<Arch>::k512;
  using I = typename IntDot<Arch>::I;
  using X = I;
  using Wt = I;
  static I set1(int32_t v) {
    if constexpr (k512) return _mm512_set1_epi32(v); else return _mm256_set1_epi32(v);
  }
  static X pair(const int16_t* x) {
    int32_t v;
    std::memcpy(&v, x, sizeof v);
    if constexpr (k512) return _mm512_set1_epi32(v); else return _mm256_set1_epi32(v);
  }
  static I dot(I acc, X x, Wt w) { return IntDot<Arch>::madd_add(acc, x, w); }
  static Wt load_int8(const int8_t* p) {
    if constexpr (k512) {
      return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
  }
  // Each byte zero-extended to 16 bits: its low nibble masked, its high one shifted down (unsigned: the codes' + 8
  // leaves the kernel's sums, as -8 x sum(x) per group; sign-extending instead took two shifts a nibble, on the one
  // port the dot products use).
  static void load_int4(const uint8_t* p, Wt& lo, Wt& hi) {
    if constexpr (k512) {
      const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      lo = _mm512_and_si512(u, _mm512_set1_epi16(0x0f));
      hi = _mm512_srli_epi16(u, 4);
    } else {
      const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      lo = _mm256_and_si256(u, _mm256_set1_epi16(0x0f));
      hi = _mm256_srli_epi16(u, 4);
    }
  }
  static typename Vec<Arch>::B to_float(I v) {
    if constexpr (k512) return typename Vec<Arch>::B(_mm512_cvtepi32_ps(v)); else return typename Vec<Arch>::B(_mm256_cvtepi32_ps(v));
  }
};
#endif

// The dot products of instruction set Arch as the tests see them (IsaKernels::int_dot).
template <Isa Level, class Arch>
const IntDotKernel& make_int_dot_kernel() {
  static const IntDotKernel kernel{Level, IntDot<Arch>::kKeys, &IntDot<Arch>::dots, &quantize_query_i16<Arch>};
  return kernel;
}

}  // namespace

}  // namespace gpt2attn::kernels
