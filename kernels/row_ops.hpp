// kernels/row_ops.hpp: the row operations a GPT-2 block needs beside attention and its projections: LayerNorm over
// each row, GELU in its tanh approximation (GPT-2's "gelu_new"), and the residual add. Pure compute on pointers, one set per
// instruction-set level (kernels/row_ops_impl.hpp over Vec<Arch>, the scalar twin included); the engine splits rows
// or elements across threads (engine/row_ops.cpp, gpt2attn/ops.hpp).
#pragma once

#include <cstdint>

#include "gpt2attn/isa.hpp"

namespace gpt2attn::kernels {

// sqrt(2 / pi) and the cubic's coefficient of GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline constexpr double kGeluSqrt2OverPi = 0.7978845608028654;
inline constexpr double kGeluCubic = 0.044715;

struct RowOpsKernel {
  Isa isa;
  // y (M, E) with row stride ldy = LayerNorm of x (M, E) with row stride ldx: (x - mean) / sqrt(var + eps) * gamma +
  // beta, the mean and the (biased) variance of each row summed in f32 in two passes, the mean kept as two floats (so
  // a row far from 0 keeps its digits). y may be x (ldy == ldx).
  void (*layer_norm)(const float* x, int64_t ldx, int64_t M, int64_t E, const float* gamma, const float* beta,
                     float eps, float* y, int64_t ldy);
  // x[i] = GELU(x[i]) for i < n, in place, as x / (1 + 2^(-2 log2(e) u)), u = sqrt(2/pi) (x + 0.044715 x^3): the
  // same function (0.5 (1 + tanh u) = 1 / (1 + e^(-2u))) without tanh's cancellation near 0; x below -20 (where
  // GELU is below 1e-170) is taken as -20, and the exponent held below 126. NaN stays NaN, +inf stays +inf.
  void (*gelu)(float* x, int64_t n);
  // y[i] += x[i] for i < n: a residual connection. One rounding an element, as the plain loop's.
  void (*add)(float* y, const float* x, int64_t n);
};

}  // namespace gpt2attn::kernels
