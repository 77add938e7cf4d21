// kernels/decode_attention_f32_kvi8_avx512_bf16.cpp: the instantiation of the one-query decode kernel over an int8
// cache at the avx512_bf16 level, whose CPUs all have AVX512-VNNI: the integer scores on vpdpwssd (kernels/int_dot.hpp),
// the rest as the avx512 row's.
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_kvi8_avx512_bf16() {
  return make_decode_kernel<xsimd::avx512f, int8_t>("avx512_bf16");
}
}  // namespace gpt2attn::kernels
