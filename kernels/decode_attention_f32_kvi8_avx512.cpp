// kernels/decode_attention_f32_kvi8_avx512.cpp:
// the AVX-512 instantiation of the one-query decode kernel: f32 compute, K/V stored int8 with row scales.
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_kvi8_avx512() { return make_decode_kernel<xsimd::avx512f, int8_t>("avx512"); }
}  // namespace gpt2attn::kernels
