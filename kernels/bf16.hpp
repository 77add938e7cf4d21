// kernels/bf16.hpp: the bfloat16 storage element (K/V blocks) and its scalar conversions, shared by the kernels
// (kernels/vec.hpp widens it in vectors) and the engine's K/V writer and reader. No SIMD, no arithmetic in bf16.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpt2attn::kernels {

// bfloat16 as stored (K/V blocks): the upper 16 bits of an IEEE binary32. Storage only; arithmetic widens to f32.
struct bf16 {
  uint16_t bits;
};

// x as f32: exact, the bits shifted into the high half.
inline float widen(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x rounded to the nearest bf16, ties to even (as torch's .to(bfloat16) and vcvtneps2bf16); +-inf stay, a NaN
// stays a NaN (quiet), overflow rounds to inf.
// to_bf16 of a value known not to be NaN: the rounding alone, which loops whose values are finite keep branch-free.
inline bf16 to_bf16_not_nan(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline bf16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN: keep it quiet
  return to_bf16_not_nan(x);
}

// The compute types' elements (f32, bf16) to and from f32, by overload and by type: widen(f32) is the value
// itself; narrow<T>(x) stores an f32 result as T, itself or rounded to the nearest bf16.
inline float widen(float x) { return x; }
template <class T>
T narrow(float x) {
  if constexpr (std::is_same_v<T, bf16>) {
    return to_bf16(x);
  } else {
    return x;
  }
}

}  // namespace gpt2attn::kernels
