// kernels/attention_bf16_avx512_bf16.cpp: the AVX512-BF16 instantiation of the tiled attention kernel: bf16 compute
// and K/V, Q.K^T and P.V on vdpbf16ps (MicroBf16Dot). bf16 compute over f32 K/V has no row at this level (the table
// falls through to avx512's), and its row over int8 K/V (for decode's integer scores) prefills with avx512's kernel.
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_bf16_avx512_bf16() {
  return make_attention_kernel_bf16dot<xsimd::avx512f, tiles::kAvx512>("avx512_bf16");
}
}  // namespace gpt2attn::kernels
