// kernels/attention_f32_scalar.cpp: the portable scalar twin of the tiled attention kernel (no SIMD flags).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/attention_f32_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_scalar() { return make_attention_kernel<ScalarArch, tiles::kScalar>("scalar"); }
}  // namespace gpt2attn::kernels
