// kernels/vec_probe_scalar.cpp: the scalar twin's element-wise functions, for the tests (kernels/vec_probe.hpp).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/vec_probe_impl.hpp"

namespace gpt2attn::kernels {
const VecProbe& vec_probe_scalar() { return make_vec_probe<ScalarArch>("scalar"); }
}  // namespace gpt2attn::kernels
