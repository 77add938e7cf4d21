// kernels/vec_probe.hpp: Vec<Arch>'s element-wise functions as each instruction set compiles them, for the tests
// that pin them down (Vec lives inside the per-ISA translation units, with internal linkage). Not used by the
// kernels themselves.
#pragma once

#include <cstdint>

namespace gpt2attn::kernels {

struct VecProbe {
  const char* isa;
  int lanes;  // Vec<Arch>::W
  // y[i] = Vec<Arch>::exp2(x[i]) for i < n (n a multiple of lanes).
  void (*exp2)(const float* x, int64_t n, float* y);
  // The same with 2^n built in the exponent bits (Vec<Arch>::exp2_bits), where exp2 builds it another way (AVX-512:
  // vscalefps); null where exp2 is that construction.
  void (*exp2_bits)(const float* x, int64_t n, float* y);
};

const VecProbe& vec_probe_scalar();
const VecProbe& vec_probe_avx2();
const VecProbe& vec_probe_avx512();

}  // namespace gpt2attn::kernels
