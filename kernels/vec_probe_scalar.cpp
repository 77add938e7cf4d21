// kernels/vec_probe_scalar.cpp: Vec<ScalarArch>'s element-wise functions for the tests (kernels/vec_probe.hpp).
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/vec.hpp"
#include "kernels/vec_probe.hpp"

namespace gpt2attn::kernels {
namespace {
using V = Vec<ScalarArch>;
void exp2_all(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; i += V::W) V::store(y + i, V::exp2(V::load(x + i)));
}
}  // namespace

const VecProbe& vec_probe_scalar() {
  static const VecProbe probe{"scalar", V::W, &exp2_all};
  return probe;
}
}  // namespace gpt2attn::kernels
