// engine/weights_copy.hpp: reading a WeightsView's tensors (f32, bf16 or f16, any strides) into the contiguous
// rows the layer packs from. Used once per layer, at construction.
#pragma once

#include <cstdint>
#include <vector>

#include "gpt2attn/tensor.hpp"

namespace gpt2attn::detail {

// Rows [r0, r0 + n) of the rank-2 view w (R, C) as a contiguous (n, C) block of `to` (f32 or bf16) at dst: exact
// where `to` holds every value of w's type (f32 <- bf16/f16, bf16 <- bf16), rounded to nearest even once where it
// does not (bf16 <- f32/f16: f16 widens exactly, so the one rounding is the f16 value's). Reads in 64 x 64 tiles,
// so a transposed view (a Conv1D weight) is read a cache line at a time. Unaligned data is read correctly.
void copy_rows(const TensorView& w, int64_t r0, int64_t n, DType to, void* dst);

// A rank-1 or rank-2 view as f32 values in row-major order of its shape, exactly; empty for an empty view.
std::vector<float> f32_values(const TensorView& v);

}  // namespace gpt2attn::detail
