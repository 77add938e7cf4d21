// gpt2attn/tolerance.hpp: the accuracy the library promises against the double-accumulated naive reference.
// The one tolerance policy: the test suite and `gpt2attn bench --check` both use it.
#pragma once

#include <cmath>
#include <cstdint>

#include "gpt2attn/dtype.hpp"

namespace gpt2attn {

// The unit roundoff u = 2^-p of a float type with p significant bits, round to nearest: f32 p = 24, bf16 p = 8,
// f16 p = 11, fp8 (e4m3) p = 4. Integer types have none (0).
constexpr double unit_roundoff(DType t) {
  return t == DType::f32    ? 0x1p-24
         : t == DType::bf16 ? 0x1p-8
         : t == DType::f16  ? 0x1p-11
         : t == DType::fp8  ? 0x1p-4
                            : 0.0;
}

// accumulated_tolerance: allowed |got - expected| is atol + rtol * |expected| for values produced by chained
// reductions of length <= reduction_length, accumulated in type p. Rounding errors of a length-K sum grow like
// sqrt(K) for random data (worst case K); the factor 16 covers the chained GEMM -> softmax -> GEMM -> GEMM
// stages and exp's few ulps. The absolute floor scales with the output's magnitude: cancellation makes small
// entries of a large result as uncertain as the large ones.
struct Tolerance {
  double rtol, atol;
  bool accepts(double got, double expected) const {
    return std::fabs(got - expected) <= atol + rtol * std::fabs(expected);
  }
};

inline Tolerance accumulated_tolerance(DType p, int64_t reduction_length, double max_abs_reference) {
  const double k = static_cast<double>(reduction_length < 1 ? 1 : reduction_length);
  const double rtol = 16.0 * unit_roundoff(p) * std::sqrt(k);
  return {rtol, rtol * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// The row operations (gpt2attn/ops.hpp) against double loops. LayerNorm sums its row's mean and variance in f32 over
// E values and divides by sqrt(var + eps): the f32 accumulation bound over E, of the output's scale. GELU takes one
// exp2 (1.6e-7 relative at worst, kernels/vec.hpp), a cubic and a division: the bound of a reduction of 4, whose
// 32 unit roundoffs (1.9e-6) hold them with room.
inline Tolerance row_op_tolerance(int64_t reduction_length, double max_abs_reference) {
  return accumulated_tolerance(DType::f32, reduction_length, max_abs_reference);
}

// bf16 compute (EngineOptions::compute) rounds to bf16 at a fixed number of points and sums in f32, so its error
// does not grow with the reduction length beyond the f32 part. Against the reference run on what the layer holds
// (weights and query/key/value rounded to bf16 once), the roundings left are the layer's own five: Q, K, V, the
// softmax weights P (before P.V) and the attention output (before the output projection). Each is a relative
// error of at most u/2 (u = 2^-8, round to nearest); five of them, added in the worst case, with a factor 2 for the
// softmax, which turns a score error into an output error about as large relative to the output: 5u. Against the
// plain f32 inputs and weights, the rounding of the input, of W_q/W_k/W_v and of W_o adds three more: 8u.
// Measured over 120 random bf16 shapes per ISA (shapes of the kind FastPathSweep.RandomCasesMatchReference draws):
// at most 0.93u and 1.36u respectively.
inline constexpr int kBf16ComputeRoundings = 5;
inline constexpr int kBf16InputRoundings = 3;

// The bound for a layer computing in `compute`, against the double reference over the inputs it computes with
// (bf16: rounded): the f32 accumulation bound, plus for bf16 kBf16ComputeRoundings * u.
inline Tolerance tolerance_for(DType compute, int64_t reduction_length, double max_abs_reference) {
  const Tolerance f = accumulated_tolerance(DType::f32, reduction_length, max_abs_reference);
  if (compute != DType::bf16) return accumulated_tolerance(compute, reduction_length, max_abs_reference);
  const double r = kBf16ComputeRoundings * unit_roundoff(DType::bf16);
  return {f.rtol + r, f.atol + r * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// A bf16 layer against the reference over the unrounded f32 inputs and weights: kBf16InputRoundings more.
inline Tolerance bf16_unrounded_tolerance(int64_t reduction_length, double max_abs_reference) {
  const Tolerance f = accumulated_tolerance(DType::f32, reduction_length, max_abs_reference);
  const double r = (kBf16ComputeRoundings + kBf16InputRoundings) * unit_roundoff(DType::bf16);
  return {f.rtol + r, f.atol + r * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// The relative error one stored K/V value carries in a cache of dtype `kv` with head size D:
//   f32: none.  bf16: one rounding to nearest, u = 2^-8 of the value itself.
//   fp8 (e4m3 after a power-of-two scale per row): one rounding to nearest, u = 2^-4 of the value itself for values
//     over 2^-14 of the row's largest; below, subnormal steps (an absolute error of at most 2^-17.8 of the row's
//     largest, under the bounds' absolute floor). Eight times int8's typical figure at D = 64 below: three
//     mantissa bits against a row scale's seven.
//   i8 (symmetric, one scale per (token, head) row of D values): half a step, max|row| / 254, relative to the row's
//     largest value rather than to each value. Against a typical value of the row (its rms) that is
//     (max|row| / rms) / 254; for rows of D roughly Gaussian values the ratio max/rms is about sqrt(2 ln 2D) (3.1 at
//     D = 64, 3.3 at D = 128), which is the figure used. Rows with a few outlying channels quantise worse: a
//     coarser scale (per block or per head) would multiply the ratio again by the tokens sharing it, which is why
//     the scale is per row. The context length does not enter: an output row is a convex combination of value
//     rows, so value errors average rather than add, and a key's error moves only its own probability.
inline double kv_storage_roundoff(DType kv, int64_t head_dim) {
  if (kv == DType::bf16 || kv == DType::fp8) return unit_roundoff(kv);
  if (kv == DType::i8) {
    const double d = static_cast<double>(head_dim < 1 ? 1 : head_dim);
    return std::sqrt(2.0 * std::log(2.0 * d)) / 254.0;
  }
  return 0.0;
}

// The relative error the decode kernel adds to the query to read keys a cache stores as `kv` (head size D):
//   f32, bf16, fp8: none (f32 FMAs on the widened keys).
//   i8: the scores are integer dot products (kernels/int_dot.hpp) against the pre-scaled query rounded once per call
//     to int16, symmetric, one scale per (call, head): half a step, max|q| / 65534 (about 2^-16 of the row's largest
//     value), the same shape of error as an int8 key's max|row| / 254 on the other side of the dot product, so it
//     takes the same max/rms ratio: kv_storage_roundoff(i8, D) * 254 / 65534, 1/258 of the keys' own rounding
//     (D = 64: 4.8e-5 relative, against the keys' 1.2e-2). Negligible beside the storage term; it matters only to
//     the tests that compare with the K/V the cache really holds (kv_kernel_tolerance). (Prefill's tiled kernel
//     reads the query in f32 and adds nothing.)
inline double kv_query_roundoff(DType kv, int64_t head_dim) {
  return kv == DType::i8 ? kv_storage_roundoff(kv, head_dim) * 254.0 / 65534.0 : 0.0;
}

// A decode over a cache of `kv` against naive attention over the K/V the cache really holds (read back exactly):
// the f32 policy plus the query's rounding under the chain factor 16, once (tests/test_kernels.cpp,
// tests/test_kv_cache_storage.cpp). f32 and bf16 caches: exactly the f32 policy. Not for prefill (nothing added).
inline Tolerance kv_kernel_tolerance(DType kv, int64_t head_dim, int64_t reduction_length, double max_abs_reference) {
  const Tolerance f = accumulated_tolerance(DType::f32, reduction_length, max_abs_reference);
  const double s = 16.0 * kv_query_roundoff(kv, head_dim);
  return {f.rtol + s, f.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// Outputs computed in f32 from K/V a cache stores as `kv` (head size head_dim): each stored value was rounded once
// (relative error kv_storage_roundoff) when it was appended, and that single rounding is carried through the
// softmax and the output projection; int8's decode adds the query's rounding (kv_query_roundoff). The bound is the
// f32 policy plus those single roundings under the same chain factor 16, without sqrt growth (a stored value is
// rounded once, not accumulated). Tests that must see the kernels' own error instead compare with naive attention
// over the K/V the cache really holds, at kv_kernel_tolerance.
inline Tolerance kv_storage_tolerance(DType kv, int64_t head_dim, int64_t reduction_length,
                                      double max_abs_reference) {
  const Tolerance f = accumulated_tolerance(DType::f32, reduction_length, max_abs_reference);
  const double s = 16.0 * (kv_storage_roundoff(kv, head_dim) + kv_query_roundoff(kv, head_dim));
  return {f.rtol + s, f.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// A whole layer computing in `compute` over a cache of `kv`, against the reference over the plain f32 inputs and
// weights (what `gpt2attn bench --check` compares with). bf16 compute already counts the rounding of K and V
// among its own, so a bf16 cache adds nothing to it; an int8 or fp8 cache adds its storage term as above.
inline Tolerance layer_tolerance(DType compute, DType kv, int64_t head_dim, int64_t reduction_length,
                                 double max_abs_reference) {
  if (compute != DType::bf16) return kv_storage_tolerance(kv, head_dim, reduction_length, max_abs_reference);
  const Tolerance b = bf16_unrounded_tolerance(reduction_length, max_abs_reference);
  const double s =
      kv == DType::bf16 ? 0.0 : 16.0 * (kv_storage_roundoff(kv, head_dim) + kv_query_roundoff(kv, head_dim));
  return {b.rtol + s, b.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// The relative error a quantized weight (EngineOptions::weights, gpt2attn/dtype.hpp) carries against the typical
// weight of the values sharing its scale: half a step, max|group| / (2 q) with q = 127 (int8) or 8 (int4), over the
// group's rms, taken as sqrt(2 ln 2n) for n roughly Gaussian values (as kv_storage_roundoff's int8 rows). int8: the
// row of d_in values (d_in = 768: 1.5e-2); int4: kWeightGroup = 32 values (0.18; int4 clips values of the other sign
// beyond 7.5 steps by up to one more half step, a few of each group at most). compute: none.
inline double weights_roundoff(WeightFormat f, int64_t row_length) {
  if (f == WeightFormat::compute) return 0.0;
  const double n = static_cast<double>(f == WeightFormat::int4 ? kWeightGroup : (row_length < 1 ? 1 : row_length));
  return std::sqrt(2.0 * std::log(2.0 * n)) / (2.0 * (f == WeightFormat::int4 ? 8.0 : 127.0));
}

// A layer holding weights in format f against the reference over the f32 weights: layer_tolerance plus the weights'
// rounding. Unlike the cache's values, every output sums d_in products of rounded weights, so the rounding errors,
// independent and of mean zero, grow like sqrt(d_in) while the output itself does too: relative to the output's
// scale they stay at about weights_roundoff / sqrt(3) (a uniform error's rms) per projection. Four projections chain
// (Q and K through the scores, V, the output projection), and the bound allows kWeightChain times the roundoff against
// the output's largest value: at the four GPT-2 widths with GPT-2's initialization (tests/test_quantized_weights.cpp,
// ErrorAgainstF32WeightsBesideLlamaCppFormats) the largest error took at most 0.41 of that term (int8 0.32-0.41, int4
// 0.29-0.37).
inline constexpr double kWeightChain = 2.0;

// int8 weights on integer GEMMs (prefill, extend and long steps, where oneDNN has VNNI) round the GEMMs' inputs too:
// the layer's input and the attention output, each row to 8 bits on its own scale (half a step, max|row| / 254), an
// error of the same shape as an int8 weight row's, so it takes the same figure and chain factor. Decode's and short
// steps' projections of both quantized formats round them to 16 bits (max|row| / 65534): 258 times less, int4's only
// activation term. None for the compute types.
inline double activations_roundoff(WeightFormat f, int64_t width) {
  if (f == WeightFormat::int8) return weights_roundoff(WeightFormat::int8, width);
  if (f == WeightFormat::int4) return weights_roundoff(WeightFormat::int8, width) * 127.0 / 32767.0;
  return 0.0;
}

// A layer holding weights in format f against the reference over the weights it computes with (dequantized()):
// layer_tolerance, plus the activations' rounding of its integer arithmetic.
inline Tolerance dequantized_tolerance(WeightFormat f, DType compute, DType kv, int64_t head_dim,
                                       int64_t reduction_length, double max_abs_reference) {
  const Tolerance l = layer_tolerance(compute, kv, head_dim, reduction_length, max_abs_reference);
  const double s = kWeightChain * activations_roundoff(f, reduction_length);
  return {l.rtol, l.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// Against the f32 weights: the weights' rounding as well.
inline Tolerance weights_tolerance(WeightFormat f, DType compute, DType kv, int64_t head_dim, int64_t reduction_length,
                                   double max_abs_reference) {
  const Tolerance l = dequantized_tolerance(f, compute, kv, head_dim, reduction_length, max_abs_reference);
  const double s = kWeightChain * weights_roundoff(f, reduction_length);
  return {l.rtol, l.atol + s * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// A Linear (gpt2attn/linear.hpp) of K inputs holding weights in format f, computing in `compute`, against the
// double reference over the weights it computes with (dequantized(); for bf16 the f32 values, unrounded): one
// reduction of K in f32; bf16 compute rounds x and W (u/2 each, relative to the products, whose errors of random sign
// add up to about the output's scale), so 2u; the quantized formats round x's rows as dequantized_tolerance says
// (int8 GEMMs to 8 bits, the few-row kernel to 16), under the same chain factor.
inline Tolerance linear_tolerance(WeightFormat f, DType compute, int64_t K, double max_abs_reference) {
  const Tolerance a = accumulated_tolerance(DType::f32, K, max_abs_reference);
  const double r = (compute == DType::bf16 ? 2.0 * unit_roundoff(DType::bf16) : 0.0) +
                   kWeightChain * activations_roundoff(f, K);
  return {a.rtol + r, a.atol + r * (max_abs_reference > 1.0 ? max_abs_reference : 1.0)};
}

// A whole GPT-2 (gpt2attn/gpt2.hpp) against a float64 GPT-2 on the same weights, as an allowed error of each logit
// relative to the largest |logit| (atol; rtol as the f32 policy). Its 2 n_layer + 1 sublayers (attention and MLP per
// block, the LM head) each add their roundings to the residual stream: f32 takes the f32 policy over the longest
// reduction (the MLP's inner width) for each sublayer, added over the chain (the worst case); bf16 compute
// (kBf16ComputeRoundings + kBf16InputRoundings) u a sublayer, independent roundings of either sign, so growing like
// the square root of the chain. Measured on random GPT-2-initialized checkpoints of gpt2-small width with 12 layers
// (tests/python/test_gpt2_parity.py): f32 1.8e-6 of the largest logit, bf16 6.7e-3; the bounds are 1.3e-3 and 0.16.
inline Tolerance model_tolerance(DType compute, int64_t n_layer, int64_t inner, double max_abs_logit) {
  const Tolerance f = accumulated_tolerance(DType::f32, inner, max_abs_logit);
  const double chain = static_cast<double>(2 * (n_layer < 0 ? 0 : n_layer) + 1);
  const double scale = max_abs_logit > 1.0 ? max_abs_logit : 1.0;
  if (compute != DType::bf16) return {f.rtol, f.atol * chain};
  const double r = (kBf16ComputeRoundings + kBf16InputRoundings) * unit_roundoff(DType::bf16) * std::sqrt(chain);
  return {f.rtol, f.atol * chain + r * scale};
}

}  // namespace gpt2attn
