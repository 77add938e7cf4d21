// kernels/int_dot_avx512_bf16.cpp: the int8-key dot products on vpdpwssd (kernels/int_dot.hpp), as the avx512_bf16
// level compiles them (AVX512-VNNI), for the tests.
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_avx512_bf16() { return make_int_dot_kernel<xsimd::avx512f>("avx512_bf16"); }
}  // namespace gpt2attn::kernels
