// kernels/kernel_sets_avx2.cpp: the avx2 level's rows of kernels/kernel_list.def, compiled with AVX2 and FMA.
#include "kernels/kernel_sets_impl.hpp"

namespace gpt2attn::kernels {
template <>
const IsaKernels& isa_kernels<Isa::avx2>() {
  return make_isa_kernels<LevelTraits<Isa::avx2, xsimd::fma3<xsimd::avx2>, tiles::kAvx2, false>>();
}
}  // namespace gpt2attn::kernels
