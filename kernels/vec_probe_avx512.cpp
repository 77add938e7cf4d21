// kernels/vec_probe_avx512.cpp: Vec<avx512f>'s element-wise functions, for the tests (kernels/vec_probe.hpp).
#include "kernels/vec_probe_impl.hpp"

namespace gpt2attn::kernels {
const VecProbe& vec_probe_avx512() { return make_vec_probe<xsimd::avx512f>("avx512"); }
}  // namespace gpt2attn::kernels
