// kernels/attention_bf16_scalar.cpp: the portable instantiations of the tiled attention kernel for bf16 compute (no
// SIMD flags). bf16 K/V runs MicroBf16Dot on the dot product's one-lane twin (kernels/bf16_dot.hpp): the very pair
// packing and P rounding of the avx512_bf16 row, checkable on any CPU; f32 and int8 K/V widen to f32.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_bf16_scalar() {
  return make_attention_kernel_bf16dot<ScalarArch, tiles::kScalar>("scalar");
}
const AttentionKernel& attention_bf16_kvf32_scalar() {
  return make_attention_kernel<ScalarArch, tiles::kScalar, float, bf16>("scalar");
}
const AttentionKernel& attention_bf16_kvi8_scalar() {
  return make_attention_kernel<ScalarArch, tiles::kScalar, int8_t, bf16>("scalar");
}
}  // namespace gpt2attn::kernels
