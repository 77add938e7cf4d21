// kernels/linear_f32_avx512.cpp: the AVX512 instantiation of the few-row linear layer.
#include "kernels/linear_f32_impl.hpp"

namespace gpt2attn::kernels {
const LinearKernel& linear_f32_avx512() { return make_linear_kernel<xsimd::avx512f>("avx512"); }
}  // namespace gpt2attn::kernels
