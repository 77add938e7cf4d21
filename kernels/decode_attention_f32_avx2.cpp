// kernels/decode_attention_f32_avx2.cpp: the AVX2 instantiation of the one-query decode kernel: f32 compute, f32 K/V.
#include "kernels/decode_attention_impl.hpp"

namespace gpt2attn::kernels {
const DecodeKernel& decode_attention_f32_avx2() { return make_decode_kernel<xsimd::fma3<xsimd::avx2>, float>("avx2"); }
}  // namespace gpt2attn::kernels
