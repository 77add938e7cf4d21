// kernels/vec_probe.hpp: Vec<Arch>'s element-wise functions as each instruction set compiles them, for the tests
// that pin them down (Vec lives inside the per-ISA translation units, with internal linkage). Not used by the
// kernels themselves.
#pragma once

#include <cstdint>

#include "gpt2attn/isa.hpp"

namespace gpt2attn::kernels {

struct VecProbe {
  Isa isa;
  int lanes;  // Vec<Arch>::W
  // y[i] = Vec<Arch>::exp2(x[i]) for i < n (n a multiple of lanes).
  void (*exp2)(const float* x, int64_t n, float* y);
  // The same with 2^n built in the exponent bits (Vec<Arch>::exp2_bits), where exp2 builds it another way (AVX-512:
  // vscalefps); null where exp2 is that construction.
  void (*exp2_bits)(const float* x, int64_t n, float* y);
  // y[i] = Vec<Arch>::load(codes + i)[...] for i < n (n a multiple of lanes): the fp8 (e4m3) widening load.
  void (*widen_fp8)(const uint8_t* codes, int64_t n, float* y);
};

}  // namespace gpt2attn::kernels
