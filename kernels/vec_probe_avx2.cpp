// kernels/vec_probe_avx2.cpp: Vec<fma3<avx2>>'s element-wise functions, for the tests (kernels/vec_probe.hpp).
#include "kernels/vec_probe_impl.hpp"

namespace gpt2attn::kernels {
const VecProbe& vec_probe_avx2() { return make_vec_probe<xsimd::fma3<xsimd::avx2>>("avx2"); }
}  // namespace gpt2attn::kernels
