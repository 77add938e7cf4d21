// kernels/vec.hpp: the few vector operations the kernels use, over xsimd::batch<float, Arch>, with a
// plain-float twin (ScalarArch) so the scalar fallback runs the very same algorithm without SIMD flags.
#pragma once

#include <cmath>

#if !defined(GPT2ATTN_SCALAR_ONLY)
#include <xsimd/xsimd.hpp>
#endif

namespace gpt2attn::kernels {

struct ScalarArch {};

template <class Arch>
struct Vec;

#if !defined(GPT2ATTN_SCALAR_ONLY)
template <class Arch>
struct Vec {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  static B load(const float* p) { return B::load_unaligned(p); }
  static void store(float* p, B v) { v.store_unaligned(p); }
  static B set1(float x) { return B(x); }
  static B fma(B a, B b, B c) { return xsimd::fma(a, b, c); }
  static B max(B a, B b) { return xsimd::max(a, b); }
  static B exp(B a) { return xsimd::exp(a); }
  // Where m == -inf (every key masked so far) substitute 0, so exp(s - m) stays 0 instead of NaN.
  static B finite_or_zero(B m) { return xsimd::select(m == B(-INFINITY), B(0.0f), m); }
};
#endif

template <>
struct Vec<ScalarArch> {
  using B = float;
  static constexpr int W = 1;
  static B load(const float* p) { return *p; }
  static void store(float* p, B v) { *p = v; }
  static B set1(float x) { return x; }
  static B fma(B a, B b, B c) { return std::fma(a, b, c); }
  static B max(B a, B b) { return a > b ? a : b; }
  static B exp(B a) { return std::exp(a); }
  static B finite_or_zero(B m) { return m == -INFINITY ? 0.0f : m; }
};

}  // namespace gpt2attn::kernels
