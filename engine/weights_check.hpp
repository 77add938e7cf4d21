// engine/weights_check.hpp: the checks a layer's weights pass before it is built (engine/weights.cpp), beyond the
// public WeightsView::validate and Weights::validate that call them: a shard's output width, and checks that read
// no element.
#pragma once

#include <cstdint>
#include <string>

#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// WeightsView::validate(c) for a layer whose output projection is (out_width, E): a tensor-parallel shard's
// (engine/shard.hpp) maps its E_r = c.d_model columns to the full layer's width. `values` false checks ranks,
// shapes and dtypes only, reading no element: a tensor-parallel rank checks the whole file's tensors that way and
// the values of its own slices when its layer is built.
void validate_weights(const WeightsView& w, const Config& c, int64_t out_width, bool values = true);
// Weights::validate's first half: each vector's size against the config (views of the config's shapes over them are
// safe after it), reading no value. The layer built from the views then checks the values, once.
void check_weight_sizes(const Weights& w, const Config& c);
// Refuses a rank-2 weight matrix or rank-1 bias (f32, bf16 or f16, any strides) holding NaN or +-Inf: invalid_argument
// "<name> contains NaN at (r, c); weights must be finite" (one index for a bias), the first such element. A layer
// built from it would return NaN or Inf for every input, with no error at forward. Rows are scanned in their stored
// type; only a row that fails is converted to name the element.
void check_finite_weights(const TensorView& t, const std::string& name);

}  // namespace gpt2attn::detail
