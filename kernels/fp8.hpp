// kernels/fp8.hpp: the fp8 e4m3 storage element (K/V blocks) and its scalar conversions. e4m3 as vLLM's fp8 cache and
// torch.float8_e4m3fn store it: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN;
// the largest finite value is 448, the smallest normal 2^-6, subnormals step by 2^-9. A storage type only: the
// kernels widen it to f32 on load (kernels/vec.hpp) and never compute in it. A cache row carries a power-of-two
// scale (kernels/kv_codec.hpp), which costs no precision and lifts the format's range: rows of any finite size keep
// the relative precision 2^-4, and the widening load needs no multiply.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace gpt2attn::kernels {

struct fp8_e4m3 {
  uint8_t bits;
};

inline constexpr float kFp8Max = 448.0f;

// The value of every code, exact: a normal one is (1 + m/8) 2^(e-7), a subnormal one (e = 0) m 2^-9, S.1111.111 NaN.
constexpr float fp8_e4m3_value(uint8_t b) {
  const int c = b & 0x7f, e = c >> 3, m = c & 7;
  float mag = e == 0 ? static_cast<float>(m) * 0x1p-9f : 1.0f + static_cast<float>(m) / 8.0f;
  for (int k = 7; k < e; ++k) mag *= 2.0f;
  for (int k = e; k < 7 && e > 0; ++k) mag *= 0.5f;
  if (c == 0x7f) mag = std::numeric_limits<float>::quiet_NaN();
  return (b & 0x80) ? -mag : mag;
}

// What the kernels read a code as: its bits shifted into binary16's fields (sign; exponent, whose bias is 15 instead
// of 7; mantissa), which is the code's value times 2^-8, exactly, subnormals included; a row's scale carries the 2^8
// (kernels/kv_codec.hpp). The NaN codes read as +-1.875 that way; the cache never stores them (a row holding NaN
// stores a NaN scale instead).
inline constexpr float kFp8Unit = 0x1p-8f;
inline constexpr std::array<float, 256> kFp8Widened = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const float mag = (b & 0x7f) == 0x7f ? 1.875f : fp8_e4m3_value(static_cast<uint8_t>(b & 0x7f)) * kFp8Unit;
    t[static_cast<size_t>(b)] = (b & 0x80) ? -mag : mag;
  }
  return t;
}();

// x as the kernels read it (kFp8Widened): one load from a 1 KiB table, branch-free (the prefill kernel widens each
// key element it broadcasts this way). The vector loads are in kernels/vec.hpp.
inline float widen(fp8_e4m3 x) { return kFp8Widened[x.bits]; }

// x rounded to the nearest e4m3, ties to even. A finite value beyond the range saturates to +-448, and so does an
// infinity (the format has none; vLLM's cache writer saturates the same way); NaN stays NaN. Magnitudes below 2^-6
// round to the subnormal steps of 2^-9, so a value under 2^-10 stores as zero (of its sign).
inline fp8_e4m3 to_fp8_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return {static_cast<uint8_t>(sign | 0x7fu)};  // NaN
  float a;
  std::memcpy(&a, &u, sizeof a);
  if (a >= 0x1p-6f) {
    // Round binary32's 23 mantissa bits to 3, to nearest even, then rebase the exponent from bias 127 to 7. A
    // carry out of the mantissa moves into the exponent, which is the right result.
    u += 0x7ffffu + ((u >> 20) & 1u);
    const uint32_t code = (u >> 20) - (120u << 3);
    return {static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code))};  // past 448 (0x7e): saturate
  }
  // Subnormal range: a multiple of 2^-9, a * 2^9 < 8 rounded to nearest even by the 1.5 * 2^23 addition (exact:
  // no fraction bits survive it); 8 is the smallest normal, whose code is 8 as well.
  const float r = (a * 0x1p9f + 12582912.0f) - 12582912.0f;
  return {static_cast<uint8_t>(sign | static_cast<uint8_t>(r))};
}

}  // namespace gpt2attn::kernels
