// engine/weights_copy.hpp: reading a WeightsView's tensors (f32, bf16 or f16, any strides) into the contiguous
// rows the layer packs from, used once per layer, at construction (and per call by a bf16 Linear on f32 GEMMs, to
// widen its input); and Weights::random's counter-based values.
#pragma once

#include <cstdint>
#include <vector>

#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// Rows [r0, r0 + n) of the rank-2 view w (R, C) as a contiguous (n, C) block of `to` (f32 or bf16) at dst: exact
// where `to` holds every value of w's type (f32 <- bf16/f16, bf16 <- bf16), rounded to nearest even once where it
// does not (bf16 <- f32/f16: f16 widens exactly, so the one rounding is the f16 value's). Reads in 64 x 64 tiles,
// so a transposed view (a Conv1D weight) is read a cache line at a time. Unaligned data is read correctly.
void copy_rows(const TensorView& w, int64_t r0, int64_t n, DType to, void* dst);

// Indices [i0, i0 + n) of dimension `dim` of view v, as a view of the same memory (an empty view stays empty).
TensorView slice(const TensorView& v, int dim, int64_t i0, int64_t n);

// WeightsView::validate(c) for a layer whose output projection is (out_width, E): a tensor-parallel shard's
// (engine/shard.hpp) maps its E_r = c.d_model columns to the full layer's width. `values` false checks ranks,
// shapes and dtypes only, reading no element: a tensor-parallel rank checks the whole file's tensors that way and
// the values of its own slices when its layer is built.
void validate_weights(const WeightsView& w, const Config& c, int64_t out_width, bool values = true);
// Weights::validate's first half: each vector's size against the config (views of the config's shapes over them are
// safe after it), reading no value. The layer built from the views then checks the values, once.
void check_weight_sizes(const Weights& w, const Config& c);

// Weights::random's values for some heads' slices of layer c (a tensor-parallel shard's, engine/shard.hpp): W_q and
// b_q rows [q0, q0 + q_rows), W_k, W_v and their biases rows [kv0, kv0 + kv_rows), W_o's columns [q0, q0 + q_rows),
// b_o when out_bias (and c has one). The whole layer is {0, E, 0, H_kv D, true}. `what` names the call in the
// out_of_memory error refusing slices that cannot fit.
struct RandomSlice {
  int64_t q0 = 0, q_rows = 0, kv0 = 0, kv_rows = 0;
  bool out_bias = true;
};
Weights random_weights(const Config& c, uint64_t seed, const RandomSlice& s, const char* what);

// A rank-1 or rank-2 view as f32 values in row-major order of its shape, exactly; empty for an empty view.
std::vector<float> f32_values(const TensorView& v);

}  // namespace gpt2attn::detail
