// kernels/vec_probe_avx2.cpp: Vec<xsimd::fma3<xsimd::avx2>>'s element-wise functions for the tests (kernels/vec_probe.hpp).
#include "kernels/vec.hpp"
#include "kernels/vec_probe.hpp"

namespace gpt2attn::kernels {
namespace {
using V = Vec<xsimd::fma3<xsimd::avx2>>;
void exp2_all(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; i += V::W) V::store(y + i, V::exp2(V::load(x + i)));
}
}  // namespace

const VecProbe& vec_probe_avx2() {
  static const VecProbe probe{"avx2", V::W, &exp2_all};
  return probe;
}
}  // namespace gpt2attn::kernels
