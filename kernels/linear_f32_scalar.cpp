// kernels/linear_f32_scalar.cpp: the portable scalar twin of the few-row linear layer (no SIMD flags).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/linear_f32_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_scalar() { return make_linear_kernel<ScalarArch>("scalar"); }
}  // namespace gpt2attn::kernels
