// kernels/decode_attention_f32_kvi8_scalar.cpp:
// the portable scalar instantiation of the one-query decode kernel: f32 compute, K/V stored int8 with row scales.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_kvi8_scalar() { return make_decode_kernel<ScalarArch, int8_t>("scalar"); }
}  // namespace gpt2attn::kernels
