// kernels/dropout.hpp: the counter-based dropout draw of the public contract (include/gpt2attn/attention.hpp).
// Stateless, so the kept set depends only on (seed, index), never on threads, tiling or ISA.
#pragma once

#include <cstdint>

namespace gpt2attn::kernels {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 bits, exactly representable in float.
inline float dropout_uniform(uint64_t seed, uint64_t index) {
  return static_cast<float>(splitmix64(seed ^ splitmix64(index)) >> 40) * 0x1p-24f;
}

}  // namespace gpt2attn::kernels
