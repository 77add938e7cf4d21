// engine/shard.hpp: one tensor-parallel shard of an attention layer, Megatron's split: a contiguous run of K/V heads
// with their query heads, the matching rows of W_q, W_k, W_v (and their biases) and columns of W_o. A shard is an
// ordinary layer (MultiHeadAttention::Impl) whose output is its heads' share of the output projection, so the sum
// of every shard's output is the full layer's. What sums them (MPI, engine/mpi/) is not here: no communication.
#pragma once

#include <cstdint>
#include <memory>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// Shard r of n of a layer `full` (H heads, H_kv K/V heads, E = H D):
//   K/V heads [first_kv_head, first_kv_head + local.kv_heads()): H_kv / n each, the first H_kv % n shards one more
//   query heads [first_head, first_head + local.num_heads): the g = H / H_kv heads of each of its K/V heads
// so gpt2-xl's 25 heads on 2 shards are 13 + 12, and no K/V head is computed twice.
struct HeadShard {
  Config local;                // what the shard computes: E_r = H_r D wide, H_r heads, H_kv_r K/V heads, the full
                               // layer's input widths, context, causality, dropout; out_bias on shard 0 only
  int64_t first_head = 0, first_kv_head = 0;
  int64_t total_heads = 0;     // H of the full layer
  int64_t out_width = 0;       // E of the full layer: the shard writes (B, T, E) partial outputs
  int rank = 0, ranks = 1;
};

// Throws invalid_argument when ranks < 1, rank is outside [0, ranks), or ranks > H_kv (a shard with no K/V head).
HeadShard shard_of(const Config& full, int rank, int ranks);

// The shard's slices of the full layer's weights, as views into the same memory (nothing is copied or read):
//   w_q (E_r, d_in) rows [first_head D, ...), w_k, w_v (H_kv_r D, kdim|vdim) rows [first_kv_head D, ...),
//   w_o (E, E_r) columns [first_head D, ...), the Q/K/V biases' matching ranges, b_o on shard 0 only.
// `full` must be valid for the full config (WeightsView::validate).
WeightsView shard_weights(const WeightsView& full, const HeadShard& s);

// The shard of Weights::random(full, seed): the same values, generated for the shard's slices only (a gpt3-175b
// shard does not materialise the whole layer). Shapes as shard_weights gives them, contiguous.
Weights random_shard_weights(const Config& full, uint64_t seed, const HeadShard& s);

// Views of a shard's own tensors (random_shard_weights' or any with its shapes): Weights::view with w_o (E, E_r).
WeightsView local_view(const Weights& w, const HeadShard& s);

// The shard's layer over its weights (shard_weights or local_view): an ordinary layer of s.local whose output
// projection is (E, E_r), and which, when it is causal self-attention, has decode's packed weights too, so it serves
// a KV cache of s.local's shape. Validates like the public constructors.
std::unique_ptr<MultiHeadAttention::Impl> make_shard_layer(const HeadShard& s, const WeightsView& w,
                                                           const EngineOptions& options);

// A call's inputs for the shard: a per-head (B, H, T, Tk) attention mask sliced to the shard's heads; the rest as
// given. Validation (against s.local) is the layer's.
AttentionInputs shard_inputs(const AttentionInputs& in, const HeadShard& s);

}  // namespace gpt2attn::detail
