// gpt2attn/tolerance.hpp: the accuracy the library promises against the double-accumulated naive reference.
// The one tolerance policy: the test suite and `gpt2attn bench --check` both use it.
#pragma once

#include <cmath>
#include <cstdint>

#include "gpt2attn/dtype.hpp"

namespace gpt2attn {

// The unit roundoff u = 2^-p of a compute type with p significant bits, round to nearest: f32 p = 24, bf16 p = 8,
// f16 p = 11. Integer types are not compute types (0).
constexpr double unit_roundoff(DType t) {
  return t == DType::f32 ? 0x1p-24 : t == DType::bf16 ? 0x1p-8 : t == DType::f16 ? 0x1p-11 : 0.0;
}

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

inline Tolerance tolerance_for(DType p, int64_t reduction_length, double max_abs_reference) {
  const double k = static_cast<double>(reduction_length < 1 ? 1 : reduction_length);
  const double rtol = 16.0 * unit_roundoff(p) * std::sqrt(k);
  return {rtol, rtol * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// Outputs computed in f32 from K/V a cache stores as `kv`: each stored value was rounded once (relative error <=
// u(kv)) when it was appended, and that single rounding is carried through the softmax and the output projection.
// The bound is the f32 policy plus one storage rounding under the same chain factor 16, without sqrt growth (a
// stored value is rounded once, not accumulated). Tests that must see the kernels' own error instead compare with
// naive attention over the K/V the cache really holds, at the f32 policy (tests/test_kv_cache_bf16.cpp).
inline Tolerance kv_storage_tolerance(DType kv, int64_t reduction_length, double max_abs_reference) {
  const Tolerance f = tolerance_for(DType::f32, reduction_length, max_abs_reference);
  if (kv == DType::f32) return f;
  const Tolerance s = tolerance_for(kv, 1, max_abs_reference);
  return {f.rtol + s.rtol, f.atol + s.atol};
}

}  // namespace gpt2attn
