// engine/convert.hpp: strided views read into the contiguous rows the layer computes on. One converter serves the
// weights (once, at construction: into oneDNN's reorder and decode's packed panels), the activations oneDNN cannot
// read in place (per call: as_rows), and the operands of a bf16 layer on f32 GEMMs (per call, once per matrix).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/tensor.hpp"

namespace gpt2attn::detail {

// The view v (rank 1 to 3; f32, bf16 or f16; any strides, data of any alignment: a file's tensor may be unaligned)
// as contiguous elements of `to` (f32 or bf16) at dst, in row-major order of its shape. Exact where `to` holds every
// value of v's type (f32 <- bf16/f16; a type into itself, bit for bit); rounded to nearest even once where it does not
// (bf16 <- f32/f16: f16 widens exactly, so the one rounding is the f16 value's). A NaN stays a NaN. Rows whose
// elements are not adjacent (a transposed view: a Conv1D weight) are read in 64 x 64 tiles, so each cache line is
// read once, not once per row. A view of more than 65536 elements is split across a team of `threads`.
void convert(const TensorView& v, DType to, void* dst, int threads = 1);

// The view v as contiguous f32 elements holding bf16 values: each rounded to the nearest bf16 as convert(v, bf16)
// rounds it, then widened exactly (a bf16 view is widened only). The operands of a bf16 layer whose GEMMs multiply in
// f32 (Linear::operand).
void convert_bf16_values(const TensorView& v, float* dst, int threads = 1);

// Indices [i0, i0 + n) of dimension `dim` of view v, as a view of the same memory (an empty view stays empty).
TensorView slice(const TensorView& v, int dim, int64_t i0, int64_t n);

// Rows [r0, r0 + n) of the rank-2 view w (R, C) as a contiguous (n, C) block of `to` at dst, as convert() reads them.
inline void copy_rows(const TensorView& w, int64_t r0, int64_t n, DType to, void* dst) {
  convert(slice(w, 0, r0, n), to, dst);
}

// A rank-1 or rank-2 view as f32 values in row-major order of its shape, exactly; empty for an empty view.
std::vector<float> f32_values(const TensorView& v);

// A (rows, width) matrix as oneDNN reads it: base pointer (elements of the Linears' operand type) and row stride; for
// quantized activations (operand u8) the scale of each row.
struct Rows {
  const void* data;
  int64_t ld;
  DType dtype;
  const float* scales = nullptr;  // u8 rows: x[i][k] = (q[i][k] - 128) * scales[i]
  const void* row(int64_t i) const { return static_cast<const std::byte*>(data) + i * ld * size_of(dtype); }
  const float* scale(int64_t i) const { return scales ? scales + i : nullptr; }
};
// Whether as_rows must copy the (B, N, W) view x for a layer computing in `compute` on GEMMs reading `operand`
// (Linear::operand: the compute type, f32 holding bf16 values where oneDNN has no bf16 matmul, or u8 for int8 GEMMs).
bool needs_packing(const TensorView& x, DType compute, DType operand);
// Bytes of scratch as_rows (and quantize_rows) needs for `rows` rows of `width` in `operand`: the elements, and for u8
// the rows' scales after them (64-byte aligned).
int64_t operand_bytes(DType operand, int64_t rows, int64_t width);
// x (B, N, W) as a (B*N, W) matrix of `operand` (values of the compute type, or u8 codes): in place, or converted into
// `scratch` (operand_bytes(operand, B*N, W)) across the team.
Rows as_rows(const TensorView& x, DType compute, DType operand, std::byte* scratch, int threads);
// The activations of an int8 GEMM: each row of x (B, N, W; f32, bf16 or f16, any strides) quantized symmetrically on
// its own, s = max|row| / 127, codes round(x / s) in [-127, 127] stored as u8 with 128 added (oneDNN's u8 x s8 GEMM on
// VNNI; the GEMM's epilogue takes 128 x the weights' column sums back off), into `scratch` as as_rows lays it out.
Rows quantize_rows(const TensorView& x, std::byte* scratch, int threads);

}  // namespace gpt2attn::detail
