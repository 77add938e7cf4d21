// kernels/kernel_sets_avx512.cpp: the avx512 level's rows of kernels/kernel_list.def, compiled with AVX-512
// (F, VL, BW, DQ) and FMA.
#include "kernels/kernel_sets_impl.hpp"

namespace gpt2attn::kernels {
template <>
const IsaKernels& isa_kernels<Isa::avx512>() {
  return make_isa_kernels<LevelTraits<Isa::avx512, xsimd::avx512f, tiles::kAvx512, false>>();
}
}  // namespace gpt2attn::kernels
