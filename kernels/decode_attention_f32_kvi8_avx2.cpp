// kernels/decode_attention_f32_kvi8_avx2.cpp:
// the AVX2+FMA instantiation of the one-query decode kernel: f32 compute, K/V stored int8 with row scales.
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_kvi8_avx2() { return make_decode_kernel<xsimd::fma3<xsimd::avx2>, int8_t>("avx2"); }
}  // namespace gpt2attn::kernels
