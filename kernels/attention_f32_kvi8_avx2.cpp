// kernels/attention_f32_kvi8_avx2.cpp:
// the AVX2+FMA instantiation of the tiled attention kernel: f32 compute, K/V stored int8 with row scales.
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_kvi8_avx2() { return make_attention_kernel<xsimd::fma3<xsimd::avx2>, tiles::kAvx2, int8_t>("avx2"); }
}  // namespace gpt2attn::kernels
