// tests/test_shard.cpp: tensor-parallel shards (engine/shard.hpp) without MPI: the sum of every shard's partial
// output equals the whole layer's, for forward (every mask kind, per-head masks, key padding, cross-attention,
// dropout), and for extend + decode on each shard's own KV pool; the split of heads; the random weights' slices.
// The MPI module that sums over ranks is tested under mpiexec (tests/mpi/).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/convert.hpp"
#include "engine/layer.hpp"
#include "engine/shard.hpp"
#include "gpt2attn/error.hpp"
#include "tests/file_test_util.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerance.hpp"

namespace gpt2attn {
namespace {

using Layer = std::unique_ptr<MultiHeadAttention::Impl>;

Config make(int64_t E, int64_t H, int64_t H_kv, bool causal, int64_t kdim = 0) {
  Config c;
  c.d_model = E, c.num_heads = H, c.num_kv_heads = H_kv, c.causal = causal, c.kdim = kdim, c.vdim = kdim;
  c.context_length = 256;
  return c;
}

// The shards of `c` on `ranks` ranks, each built from its slices of w.
std::vector<Layer> shards_of(const Config& c, const Weights& w, int ranks, std::vector<detail::HeadShard>& specs) {
  std::vector<Layer> out;
  specs.clear();
  for (int r = 0; r < ranks; ++r) specs.push_back(detail::shard_of(c, r, ranks));
  for (int r = 0; r < ranks; ++r) {
    out.push_back(detail::make_shard_layer(specs[r], detail::shard_weights(w.view(c), specs[r]), {.threads = 1}));
  }
  return out;
}

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST(Shard, HeadsSplitByKvHeadFirstRanksTakeOneMore) {
  auto heads = [](const Config& c, int ranks) {
    std::vector<int64_t> h;
    int64_t next = 0;
    for (int r = 0; r < ranks; ++r) {
      const detail::HeadShard s = detail::shard_of(c, r, ranks);
      EXPECT_EQ(s.first_head, next) << "rank " << r;
      next += s.local.num_heads;
      h.push_back(s.local.num_heads);
      EXPECT_EQ(s.local.d_model, s.local.num_heads * c.head_dim());
      EXPECT_EQ(s.local.out_bias, r == 0);
      EXPECT_EQ(s.out_width, c.d_model);
    }
    EXPECT_EQ(next, c.num_heads);
    return h;
  };
  EXPECT_EQ(heads(preset("gpt2-xl"), 2), (std::vector<int64_t>{13, 12}));
  EXPECT_EQ(heads(make(48, 12, 0, true), 5), (std::vector<int64_t>{3, 3, 2, 2, 2}));
  EXPECT_EQ(heads(make(32, 8, 4, true), 3), (std::vector<int64_t>{4, 2, 2}));  // groups of 2 stay whole
  EXPECT_TRUE(testutil::ThrowsError([] { detail::shard_of(make(32, 8, 2, true), 0, 3); }, ErrorCode::invalid_argument,
                                "3 ranks but the layer has 2 K/V heads"));
  EXPECT_TRUE(testutil::ThrowsError([] { detail::shard_of(make(32, 8, 0, true), 3, 3); }, ErrorCode::invalid_argument,
                                "rank 3 of 3"));
}

TEST(Shard, RandomShardWeightsAreTheSlicesOfTheWholeLayers) {
  for (const Config& c : {make(100, 25, 0, true), make(32, 8, 4, false, 24)}) {
    const Weights full = Weights::random(c, 7);
    for (int r = 0; r < 3; ++r) {
      const detail::HeadShard s = detail::shard_of(c, r, 3);
      const WeightsView sliced = detail::shard_weights(full.view(c), s);
      const Weights gen = detail::random_shard_weights(c, 7, s);
      const WeightsView mine = detail::local_view(gen, s);
      const TensorView* a[] = {&sliced.w_q, &sliced.w_k, &sliced.w_v, &sliced.w_o,
                               &sliced.b_q, &sliced.b_k, &sliced.b_v, &sliced.b_o};
      const TensorView* b[] = {&mine.w_q, &mine.w_k, &mine.w_v, &mine.w_o,
                               &mine.b_q, &mine.b_k, &mine.b_v, &mine.b_o};
      for (int t = 0; t < 8; ++t) {
        EXPECT_EQ(a[t]->shape_str(), b[t]->shape_str()) << "tensor " << t << " rank " << r;
        EXPECT_EQ(detail::f32_values(*a[t]), detail::f32_values(*b[t])) << "tensor " << t << " rank " << r;
      }
    }
  }
}

// Sum over shards of forward(in) vs the whole layer's forward(in).
void expect_shards_sum_to_layer(const Config& c, int ranks, const AttentionInputs& in, const RunOptions& run,
                                const std::string& what) {
  const Weights w = Weights::random(c, 11);
  MultiHeadAttention whole(c, w, {.threads = 1});
  const int64_t B = in.query.shape[0], T = in.query.shape[1], Tk = in.key.empty() ? T : in.key.shape[1];
  std::vector<float> want(static_cast<size_t>(B * T * c.d_model));
  whole.forward(in, want.data(), run);
  std::vector<detail::HeadShard> specs;
  std::vector<Layer> shards = shards_of(c, w, ranks, specs);
  std::vector<float> sum(want.size(), 0.0f), part(want.size());
  for (int r = 0; r < ranks; ++r) {
    shards[r]->with_workspace(nullptr, "forward", [&](Workspace::Impl& ws) {
      shards[r]->forward(detail::shard_inputs(in, specs[r]), part.data(), DType::f32, run, ws);
    });
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  const int64_t L = std::max({c.query_width(), c.d_model, Tk});
  EXPECT_TRUE(test::all_close(sum, as_double(want), DType::f32, L, what + " on " + std::to_string(ranks) + " shards"));
}

TEST(Shard, ForwardSumsToTheWholeLayer) {
  std::mt19937_64 rng(3);
  for (auto [c, ranks] : {std::pair{make(100, 25, 0, true), 2}, {make(100, 25, 0, true), 3},
                          {make(48, 12, 0, true), 5}, {make(32, 8, 4, true), 3}}) {
    const int64_t B = 2, T = 13;
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(B * T * c.d_model), rng);
    AttentionInputs in;
    in.query = TensorView::f32(x.data(), {B, T, c.d_model});
    expect_shards_sum_to_layer(c, ranks, in, {}, "causal self-attention");
  }
}

TEST(Shard, PerHeadMasksPaddingCrossAttentionAndDropoutFollowTheirHeads) {
  std::mt19937_64 rng(5);
  const Config c = make(100, 25, 0, false, 36);
  const int64_t B = 2, T = 7, Tk = 11, H = c.num_heads;
  const std::vector<float> q = test::random_uniform(static_cast<size_t>(B * T * c.d_model), rng);
  const std::vector<float> k = test::random_uniform(static_cast<size_t>(B * Tk * 36), rng);
  const std::vector<float> v = test::random_uniform(static_cast<size_t>(B * Tk * 36), rng);
  std::vector<uint8_t> mask(static_cast<size_t>(B * H * T * Tk));
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (rng() % 3) == 0;
  for (int64_t j = 0; j < Tk; ++j) mask[static_cast<size_t>(((1 * H + 20) * T + 4) * Tk + j)] = 1;  // a fully masked row
  std::vector<float> additive(mask.size());
  for (size_t i = 0; i < mask.size(); ++i) additive[i] = mask[i] ? -1e9f : static_cast<float>(rng() % 5) * 0.1f;
  std::vector<uint8_t> padding(static_cast<size_t>(B * Tk), 0);
  padding[3] = padding[static_cast<size_t>(Tk + 9)] = 1;
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, c.d_model});
  in.key = TensorView::f32(k.data(), {B, Tk, 36});
  in.value = TensorView::f32(v.data(), {B, Tk, 36});
  in.key_padding = TensorView::u8(padding.data(), {B, Tk});
  for (MaskKind kind : {MaskKind::block, MaskKind::keep}) {
    in.attn_mask = TensorView::u8(mask.data(), {B, H, T, Tk});
    in.mask_kind = kind;
    expect_shards_sum_to_layer(c, 3, in, {}, "u8 (B, H, T, Tk) mask");
  }
  in.attn_mask = TensorView::f32(additive.data(), {B, H, T, Tk});
  in.mask_kind = MaskKind::additive;
  expect_shards_sum_to_layer(c, 2, in, {}, "additive (B, H, T, Tk) mask");
  Config d = c;
  d.dropout = 0.25f;
  expect_shards_sum_to_layer(d, 3, in, {.training = true, .dropout_seed = 99}, "training dropout");
}

TEST(Shard, ExtendAndDecodeOnEachShardsPoolSumToTheWholeLayer) {
  std::mt19937_64 rng(9);
  const Config c = make(100, 25, 0, true);
  const Weights w = Weights::random(c, 13);
  CausalSelfAttention whole(c, w, {.threads = 1});
  KvCacheOptions o;
  o.block_tokens = 8, o.capacity_tokens = 256;
  KvCache cache(whole.config(), o);
  std::vector<detail::HeadShard> specs;
  std::vector<Layer> shards = shards_of(c, w, 3, specs);
  std::vector<KvCache> pools;
  for (const auto& s : specs) pools.emplace_back(s.local, o);

  const int64_t E = c.d_model;
  std::vector<SequenceId> ids;
  for (int64_t len : {5, 17}) {
    const SequenceId id = cache.create();
    for (KvCache& p : pools) EXPECT_EQ(p.create(), id);
    ids.push_back(id);
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(len * E), rng);
    std::vector<float> want(static_cast<size_t>(len * E)), sum(want.size(), 0.0f), part(want.size());
    whole.extend(cache, id, x.data(), len, want.data());
    for (size_t r = 0; r < shards.size(); ++r) {
      shards[r]->with_workspace(nullptr, "extend", [&](Workspace::Impl& ws) {
        shards[r]->extend(pools[r], id, x.data(), len, part.data(), {}, ws);
      });
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_TRUE(test::all_close(sum, as_double(want), DType::f32, std::max<int64_t>(E, len), "extend"));
  }
  for (int step = 0; step < 3; ++step) {
    const int64_t B = static_cast<int64_t>(ids.size());
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(B * E), rng);
    std::vector<float> want(static_cast<size_t>(B * E)), sum(want.size(), 0.0f), part(want.size());
    whole.decode(cache, ids.data(), B, x.data(), want.data());
    for (size_t r = 0; r < shards.size(); ++r) {
      shards[r]->with_workspace(nullptr, "decode", [&](Workspace::Impl& ws) {
        shards[r]->decode(pools[r], ids.data(), B, x.data(), part.data(), {}, ws);
      });
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_TRUE(test::all_close(sum, as_double(want), DType::f32, E + 32, "decode step " + std::to_string(step)));
  }
}

}  // namespace
}  // namespace gpt2attn
