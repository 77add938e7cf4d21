// kernels/vec.hpp: the few vector operations the kernels use, over xsimd::batch<float, Arch>, with a
// plain-float twin (ScalarArch) so the scalar fallback runs the very same algorithm without SIMD flags; and the
// element conversions into f32 arithmetic (widen, Vec::load), the one place a new storage element type (bf16, int8 or
// fp8 K/V, int4 weights) adds its loads: the kernels call them by overload, generic over the element type.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#if !defined(GPT2ATTN_SCALAR_ONLY)
#include <xsimd/xsimd.hpp>
#endif

#include "kernels/bf16.hpp"
#include "kernels/fp8.hpp"

namespace gpt2attn::kernels {

struct ScalarArch {};

// 2^f on |f| <= 1/2 by a degree-5 polynomial fitted for the least largest relative error with p(0) = 1 exactly
// (iteratively reweighted least squares on 4000 Chebyshev points): 1.6e-7 at worst over 200001 points evaluated by
// f32 FMAs as exp2() does, against 2.2e-7 for the degree-6 Taylor series (ln(2)^k / k!) it replaced, which cost one
// FMA more per exponential.
inline constexpr float kExp2Poly[6] = {1.0f, 0.693147004f, 0.240222424f, 0.0555073358f, 0.00967151299f, 0.00132647273f};

// Asks for the 64-byte line at p + bytes ahead of its use. The address is computed as an integer: it may lie
// past the end of the buffer (prefetching there is harmless), where pointer arithmetic would be undefined.
inline void prefetch(const void* p, size_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes));
}

// prefetch() into the L2 cache rather than L1: for streams that run far ahead, whose lines would otherwise hold
// L1's few miss buffers for a whole memory latency each (prefetcht2 on x86; the compiler's nearest elsewhere).
inline void prefetch_l2(const void* p, size_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes), 0, 1);
}

// log2(e): scores are kept in log2 units so the softmax runs on exp2 (kernels/attention.hpp, "Units").
inline constexpr float kLog2e = 1.4426950408889634f;

// One stored element as f32 (f32 and bf16: kernels/bf16.hpp; int8: the integer, which its row's scale multiplies
// later, see kernels/kv_layout.hpp). narrow<T>, the way back for the compute types, is in kernels/bf16.hpp too.
inline float widen(int8_t x) { return static_cast<float>(x); }

template <class Arch>
struct Vec;

#if !defined(GPT2ATTN_SCALAR_ONLY)
template <class Arch>
struct Vec {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  static B load(const float* p) { return B::load_unaligned(p); }
  // x pinned in a register: an empty asm the compiler must assume reads and rewrites it, so a vector loaded once
  // and used by several FMAs stays one load instead of becoming a memory operand of each (GCC folds the load into
  // every use, which costs a load-port slot per use). No instruction is emitted.
  static B in_register(B x) {
    auto r = x.data;
    asm("" : "+v"(r));
    return B(r);
  }
  // W bf16 values widened to f32: zero-extend each 16-bit value to 32 and shift it into the high half (exact).
  // One raw intrinsic sequence per instruction set; the scalar twin is widen().
  static B load(const bf16* p) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return B(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    } else {
      static_assert(W == 8, "bf16 loads are written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return B(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
  // Of W pairs of bf16 values (2W values, pair i at p[2i], p[2i + 1]), the first (H = 0) or second (H = 1) of each
  // widened to f32. A 32-bit lane holds a pair, so a shift (first) or a mask (second) widens W values, one ALU
  // operation where load() takes two (a zero-extending shuffle, then the shift). The scalar twin is widen().
  template <int H>
  static B load_pair(const bf16* p) {
    static_assert(H == 0 || H == 1);
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      const __m512i h = _mm512_loadu_si512(p);
      const __m512i w = H == 0 ? _mm512_slli_epi32(h, 16) : _mm512_and_si512(h, _mm512_set1_epi32(-65536));
      return B(_mm512_castsi512_ps(w));
    } else {
      static_assert(W == 8, "bf16 loads are written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i w = H == 0 ? _mm256_slli_epi32(h, 16) : _mm256_and_si256(h, _mm256_set1_epi32(-65536));
      return B(_mm256_castsi256_ps(w));
    }
  }
  // W int8 values as f32: sign-extend to 32 bits, convert (exact). The scalar twin is widen().
  static B load(const int8_t* p) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return B(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
    } else {
      static_assert(W == 8, "int8 loads are written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return B(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
  }
  // W fp8 e4m3 codes as the kernels read them (widen(), kernels/fp8.hpp): each byte sign-extended to 16 bits and
  // shifted so that its exponent and mantissa land in binary16's fields, which vcvtph2ps widens exactly, denormals
  // included; the row's scale carries the 2^8 the change of exponent bias leaves, and a NaN (a NaN scale), so the
  // load needs no multiply and no NaN handling: without them a cold gpt2-small B=16 T=1024 decode step on AVX2 takes
  // 3.38 ms against 3.95 (bench/ab.py over gpt2attn bench --mode decode --cache cold, 2 threads).
  static B load(const fp8_e4m3* p) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return B(_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(kFp8Half))));
    } else {
      static_assert(W == 8, "fp8 loads are written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      return B(_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(kFp8Half))));
    }
  }
  // The shifted byte's bits to keep: sign, exponent, mantissa (bit 14 is a copy of the sign).
  static constexpr short kFp8Half = static_cast<short>(0xbf80);
  // W int32 values as f32, rounded to nearest even past 2^24 (as static_cast<float>, the scalar twin).
  static B load(const int32_t* p) { return xsimd::to_float(xsimd::batch<int32_t, Arch>::load_unaligned(p)); }
  static void store(float* p, B v) { v.store_unaligned(p); }
  // A store that bypasses the caches (vmovntps) where one vector is one whole 64-byte line (AVX-512), for outputs
  // written once and read later by someone else: the line is not read for ownership first, and does not evict the
  // data in use. p must be aligned to the vector (kStreamsLines says whether stream() is a streaming store at all;
  // elsewhere it is store()). stream_fence() orders the streamed lines before any later store (sfence).
  static constexpr bool kStreamsLines = sizeof(B) == 64;
  static void stream(float* p, B v) {
    if constexpr (kStreamsLines) {
      _mm512_stream_ps(p, v);
    } else {
      store(p, v);
    }
  }
  static void stream_fence() {
    if constexpr (kStreamsLines) _mm_sfence();
  }
  static B set1(float x) { return B(x); }
  static B fma(B a, B b, B c) { return xsimd::fma(a, b, c); }
  static B max(B a, B b) { return xsimd::max(a, b); }
  static B min(B a, B b) { return xsimd::min(a, b); }
  static B abs(B a) { return xsimd::abs(a); }
  // Whether some lane of a is above t (NaN lanes are not): a compare and a mask test, no horizontal reduction.
  static bool any_above(B a, float t) { return xsimd::any(a > B(t)); }
  static float sum(B v) { return xsimd::hadd(v); }  // horizontal: the lanes added
  static float reduce_max(B v) {  // horizontal: the largest lane (xsimd 8.1 has no max reducer), by halving
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      return _mm512_reduce_max_ps(v);
    } else {
      static_assert(W == 8, "reduce_max is written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    }
  }
  // A transpose-add in two steps, W row sums for one horizontal sum's price (decode_attention_impl.hpp, dots_w):
  //   fold4(a, b, c, d): in every 128-bit chunk, the 4 rows' sums over that chunk (6 shuffles, 3 adds);
  //   sum_folds(f): W / 4 such folds of rows 0-3, 4-7, ... to one vector whose lane i is row i's whole sum.
  // Small named steps rather than one function over W rows: GCC keeps an array of 16 zmm rows on the stack (a
  // 1 KiB store, clear and reload per call, measured), four rows at a time stay in registers.
  static B fold4(B a, B b, B c, B d) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
      const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
      return B(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd))));
    } else {
      static_assert(W == 8, "fold4 is written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      const __m256d ab = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)));
      const __m256d cd = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d)));
      return B(_mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd))));
    }
  }
  static B sum_folds(const B* f) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      // Chunks (0 + 1, 2 + 3) of f[0] and f[1], then of f[2] and f[3]; then the two halves of each row's sum.
      const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88), _mm512_shuffle_f32x4(f[0], f[1], 0xDD));
      const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x88), _mm512_shuffle_f32x4(f[2], f[3], 0xDD));
      return B(_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD)));
    } else {
      return B(_mm256_add_ps(_mm256_permute2f128_ps(f[0], f[1], 0x20), _mm256_permute2f128_ps(f[0], f[1], 0x31)));
    }
  }
  // r[0..W) as a W x W matrix, transposed in registers: afterwards r[j] holds lane j of every row. Unpacks within
  // 128-bit chunks, then 128-bit chunk shuffles (AVX-512: 64 shuffles for 256 values, against a load and a store
  // each one at a time). The scalar twin (W = 1) is the identity.
  static void transpose(B* r) {
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
      __m512 a[16], b[16];
      for (int k = 0; k < 8; ++k) {
        a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
      }
      // b[4k + c], chunk L: column 4L + c of rows 4k .. 4k + 3.
      for (int k = 0; k < 4; ++k) {
        const __m512d x0 = _mm512_castps_pd(a[4 * k]), x1 = _mm512_castps_pd(a[4 * k + 1]);
        const __m512d x2 = _mm512_castps_pd(a[4 * k + 2]), x3 = _mm512_castps_pd(a[4 * k + 3]);
        b[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
        b[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
        b[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
        b[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
      }
      // Row 4L + c gathers chunk L of b[c], b[4 + c], b[8 + c], b[12 + c].
      for (int c = 0; c < 4; ++c) {
        const __m512 lo01 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44), hi01 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
        const __m512 lo23 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
        const __m512 hi23 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
        r[c] = B(_mm512_shuffle_f32x4(lo01, lo23, 0x88));
        r[4 + c] = B(_mm512_shuffle_f32x4(lo01, lo23, 0xDD));
        r[8 + c] = B(_mm512_shuffle_f32x4(hi01, hi23, 0x88));
        r[12 + c] = B(_mm512_shuffle_f32x4(hi01, hi23, 0xDD));
      }
    } else {
      static_assert(W == 8, "transpose is written for AVX-512 (16 lanes) and AVX2 (8 lanes)");
      __m256 a[8], b[8];
      for (int k = 0; k < 4; ++k) {
        a[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
      }
      for (int k = 0; k < 2; ++k) {
        const __m256d x0 = _mm256_castps_pd(a[4 * k]), x1 = _mm256_castps_pd(a[4 * k + 1]);
        const __m256d x2 = _mm256_castps_pd(a[4 * k + 2]), x3 = _mm256_castps_pd(a[4 * k + 3]);
        b[4 * k] = _mm256_castpd_ps(_mm256_unpacklo_pd(x0, x2));
        b[4 * k + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(x0, x2));
        b[4 * k + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(x1, x3));
        b[4 * k + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(x1, x3));
      }
      for (int c = 0; c < 4; ++c) {
        r[c] = B(_mm256_permute2f128_ps(b[c], b[4 + c], 0x20));
        r[4 + c] = B(_mm256_permute2f128_ps(b[c], b[4 + c], 0x31));
      }
    }
  }
  // 2^x, exactly 0 below -126 (so a masked -inf score contributes nothing) and NaN for NaN (bad input
  // must not pass for a masked row). Range reduction x = n + f, |f| <= 1/2, then 2^f by kExp2Poly (relative
  // error below 1.6e-7, about one float ulp), and 2^n built in the exponent bits.
  // AVX-512 (kExp2Scalef) builds 2^n with vscalefps (p * 2^n in one instruction, the zeroing of x < -126 in its
  // mask) from n rounded as a float (the 1.5 * 2^23 shifter: nearest even, as the conversion to int rounds, for
  // every x above -126 and below 2^22, which holds all a softmax gives it: a score minus the running max), in
  // place of exp2_bits' conversions to and from int, exponent arithmetic, multiply and selects: 10 instructions
  // instead of 14, the same results bit for bit (the same n, f and p, and p * 2^n rounded once either way; tested).
  // The softmax runs one per score: the gpt2-small T=1024 core, one thread, 12.55 -> 12.2 ms (medians of 6
  // alternated runs of Core/gpt2-small/T:1024/threads:1).
  static constexpr bool kExp2Scalef = std::is_same_v<Arch, xsimd::avx512f>;
  static B exp2(B x) {
    if constexpr (kExp2Scalef) {
      const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // NaN kept
      const __m512 shifter = _mm512_set1_ps(12582912.0f);                               // 1.5 * 2^23
      const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, shifter), shifter);
      const B f = B(_mm512_sub_ps(x, n));
      B p = B(kExp2Poly[5]);
      for (int k = 4; k >= 0; --k) p = xsimd::fma(p, f, B(kExp2Poly[k]));
      return B(_mm512_maskz_scalef_ps(keep, p, n));
    } else {
      return exp2_bits(x);
    }
  }
  static B exp2_bits(B x) {
    using I = xsimd::batch<int32_t, Arch>;
    const auto underflow = x < B(-126.0f);  // false for NaN, which then flows through f and p
    const B xc = xsimd::select(underflow, B(-126.0f), x);
    const I n = xsimd::nearbyint_as_int(xc);
    const B f = xc - xsimd::to_float(n);
    B p = B(kExp2Poly[5]);
    for (int k = 4; k >= 0; --k) p = xsimd::fma(p, f, B(kExp2Poly[k]));
    const B two_n = xsimd::bitwise_cast<B>((n + I(127)) << 23);
    return xsimd::select(underflow, B(0.0f), p * two_n);
  }
  // Where m == -inf (every key masked so far) substitute 0, so exp(s - m) stays 0 instead of NaN.
  static B finite_or_zero(B m) { return xsimd::select(m == B(-INFINITY), B(0.0f), m); }
  // x with lanes k < n (0 < n < W) set to -inf: the causal diagonal crossing one vector of queries.
  static B mask_lanes_below(B x, int64_t n) {
    static constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static_assert(W <= 16);
    return xsimd::select(B::load_unaligned(kIota) < B(static_cast<float>(n)), B(-INFINITY), x);
  }
};
#endif

template <>
struct Vec<ScalarArch> {
  using B = float;
  static constexpr int W = 1;
  static B load(const float* p) { return *p; }
  static B in_register(B x) { return x; }
  static B load(const bf16* p) { return widen(*p); }
  template <int H>
  static B load_pair(const bf16* p) { return widen(p[H]); }
  static B load(const int8_t* p) { return widen(*p); }
  static B load(const fp8_e4m3* p) { return widen(*p); }
  static B load(const int32_t* p) { return static_cast<float>(*p); }
  static void store(float* p, B v) { *p = v; }
  static constexpr bool kStreamsLines = false;
  static void stream(float* p, B v) { *p = v; }
  static void stream_fence() {}
  static B set1(float x) { return x; }
  static B fma(B a, B b, B c) { return std::fma(a, b, c); }
  static B max(B a, B b) { return a > b ? a : b; }
  static B min(B a, B b) { return a < b ? a : b; }
  static B abs(B a) { return std::fabs(a); }
  static bool any_above(B a, float t) { return a > t; }
  static float sum(B v) { return v; }
  static float reduce_max(B v) { return v; }
  static void transpose(B*) {}  // one lane: a 1 x 1 matrix
  static constexpr bool kExp2Scalef = false;
  static B exp2(B x) { return x < -126.0f ? 0.0f : std::exp2(x); }
  static B finite_or_zero(B m) { return m == -INFINITY ? 0.0f : m; }
  static B mask_lanes_below(B x, int64_t n) { return n > 0 ? -INFINITY : x; }
};

}  // namespace gpt2attn::kernels
