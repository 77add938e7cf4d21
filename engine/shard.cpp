// engine/shard.cpp: which heads a tensor-parallel shard owns, its slices of the weights (views, or generated), and
// its slice of a per-head mask. The layer a shard runs is the ordinary one (attention.cpp, Impl::create).
#include "engine/shard.hpp"

#include <string>

#include "engine/convert.hpp"
#include "engine/layer.hpp"
#include "engine/util.hpp"
#include "engine/weights_random.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn::detail {

HeadShard shard_of(const Config& full, int rank, int ranks) {
  full.validate();
  const int64_t H = full.num_heads, H_kv = full.kv_heads(), g = H / H_kv, D = full.head_dim();
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    invalid("tensor parallel: rank " + str(rank) + " of " + str(ranks) + " ranks is out of range");
  }
  if (ranks > H_kv) {
    invalid("tensor parallel: " + str(ranks) + " ranks but the layer has " + str(H_kv) + " K/V head" +
            (H_kv == 1 ? "" : "s") + "; each rank needs at least one (use at most " + str(H_kv) + " rank" +
            (H_kv == 1 ? ")" : "s)"));
  }
  HeadShard s;
  const int64_t base = H_kv / ranks, extra = H_kv % ranks;
  const int64_t kv = base + (rank < extra ? 1 : 0);
  s.first_kv_head = rank * base + std::min<int64_t>(rank, extra);
  s.first_head = s.first_kv_head * g;
  s.total_heads = H;
  s.out_width = full.d_model;
  s.rank = rank, s.ranks = ranks;
  s.local = full;
  s.local.num_heads = kv * g;
  s.local.num_kv_heads = kv;
  s.local.d_model = kv * g * D;
  s.local.d_in = full.query_width(), s.local.kdim = full.key_width(), s.local.vdim = full.value_width();
  s.local.out_bias = full.out_bias && rank == 0;  // b_o is added once, to the sum
  s.local.validate();
  return s;
}

WeightsView shard_weights(const WeightsView& full, const HeadShard& s) {
  const int64_t D = s.local.head_dim(), q0 = s.first_head * D, kv0 = s.first_kv_head * D;
  const int64_t E_r = s.local.d_model, KW_r = s.local.kv_width();
  WeightsView w;
  w.w_q = slice(full.w_q, 0, q0, E_r);
  w.w_k = slice(full.w_k, 0, kv0, KW_r);
  w.w_v = slice(full.w_v, 0, kv0, KW_r);
  w.w_o = slice(full.w_o, 1, q0, E_r);
  w.b_q = slice(full.b_q, 0, q0, E_r);
  w.b_k = slice(full.b_k, 0, kv0, KW_r);
  w.b_v = slice(full.b_v, 0, kv0, KW_r);
  if (s.local.out_bias) w.b_o = full.b_o;
  return w;
}

Weights random_shard_weights(const Config& full, uint64_t seed, const HeadShard& s) {
  const int64_t D = s.local.head_dim();
  return random_weights(full, seed,
                        {s.first_head * D, s.local.d_model, s.first_kv_head * D, s.local.kv_width(), s.local.out_bias},
                        "tensor parallel: random weights");
}

WeightsView local_view(const Weights& w, const HeadShard& s) {
  WeightsView v = w.view(s.local);
  v.w_o = TensorView::f32(w.w_o.data(), {s.out_width, s.local.d_model});
  if (!w.b_o.empty()) v.b_o = TensorView::f32(w.b_o.data(), {s.out_width});
  return v;
}

std::unique_ptr<MultiHeadAttention::Impl> make_shard_layer(const HeadShard& s, const WeightsView& w,
                                                           const EngineOptions& options) {
  // A causal shard whose widths agree serves KV caches (each rank quantizes its own slices, once, for both).
  return MultiHeadAttention::Impl::create(s.local, w, options, &s, s.local.causal && s.local.same_input_widths());
}

AttentionInputs shard_inputs(const AttentionInputs& in, const HeadShard& s) {
  AttentionInputs r = in;
  // A (B, H, T, Tk) mask of the full layer's H heads; a mask of another shape is left for validation to refuse.
  if (in.attn_mask.rank == 4 && in.attn_mask.shape[1] == s.total_heads && !in.attn_mask.empty()) {
    r.attn_mask = slice(in.attn_mask, 1, s.first_head, s.local.num_heads);
  }
  return r;
}

}  // namespace gpt2attn::detail
