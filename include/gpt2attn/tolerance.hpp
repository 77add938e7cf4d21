// gpt2attn/tolerance.hpp: the accuracy the library promises against the double-accumulated naive reference.
// The one tolerance policy: the test suite and `gpt2attn bench --check` both use it.
#pragma once

#include <cmath>
#include <cstdint>

namespace gpt2attn {

enum class Precision { f32, bf16 };

inline double unit_roundoff(Precision p) { return p == Precision::f32 ? 0x1p-24 : 0x1p-9; }

// Allowed |got - expected| is atol + rtol * |expected| for values produced by chained reductions of length
// <= reduction_length. Rounding errors of a length-K sum grow like sqrt(K) for random data (worst case K);
// the factor 16 covers the chained GEMM -> softmax -> GEMM -> GEMM stages and exp's few ulps. The absolute
// floor scales with the output's magnitude: cancellation makes small entries of a large result as uncertain
// as the large ones.
struct Tolerance {
  double rtol, atol;
  bool accepts(double got, double expected) const {
    return std::fabs(got - expected) <= atol + rtol * std::fabs(expected);
  }
};

inline Tolerance tolerance_for(Precision p, int64_t reduction_length, double max_abs_reference) {
  const double k = static_cast<double>(reduction_length < 1 ? 1 : reduction_length);
  const double rtol = 16.0 * unit_roundoff(p) * std::sqrt(k);
  return {rtol, rtol * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

}  // namespace gpt2attn
