// engine/shard.cpp: which heads a tensor-parallel shard owns, its slices of the weights (views, or generated), and
// its slice of a per-head mask. The layer a shard runs is the ordinary one (attention.cpp, Impl::create).
#include "engine/shard.hpp"

#include <string>

#include "engine/layer.hpp"
#include "engine/util.hpp"
#include "engine/weights_copy.hpp"
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
  const int64_t D = s.local.head_dim(), q0 = s.first_head * D, kv0 = s.first_kv_head * D;
  const int64_t E = full.d_model, KW = full.kv_width(), E_r = s.local.d_model, KW_r = s.local.kv_width();
  const int64_t d_in = full.query_width(), kdim = full.key_width(), vdim = full.value_width();
  using T = RandomTensor;
  // (rows, cols) of the full tensor `t` (R, cols), rows [r0, r0 + n) x columns [c0, c0 + m).
  auto block = [&](std::vector<float>& w, T t, int64_t cols, int64_t fan_in, int64_t r0, int64_t n, int64_t c0,
                   int64_t m) {
    check_fits_in_memory(checked_product({n, m, 4}, "tensor parallel: random weights"),
                         "tensor parallel: random weights");
    w.resize(static_cast<size_t>(n * m));
    random_block(seed, t, cols, fan_in, r0, n, c0, m, w.data());
  };
  Weights w;
  block(w.w_q, T::w_q, d_in, d_in, q0, E_r, 0, d_in);
  block(w.w_k, T::w_k, kdim, kdim, kv0, KW_r, 0, kdim);
  block(w.w_v, T::w_v, vdim, vdim, kv0, KW_r, 0, vdim);
  block(w.w_o, T::w_o, E, E, 0, E, q0, E_r);
  if (full.qkv_bias) {
    block(w.b_q, T::b_q, E, d_in, 0, 1, q0, E_r);
    block(w.b_k, T::b_k, KW, kdim, 0, 1, kv0, KW_r);
    block(w.b_v, T::b_v, KW, vdim, 0, 1, kv0, KW_r);
  }
  if (s.local.out_bias) block(w.b_o, T::b_o, E, E, 0, 1, 0, E);
  return w;
}

WeightsView local_view(const Weights& w, const HeadShard& s) {
  WeightsView v = w.view(s.local);
  v.w_o = TensorView::f32(w.w_o.data(), {s.out_width, s.local.d_model});
  if (!w.b_o.empty()) v.b_o = TensorView::f32(w.b_o.data(), {s.out_width});
  return v;
}

std::unique_ptr<MultiHeadAttention::Impl> make_shard_layer(const HeadShard& s, const WeightsView& w,
                                                           const EngineOptions& options) {
  std::unique_ptr<MultiHeadAttention::Impl> layer = MultiHeadAttention::Impl::create(s.local, w, options, &s);
  if (s.local.causal && s.local.same_input_widths()) {
    ScopedOmpThreads scope(options.threads);
    translate_bad_alloc("tensor parallel: packing the decode weights", [&] { layer->pack_decode_weights(w); });
  }
  return layer;
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
