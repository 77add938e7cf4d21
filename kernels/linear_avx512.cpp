// kernels/linear_avx512.cpp: the AVX512 instantiations of the few-row linear layer, f32 and bf16 weights.
#include "kernels/linear_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_avx512() { return make_linear_kernel<xsimd::avx512f, float>("avx512"); }
const LinearKernel& linear_bf16_avx512() { return make_linear_kernel<xsimd::avx512f, bf16>("avx512"); }
}  // namespace gpt2attn::kernels
