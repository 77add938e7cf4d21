// kernels/int_dot_avx2.cpp: the AVX2 int8-key dot products (kernels/int_dot.hpp), for the tests.
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_avx2() {
  using D = IntDot<xsimd::fma3<xsimd::avx2>>;
  static const IntDotKernel kernel{"avx2", D::kKeys, &D::dots};
  return kernel;
}
}  // namespace gpt2attn::kernels
