// kernels/attention_f32_avx512.cpp: the AVX-512 instantiation of the tiled attention kernel.
#include "kernels/attention_f32_impl.hpp"

namespace gpt2attn::kernels {
const AttentionKernel& attention_f32_avx512() { return make_attention_kernel<xsimd::avx512f, tiles::kAvx512>("avx512"); }
}  // namespace gpt2attn::kernels
