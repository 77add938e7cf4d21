// kernels/linear_scalar.cpp: the portable scalar twin of the few-row linear layer (no SIMD flags), f32 and bf16
// weights.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/linear_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_scalar() { return make_linear_kernel<ScalarArch, float>("scalar"); }
const LinearKernel& linear_bf16_scalar() { return make_linear_kernel<ScalarArch, bf16>("scalar"); }
}  // namespace gpt2attn::kernels
