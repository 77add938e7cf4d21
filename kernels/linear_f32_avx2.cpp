// kernels/linear_f32_avx2.cpp: the AVX2 instantiation of the few-row linear layer.
#include "kernels/linear_f32_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_avx2() { return make_linear_kernel<xsimd::fma3<xsimd::avx2>>("avx2"); }
}  // namespace gpt2attn::kernels
