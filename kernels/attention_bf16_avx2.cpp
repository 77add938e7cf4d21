// kernels/attention_bf16_avx2.cpp: the AVX2+FMA instantiations of the tiled attention kernel for bf16 compute: bf16
// queries and K/V widened to f32 on load, f32 arithmetic; K/V stored bf16, f32 or int8.
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
using Arch2 = xsimd::fma3<xsimd::avx2>;
const AttentionKernel& attention_bf16_avx2() { return make_attention_kernel<Arch2, tiles::kAvx2, bf16, bf16>("avx2"); }
const AttentionKernel& attention_bf16_kvf32_avx2() {
  return make_attention_kernel<Arch2, tiles::kAvx2, float, bf16>("avx2");
}
const AttentionKernel& attention_bf16_kvi8_avx2() {
  return make_attention_kernel<Arch2, tiles::kAvx2, int8_t, bf16>("avx2");
}
}  // namespace gpt2attn::kernels
