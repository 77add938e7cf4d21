// engine/weights_random.hpp: Weights::random's counter-based values for any slice of a layer (engine/weights.cpp),
// so that a tensor-parallel shard generates its own slices without the rest of the layer.
#pragma once

#include <cstdint>

#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// Weights::random's values for some heads' slices of layer c (a tensor-parallel shard's, engine/shard.hpp): W_q and
// b_q rows [q0, q0 + q_rows), W_k, W_v and their biases rows [kv0, kv0 + kv_rows), W_o's columns [q0, q0 + q_rows),
// b_o when out_bias (and c has one). The whole layer is {0, E, 0, H_kv D, true}. `what` names the call in the
// out_of_memory error refusing slices that cannot fit.
struct RandomSlice {
  int64_t q0 = 0, q_rows = 0, kv0 = 0, kv_rows = 0;
  bool out_bias = true;
};
Weights random_weights(const Config& c, uint64_t seed, const RandomSlice& s, const char* what);

}  // namespace gpt2attn::detail
