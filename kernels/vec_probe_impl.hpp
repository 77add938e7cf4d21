// kernels/vec_probe_impl.hpp: the VecProbe of one instruction set (kernels/vec_probe.hpp), written once over
// Vec<Arch>. Included only by kernels/kernel_sets_impl.hpp, in each level's file (internal linkage, like the kernels'
// _impl headers).
#pragma once

#include "kernels/vec.hpp"
#include "kernels/vec_probe.hpp"

namespace gpt2attn::kernels {
namespace {

template <class Arch>
void exp2_all(const float* x, int64_t n, float* y) {
  using V = Vec<Arch>;
  for (int64_t i = 0; i < n; i += V::W) V::store(y + i, V::exp2(V::load(x + i)));
}

template <class Arch>
void exp2_bits_all(const float* x, int64_t n, float* y) {
  using V = Vec<Arch>;
  for (int64_t i = 0; i < n; i += V::W) V::store(y + i, V::exp2_bits(V::load(x + i)));
}

template <class Arch>
void widen_fp8_all(const uint8_t* codes, int64_t n, float* y) {
  using V = Vec<Arch>;
  for (int64_t i = 0; i < n; i += V::W) V::store(y + i, V::load(reinterpret_cast<const fp8_e4m3*>(codes + i)));
}

template <Isa Level, class Arch>
const VecProbe& make_vec_probe() {
  void (*bits)(const float*, int64_t, float*) = nullptr;
  if constexpr (Vec<Arch>::kExp2Scalef) bits = &exp2_bits_all<Arch>;
  static const VecProbe probe{Level, Vec<Arch>::W, &exp2_all<Arch>, bits, &widen_fp8_all<Arch>};
  return probe;
}

}  // namespace
}  // namespace gpt2attn::kernels
