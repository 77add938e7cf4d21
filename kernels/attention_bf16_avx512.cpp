// kernels/attention_bf16_avx512.cpp: the AVX-512 instantiations of the tiled attention kernel for bf16 compute on a
// CPU without AVX512-BF16: bf16 queries and K/V widened to f32 on load, f32 arithmetic; K/V stored bf16, f32 or int8.
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
using Arch512 = xsimd::avx512f;
const AttentionKernel& attention_bf16_avx512() {
  return make_attention_kernel<Arch512, tiles::kAvx512, bf16, bf16>("avx512");
}
const AttentionKernel& attention_bf16_kvf32_avx512() {
  return make_attention_kernel<Arch512, tiles::kAvx512, float, bf16>("avx512");
}
const AttentionKernel& attention_bf16_kvi8_avx512() {
  return make_attention_kernel<Arch512, tiles::kAvx512, int8_t, bf16>("avx512");
}
}  // namespace gpt2attn::kernels
