// kernels/decode_attention_f32_scalar.cpp: the portable scalar twin of the one-query decode kernel: f32 compute, f32 K/V (no SIMD flags).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_scalar() { return make_decode_kernel<ScalarArch, float>("scalar"); }
}  // namespace gpt2attn::kernels
