// gpt2attn/ops.hpp: the row operations a GPT-2 block needs beside attention and its projections (LayerNorm, GELU, the
// residual add), on the library's kernels (kernels/row_ops.hpp: one vectorized set per instruction set, the scalar
// twin included) and its thread team.
// f32, contiguous rows. Accuracy against double loops: row_op_tolerance() in gpt2attn/tolerance.hpp.
#pragma once

#include <cstdint>

#include "gpt2attn/export.h"
#include "gpt2attn/isa.hpp"

namespace gpt2attn {

// Where the row operations run: threads (0 = the default, as EngineOptions::threads) and the instruction-set cap (as
// EngineOptions::isa; GPT2ATTN_ISA in the environment overrides best).
struct RowOpOptions {
  int threads = 0;
  Isa isa = Isa::best;
};

// y (M, E) = LayerNorm of each row of x (M, E): (x - mean) / sqrt(var + eps) * gamma + beta, with the row's mean and
// biased variance (torch.nn.LayerNorm's); gamma and beta (E). y may be x. Throws invalid_argument for M or E below
// 1, a null pointer, or eps that is not finite and above 0; checks no values (a NaN row gives a NaN row).
GPT2ATTN_API void layer_norm(const float* x, int64_t M, int64_t E, const float* gamma, const float* beta, float eps,
                             float* y, const RowOpOptions& options = {});

// x[i] = GELU(x[i]) for i < n, in place, in GPT-2's tanh approximation (torch's gelu(approximate="tanh"),
// transformers' "gelu_new"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). Throws invalid_argument for n below
// 0 or a null x with n above 0.
GPT2ATTN_API void gelu_tanh(float* x, int64_t n, const RowOpOptions& options = {});

// y[i] += x[i] for i < n: a residual connection, exact as the plain loop (one rounding an element). x may be y. Throws
// invalid_argument for n below 0 or a null pointer with n above 0.
GPT2ATTN_API void residual_add(float* y, const float* x, int64_t n, const RowOpOptions& options = {});

}  // namespace gpt2attn
