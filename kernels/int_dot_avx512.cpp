// kernels/int_dot_avx512.cpp: the AVX-512BW int8-key dot products (kernels/int_dot.hpp), for the tests.
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_avx512() { return make_int_dot_kernel<xsimd::avx512f>("avx512"); }
}  // namespace gpt2attn::kernels
