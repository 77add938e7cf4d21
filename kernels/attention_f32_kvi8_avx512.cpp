// kernels/attention_f32_kvi8_avx512.cpp:
// the AVX-512 instantiation of the tiled attention kernel: f32 compute, K/V stored int8 with row scales.
#include "kernels/attention_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_kvi8_avx512() { return make_attention_kernel<xsimd::avx512f, tiles::kAvx512, int8_t>("avx512"); }
}  // namespace gpt2attn::kernels
