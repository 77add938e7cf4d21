// kernels/kv_codec.hpp: the one conversion between f32 K/V rows and a block's stored format (kernels/kv_layout.hpp):
// f32 copies, bf16 rounds to nearest even, int8 quantises symmetrically and fp8 rounds to nearest even after a
// power-of-two scale, each of those two with one scale per (token, head). A finite value past what a format holds
// saturates to its largest finite value of that sign (bf16's past 0x1.fep127; int8 and fp8 hold all of f32's range),
// as vLLM's fp8 cache saturates: a cache never turns a finite value into inf; inf and NaN stay non-finite. Used by
// the cache's writer and reader (KvCache::Impl::store_row / load_row) and by the kernel tests that build blocks by
// hand, so both see exactly what a cache holds. Scalar and pure: runs once per appended row (in decode, B * H_kv * 2
// rows a step), never per key read.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.hpp"
#include "kernels/fp8.hpp"
#include "kernels/kv_layout.hpp"

namespace gpt2attn::kernels {

// int8 storage: q = round(x / scale), scale = max|x| / 127 over the row's D values, so |q| <= 127 (the symmetric
// range; -128 is never used) and every value is off by at most half a step, scale / 2 = max|x| / 254. A row of
// zeros stores scale 0. A row holding inf or NaN stores that (non-finite) scale and zeros, so it reads back as NaN:
// bad values stay visible instead of turning into plausible numbers.
inline constexpr float kInt8Levels = 127.0f;
inline constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

// The largest |x| of a row, NaN when it holds one. Plain comparisons, not std::fmax: with the engine's baseline
// flags that is a library call per element, and decode stores B * H_kv * 2 rows every step (measured for int8 at
// D = 64: 322 ns a row with the calls, 92 without; 384 rows a gpt2-small B=16 step).
inline float row_amax(const float* src, int64_t D) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(src[d]);
    nan = nan || a != a;
    amax = a > amax ? a : amax;
  }
  return nan ? NAN : amax;
}

// The scale of a cache row whose largest magnitude is amax (finite, > 0): the power of two 2^k that puts amax /
// 2^(k-8) in (224, 448], e4m3's top binade, so the row's values keep e4m3's relative precision and none saturates;
// a power of two, so scaling adds no rounding. value = widen(code) * scale. A row past 1.75 * 2^127 would need 2^128:
// it takes amax / 1.75 instead (one rounding of the scale, 2^-24), so FLT_MAX itself is held, not saturated.
inline float fp8_row_scale(float amax) {
  int e = 0;
  const float f = std::frexp(amax, &e);  // amax = f 2^e, f in [0.5, 1)
  const int k = e - 1 + (f > 0.875f ? 1 : 0);
  if (k <= 127) return std::ldexp(1.0f, k);
  const float s = amax / 1.75f;
  return std::isfinite(1.75f * s) ? s : std::nextafter(s, 0.0f);  // 448 * 2^-8 * s, the largest read back, finite
}

inline void store_kv_row(const KvLayout& layout, std::byte* block, KvPart part, int64_t h, int64_t slot,
                         const float* src) {
  const int64_t D = layout.D;
  switch (layout.dtype) {
    case DType::bf16: {
      bf16* dst = layout.row<bf16>(block, part, h, slot);
      for (int64_t d = 0; d < D; ++d) {
        bf16 b = to_bf16(src[d]);
        // Rounding carried a finite value past bf16's largest, 0x7f7f, into inf's code 0x7f80: step back to it.
        if ((b.bits & 0x7fff) == 0x7f80 && std::fabs(src[d]) <= FLT_MAX) b.bits = static_cast<uint16_t>(b.bits - 1);
        dst[d] = b;
      }
      return;
    }
    case DType::fp8: {
      // Rows of zeros, and rows holding inf or NaN, store zeros and scale 0, inf or NaN, as int8 does below. The
      // scale is a power of two (fp8_row_scale), so x * (256 / scale) is exact and the one rounding is e4m3's. In
      // double: 256 / scale exceeds float's range for the smallest scales.
      const float amax = row_amax(src, D);
      const bool finite = std::isfinite(amax) && amax > 0.0f;
      const float scale = finite ? fp8_row_scale(amax) : amax;
      fp8_e4m3* dst = layout.row<fp8_e4m3>(block, part, h, slot);
      const double inv = finite ? 1.0 / (static_cast<double>(scale) * kFp8Unit) : 0.0;
      for (int64_t d = 0; d < D; ++d) dst[d] = finite ? to_fp8_e4m3(static_cast<float>(src[d] * inv)) : fp8_e4m3{0};
      *layout.scales(block, part, h, slot) = scale;
      return;
    }
    case DType::i8: {
      // Plain comparisons and the rounding below, not std::nearbyint (a library call per element, row_amax).
      const float amax = row_amax(src, D);
      float scale = amax / kInt8Levels;
      // Near FLT_MAX the quotient can round up so far that 127 * scale, the largest value read back, is inf.
      if (std::isfinite(amax) && !std::isfinite(kInt8Levels * scale)) scale = std::nextafter(scale, 0.0f);
      int8_t* dst = layout.row<int8_t>(block, part, h, slot);
      const float inv = kInt8Levels / amax;
      if (std::isfinite(scale) && scale > 0.0f && std::isfinite(inv)) {
        for (int64_t d = 0; d < D; ++d) {
          // Round to nearest, ties to even (as std::nearbyint in the default mode): adding and subtracting 1.5 *
          // 2^23 leaves no fraction bits, and |x * inv| <= 127 is far inside the range where that is exact.
          const float r = (src[d] * inv + kRoundMagic) - kRoundMagic;
          dst[d] = static_cast<int8_t>(r > kInt8Levels ? kInt8Levels : r < -kInt8Levels ? -kInt8Levels : r);
        }
      } else if (std::isfinite(scale) && scale > 0.0f) {
        // amax below 127 / FLT_MAX (denormal-sized rows): 127 / amax overflows float, so the row is scaled in double.
        const double inv_wide = kInt8Levels / static_cast<double>(amax);
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::nearbyint(src[d] * inv_wide));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = 0;
      }
      *layout.scales(block, part, h, slot) = scale;
      return;
    }
    default:
      std::memcpy(layout.row<float>(block, part, h, slot), src, static_cast<size_t>(layout.row_bytes()));
  }
}

inline void load_kv_row(const KvLayout& layout, const std::byte* block, KvPart part, int64_t h, int64_t slot,
                        float* dst) {
  const int64_t D = layout.D;
  switch (layout.dtype) {
    case DType::bf16: {
      const bf16* src = layout.row<bf16>(block, part, h, slot);
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]);
      return;
    }
    case DType::fp8: {
      const fp8_e4m3* src = layout.row<fp8_e4m3>(block, part, h, slot);
      const float scale = *layout.scales(block, part, h, slot);
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * scale;
      return;
    }
    case DType::i8: {
      const int8_t* src = layout.row<int8_t>(block, part, h, slot);
      const float scale = *layout.scales(block, part, h, slot);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
      return;
    }
    default:
      std::memcpy(dst, layout.row<float>(block, part, h, slot), static_cast<size_t>(layout.row_bytes()));
  }
}

}  // namespace gpt2attn::kernels
