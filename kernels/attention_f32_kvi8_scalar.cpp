// kernels/attention_f32_kvi8_scalar.cpp:
// the portable scalar instantiation of the tiled attention kernel: f32 compute, K/V stored int8 with row scales.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_kvi8_scalar() { return make_attention_kernel<ScalarArch, tiles::kScalar, int8_t>("scalar"); }
}  // namespace gpt2attn::kernels
