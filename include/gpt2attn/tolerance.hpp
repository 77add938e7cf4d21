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

// The relative error one stored K/V value carries in a cache of dtype `kv` with head size D:
//   f32: none.  bf16: one rounding to nearest, u = 2^-8 of the value itself.
//   i8 (symmetric, one scale per (token, head) row of D values): half a step, max|row| / 254, relative to the row's
//     largest value rather than to each value. Against a typical value of the row (its rms) that is
//     (max|row| / rms) / 254; for rows of D roughly Gaussian values the ratio max/rms is about sqrt(2 ln 2D) (3.1 at
//     D = 64, 3.3 at D = 128), which is the figure used. Rows with a few outlying channels quantise worse: a
//     coarser scale (per block or per head) would multiply the ratio again by the tokens sharing it, which is why
//     the scale is per row. The context length does not enter: an output row is a convex combination of value
//     rows, so value errors average rather than add, and a key's error moves only its own probability.
inline double kv_storage_roundoff(DType kv, int64_t head_dim) {
  if (kv == DType::bf16) return unit_roundoff(DType::bf16);
  if (kv == DType::i8) {
    const double d = static_cast<double>(head_dim < 1 ? 1 : head_dim);
    return std::sqrt(2.0 * std::log(2.0 * d)) / 254.0;
  }
  return 0.0;
}

// Outputs computed in f32 from K/V a cache stores as `kv` (head size head_dim): each stored value was rounded once
// (relative error kv_storage_roundoff) when it was appended, and that single rounding is carried through the
// softmax and the output projection. The bound is the f32 policy plus one storage rounding under the same chain
// factor 16, without sqrt growth (a stored value is rounded once, not accumulated). Tests that must see the
// kernels' own error instead compare with naive attention over the K/V the cache really holds, at the f32 policy
// (tests/test_kv_cache_storage.cpp).
inline Tolerance kv_storage_tolerance(DType kv, int64_t head_dim, int64_t reduction_length,
                                      double max_abs_reference) {
  const Tolerance f = tolerance_for(DType::f32, reduction_length, max_abs_reference);
  const double s = 16.0 * kv_storage_roundoff(kv, head_dim);
  return {f.rtol + s, f.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

}  // namespace gpt2attn
