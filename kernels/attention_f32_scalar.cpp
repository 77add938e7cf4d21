// kernels/attention_f32_scalar.cpp: the portable scalar twin of the tiled attention kernel: f32 compute, f32 K/V (no SIMD flags).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_scalar() { return make_attention_kernel<ScalarArch, tiles::kScalar, float>("scalar"); }
}  // namespace gpt2attn::kernels
