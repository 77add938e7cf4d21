// kernels/decode_attention_f32_avx512.cpp: the AVX512 instantiation of the one-query decode kernel: f32 compute, f32 K/V.
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_avx512() { return make_decode_kernel<xsimd::avx512f, float>("avx512"); }
}  // namespace gpt2attn::kernels
