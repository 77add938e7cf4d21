// kernels/int_dot_avx2.cpp: the AVX2 int8-key dot products (kernels/int_dot.hpp), for the tests.
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_avx2() { return make_int_dot_kernel<xsimd::fma3<xsimd::avx2>>("avx2"); }
}  // namespace gpt2attn::kernels
