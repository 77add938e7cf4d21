// gpt2attn/reference.hpp: the naive reference: plain loops, double accumulation, O(T*Tk) scores.
// Same semantics and dropout contract as MultiHeadAttention (attention.hpp); shares nothing with the fast path.
#pragma once

#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/options.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {

// Returns out (B, T, E) in double. Validates like MultiHeadAttention::forward (same errors).
GPT2ATTN_API std::vector<double> reference_forward(const Config& config, const Weights& weights,
                                                   const AttentionInputs& in, const RunOptions& run = {});

}  // namespace gpt2attn
