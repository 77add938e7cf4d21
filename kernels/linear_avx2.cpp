// kernels/linear_avx2.cpp: the AVX2 instantiations of the few-row linear layer, f32 and bf16 weights.
#include "kernels/linear_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_avx2() { return make_linear_kernel<xsimd::fma3<xsimd::avx2>, float>("avx2"); }
const LinearKernel& linear_bf16_avx2() { return make_linear_kernel<xsimd::fma3<xsimd::avx2>, bf16>("avx2"); }
}  // namespace gpt2attn::kernels
