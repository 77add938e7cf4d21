// kernels/kernel_sets_scalar.cpp: the scalar level's rows of kernels/kernel_list.def, compiled without SIMD flags: the
// portable twins of every algorithm, on one lane (ScalarArch), for any CPU.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/kernel_sets_impl.hpp"

namespace gpt2attn::kernels {
template <>
const IsaKernels& isa_kernels<Isa::scalar>() {
  return make_isa_kernels<LevelTraits<Isa::scalar, ScalarArch, tiles::kScalar, true>>();
}
}  // namespace gpt2attn::kernels
