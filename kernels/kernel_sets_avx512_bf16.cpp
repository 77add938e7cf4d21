// kernels/kernel_sets_avx512_bf16.cpp: the avx512_bf16 level's rows of kernels/kernel_list.def, compiled with AVX-512,
// AVX512-BF16 (bf16 products on vdpbf16ps) and AVX512-VNNI (int8 K/V scores on vpdpwssd).
#include "kernels/kernel_sets_impl.hpp"

namespace gpt2attn::kernels {
template <>
const IsaKernels& isa_kernels<Isa::avx512_bf16>() {
  return make_isa_kernels<LevelTraits<Isa::avx512_bf16, xsimd::avx512f, tiles::kAvx512, true>>();
}
}  // namespace gpt2attn::kernels
