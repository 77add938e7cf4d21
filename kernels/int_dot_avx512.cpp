// kernels/int_dot_avx512.cpp: the AVX-512BW int8-key dot products (kernels/int_dot.hpp), for the tests.
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_avx512() {
  using D = IntDot<xsimd::avx512f>;
  static const IntDotKernel kernel{"avx512", D::kKeys, &D::dots};
  return kernel;
}
}  // namespace gpt2attn::kernels
