// tests/test_kv_cache_storage.cpp: KV caches storing K/V in bf16 or int8 (KvCacheOptions::dtype). Storage rounds
// each K/V value once, by design, so the layer's outputs are checked against naive attention over the K/V the cache
// really holds (read back exactly with read_key / read_value), with Q and the output projection in double: the f32
// tolerance then applies (int8 decode adds its query's rounding: kv_kernel_tolerance), and what is under test is
// the engine's path (staging, the writer, the dispatch row per cache dtype) and each format's kernels. Separately:
// what is stored is the f32 projection rounded once (bf16: to nearest even; int8: within half a step of its row's
// scale), a pool of a fixed byte size holds 2x (bf16) and about 3.8x (int8, gpt2-small) the tokens of f32, forks
// copy quantised blocks with their scales, the int8 codec's edge cases, and only f32, bf16 and i8 are accepted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/reference.hpp"
#include "kernels/bf16.hpp"
#include "kernels/kv_codec.hpp"
#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::cached_key;
using test::cached_value;
using test::Dtype;
using test::IsaTest;
using test::random_uniform;
using test::serving_config;

// out rows [t0, t1) of one sequence whose cache holds tokens [0, t1): Q = x W_q^T + b_q in double, K and V as the
// cache stores them, causal softmax in double, out = ctx W_o^T + b_o. Query head h reads K/V head h / (H / H_kv).
std::vector<double> attention_over_cache(const KvCache& cache, SequenceId id, const Config& c, const Weights& w,
                                         const std::vector<float>& x, int64_t t0, int64_t t1) {
  const int64_t E = c.d_model, H = c.num_heads, D = c.head_dim(), W = c.query_width(), group = H / c.kv_heads();
  std::vector<std::vector<float>> K, V;  // [t * H_kv + g] -> D values
  for (int64_t t = 0; t < t1; ++t) {
    for (int64_t g = 0; g < c.kv_heads(); ++g) {
      K.push_back(cached_key(cache, id, g, t));
      V.push_back(cached_value(cache, id, g, t));
    }
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> out;
  for (int64_t i = t0; i < t1; ++i) {
    std::vector<double> q(static_cast<size_t>(E)), ctx(static_cast<size_t>(E), 0.0);
    for (int64_t e = 0; e < E; ++e) {
      double acc = w.b_q.empty() ? 0.0 : w.b_q[e];
      for (int64_t k = 0; k < W; ++k) acc += static_cast<double>(x[i * W + k]) * w.w_q[e * W + k];
      q[e] = acc;
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      std::vector<double> s(static_cast<size_t>(i + 1));
      double mx = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * K[j * c.kv_heads() + g][d];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0.0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (int64_t j = 0; j <= i; ++j) {
        for (int64_t d = 0; d < D; ++d) ctx[h * D + d] += s[j] / sum * V[j * c.kv_heads() + g][d];
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      double acc = w.b_o.empty() ? 0.0 : w.b_o[e];
      for (int64_t k = 0; k < E; ++k) acc += ctx[k] * w.w_o[e * E + k];
      out.push_back(acc);
    }
  }
  return out;
}

const std::vector<DType> kStorageTypes = test::stored_kv_formats();

// `row` stored in a one-row block of `dtype` and read back. Applied to a row read back from a cache, it tells whether
// the format holds it: a stored row is a fixed point.
std::vector<float> restored(const std::vector<float>& row, DType dtype) {
  const kernels::KvLayout one{dtype, 1, 1, static_cast<int64_t>(row.size())};
  std::vector<std::byte> block(static_cast<size_t>(one.block_bytes()));
  std::vector<float> out(row.size());
  kernels::store_kv_row(one, block.data(), kernels::KvPart::value, 0, 0, row.data());
  kernels::load_kv_row(one, block.data(), kernels::KvPart::value, 0, 0, out.data());
  return out;
}

class KvCacheStorage : public IsaTest {};

// Chunked prefill then decode steps, every output row against attention over the cache's own K/V; shapes with odd
// head sizes, grouped and single K/V heads, blocks of 1, 3 and 64 tokens (chunks that end mid-block).
TEST_P(KvCacheStorage, OutputsAreAttentionOverTheStoredKv) {
  struct Case {
    Config cfg;
    int64_t block_tokens, first_chunk, second_chunk, steps;
  };
  std::vector<Case> cases = {
      {serving_config(48, 4, 0, 256), 64, 37, 30, 3},  // D = 12
      {serving_config(36, 3, 20, 256), 3, 8, 5, 4},    // D = 12, d_in != E
      {serving_config(66, 6, 0, 256), 1, 5, 2, 2},     // D = 11
      {serving_config(128, 2, 0, 512), 64, 130, 1, 2},  // D = 64, T past two blocks
  };
  cases[0].cfg.num_kv_heads = 2;
  cases[2].cfg.num_kv_heads = 1;
  int index = 0;
  for (DType dtype : kStorageTypes) {
  for (const Case& k : cases) {
    const Config& c = k.cfg;
    const std::string what = "case " + std::to_string(index) + ": " + to_string(dtype) + " E=" +
                             std::to_string(c.d_model) + " H=" + std::to_string(c.num_heads) + " H_kv=" +
                             std::to_string(c.kv_heads()) + " block_tokens=" + std::to_string(k.block_tokens) +
                             " [isa=" + to_string(isa()) + "]";
    const Weights w = Weights::random(c, 300 + static_cast<uint64_t>(index++));
    CausalSelfAttention block = test::make_block(c, w, isa(), 2);
    const int64_t N = k.first_chunk + k.second_chunk + k.steps, W = c.query_width(), E = c.d_model;
    std::mt19937_64 rng(7);
    const std::vector<float> x = random_uniform(static_cast<size_t>(N * W), rng, -2.0f, 2.0f);
    KvCacheOptions o = test::pool(k.block_tokens, N + k.block_tokens);
    o.dtype = dtype;
    KvCache cache(c, o);
    ASSERT_EQ(cache.dtype(), dtype);
    const SequenceId id = cache.create();
    Workspace ws;
    int64_t done = 0;
    for (int64_t chunk : {k.first_chunk, k.second_chunk}) {
      std::vector<float> out(static_cast<size_t>(chunk * E), test::kNaN);
      block.extend(cache, id, x.data() + done * W, chunk, out.data(), RunOptions{}, &ws);
      EXPECT_TRUE(all_close(out, attention_over_cache(cache, id, c, w, x, done, done + chunk), Dtype::f32, N,
                            what + " | extend rows " + std::to_string(done) + ".." + std::to_string(done + chunk)));
      done += chunk;
    }
    for (int64_t s = 0; s < k.steps; ++s, ++done) {
      std::vector<float> out(static_cast<size_t>(E), test::kNaN);
      block.decode(cache, &id, 1, x.data() + done * W, out.data(), RunOptions{}, &ws);
      EXPECT_TRUE(test::all_close_over_cache(out, attention_over_cache(cache, id, c, w, x, done, done + 1), dtype,
                                             c.head_dim(), N, what + " | decode token " + std::to_string(done)));
    }
    // What was stored is the f32 projection rounded once: bf16 and fp8 within one ulp of each value (2u relative: a
    // value whose f32 and double projections straddle a rounding boundary may land on the neighbouring one; fp8's
    // subnormals within one step, 2^-9); int8 within half a step (max|row| / 254) plus the f32 projection's own error. And a stored row is a fixed point
    // of the format: storing what was read back changes nothing.
    for (int64_t t = 0; t < done; t += 7) {
      for (int64_t g = 0; g < c.kv_heads(); ++g) {
        const std::vector<float> key = cached_key(cache, id, g, t), value = cached_value(cache, id, g, t);
        std::vector<double> pk(static_cast<size_t>(c.head_dim())), pv(pk);
        for (int64_t d = 0; d < c.head_dim(); ++d) {
          const int64_t e = g * c.head_dim() + d;
          pk[d] = w.b_k[e], pv[d] = w.b_v[e];
          for (int64_t i = 0; i < W; ++i) {
            pk[d] += static_cast<double>(x[t * W + i]) * w.w_k[e * W + i];
            pv[d] += static_cast<double>(x[t * W + i]) * w.w_v[e * W + i];
          }
        }
        for (auto [got, want, name] : {std::tuple{&key, &pk, "key"}, std::tuple{&value, &pv, "value"}}) {
          double amax = 0.0;
          for (double e : *want) amax = std::max(amax, std::fabs(e));
          for (int64_t d = 0; d < c.head_dim(); ++d) {
            const double allowed = dtype == DType::i8 ? amax / 254.0 + 1e-5
                                   : 2.0 * unit_roundoff(dtype) * std::fabs((*want)[d]) +
                                         (dtype == DType::fp8 ? 0x1p-9 : 0.0) + 1e-6;
            EXPECT_LE(std::fabs((*got)[d] - (*want)[d]), allowed) << what << " " << name << " t=" << t << " d=" << d;
          }
          EXPECT_EQ(*got, restored(*got, dtype)) << what << ": a stored " << name << " is not a " << to_string(dtype)
                                                 << " row";
        }
      }
    }
    EXPECT_EQ(cache.impl().audit(), "") << what;
  }
  }
}

// A fork shares a partly filled stored (bf16, int8, fp8) block; the child's first append copies it (int8: with its scales),
// and both then decode against their own histories.
TEST_P(KvCacheStorage, ForkCopiesStoredBlocks) {
  for (DType dtype : kStorageTypes) {
  SCOPED_TRACE(to_string(dtype));
  const Config c = serving_config(32, 2, 0, 64);
  const Weights w = Weights::random(c, 9);
  CausalSelfAttention block = test::make_block(c, w, isa(), 1);
  KvCacheOptions o = test::pool(4, 64);
  o.dtype = dtype;
  KvCache cache(c, o);
  std::mt19937_64 rng(3);
  const std::vector<float> x = random_uniform(static_cast<size_t>(12 * c.d_model), rng, -1.0f, 1.0f);
  std::vector<float> parent_x(x.begin(), x.begin() + 6 * c.d_model), child_x = parent_x;
  parent_x.insert(parent_x.end(), x.begin() + 6 * c.d_model, x.begin() + 7 * c.d_model);
  child_x.insert(child_x.end(), x.begin() + 7 * c.d_model, x.begin() + 8 * c.d_model);
  const SequenceId parent = cache.create();
  std::vector<float> out(static_cast<size_t>(6 * c.d_model));
  block.extend(cache, parent, x.data(), 6, out.data());
  const SequenceId child = cache.fork(parent);
  std::vector<float> yp(static_cast<size_t>(c.d_model)), yc(yp);
  block.decode(cache, &child, 1, child_x.data() + 6 * c.d_model, yc.data());
  block.decode(cache, &parent, 1, parent_x.data() + 6 * c.d_model, yp.data());
  EXPECT_TRUE(test::all_close_over_cache(yp, attention_over_cache(cache, parent, c, w, parent_x, 6, 7), dtype,
                                         c.head_dim(), 7, "parent"));
  EXPECT_TRUE(test::all_close_over_cache(yc, attention_over_cache(cache, child, c, w, child_x, 6, 7), dtype,
                                         c.head_dim(), 7, "child"));
  EXPECT_NE(test::block_of(cache, parent, 5), test::block_of(cache, child, 5)) << "the shared block was not copied";
  EXPECT_EQ(cached_key(cache, parent, 1, 5), cached_key(cache, child, 1, 5)) << "the copy lost the shared tokens";
  EXPECT_EQ(cached_value(cache, parent, 0, 4), cached_value(cache, child, 0, 4)) << "the copy lost the shared tokens";
  EXPECT_EQ(cache.impl().audit(), "");
  }
}
// K/V values at the top of f32's range, finite, stay finite in every format: a value past what the format holds
// (bf16's largest, 0x1.fep127) saturates to its largest finite value of that sign (kernels/kv_codec.hpp). V = b_v (W_v = 0) holds +-FLT_MAX and
// its neighbours; one cached token, so attention returns its V row exactly, and W_o = 2^-8 I keeps the output
// finite: the output is the stored row times 2^-8, and the stored row is the format's largest value where x was past
// it, the value itself where it was not.
TEST_P(KvCacheStorage, ValuesPastAFormatsRangeSaturate) {
  const Config c = serving_config(16, 2, 0, 64);
  const int64_t E = c.d_model;
  Weights w = Weights::random(c, 99);
  std::fill(w.w_v.begin(), w.w_v.end(), 0.0f);
  const std::vector<float> top = {FLT_MAX, -FLT_MAX, 3.39e38f, -3.39e38f, 3.0e38f, 2.9e38f, 1.0f, -0.5f};
  for (int64_t e = 0; e < E; ++e) w.b_v[static_cast<size_t>(e)] = top[static_cast<size_t>(e) % top.size()];
  std::fill(w.w_o.begin(), w.w_o.end(), 0.0f);
  for (int64_t e = 0; e < E; ++e) w.w_o[static_cast<size_t>(e * E + e)] = 0x1p-8f;
  std::fill(w.b_o.begin(), w.b_o.end(), 0.0f);
  CausalSelfAttention block = test::make_block(c, w, isa(), 2);
  std::mt19937_64 rng(5);
  const std::vector<float> x = random_uniform(static_cast<size_t>(c.query_width()), rng, -1.0f, 1.0f);
  for (DType dtype : test::kv_formats()) {
    const std::string what = std::string(to_string(dtype)) + " [isa=" + to_string(isa()) + "]";
    KvCacheOptions o = test::pool(4, 8);
    o.dtype = dtype;
    KvCache cache(c, o);
    const SequenceId id = cache.create();
    std::vector<float> out(static_cast<size_t>(E), test::kNaN);
    block.extend(cache, id, x.data(), 1, out.data());
    for (int64_t g = 0; g < c.kv_heads(); ++g) {
      const std::vector<float> v = cached_value(cache, id, g, 0);
      for (int64_t d = 0; d < c.head_dim(); ++d) {
        const int64_t e = g * c.head_dim() + d;
        const float want = top[static_cast<size_t>(e) % top.size()], got = v[static_cast<size_t>(d)];
        ASSERT_TRUE(std::isfinite(got)) << what << ": V[" << e << "] = " << want << " stored as " << got;
        if (got != 0.0f) {  // int8 stores -0.5 beside FLT_MAX as 0
          EXPECT_EQ(std::signbit(got), std::signbit(want)) << what << " e=" << e;
        }
        const double cap = dtype == DType::bf16 ? 0x1.fep127 : FLT_MAX;  // the format's largest finite value
        const double held = std::clamp(static_cast<double>(want), -cap, cap);
        EXPECT_LE(std::fabs(got - held), 0x1p-4 * std::fabs(held) + 1.0) << what << " e=" << e;
        EXPECT_EQ(out[static_cast<size_t>(e)], got * 0x1p-8f) << what << " e=" << e;
      }
    }
  }
  // The largest finite value of each format, exactly, where FLT_MAX was stored.
  const auto stored = [](DType dtype, float x) { return restored({x, 1.0f}, dtype)[0]; };
  EXPECT_EQ(stored(DType::bf16, FLT_MAX), 0x1.fep127f);
  EXPECT_EQ(stored(DType::bf16, -FLT_MAX), -0x1.fep127f);
  EXPECT_GE(stored(DType::fp8, FLT_MAX), FLT_MAX * (1.0f - 0x1p-20f));
  EXPECT_TRUE(std::isfinite(stored(DType::i8, FLT_MAX)));
  EXPECT_GE(stored(DType::i8, FLT_MAX), FLT_MAX * (1.0f - 0x1p-8f));
  for (DType dtype : {DType::bf16, DType::i8, DType::fp8}) EXPECT_FALSE(std::isfinite(stored(dtype, INFINITY)));
}
// Finite V whose weighted sum over the keys passes FLT_MAX: the output, a convex combination of V's rows times W_o,
// is finite, and so must every path's be (kernels/attention.hpp, "Overflow"): forward (contiguous K/V), extend (the
// tiled kernel over the cache's blocks) and decode (split over two threads, then merged), in each compute type and
// K/V format. V = b_v + W_v x holds columns near +-1.5e38 that differ from row to row, columns of 1e-30 (which the
// re-run alone would flush: they must keep the first pass's value) and ordinary ones; W_o = 2^-8 I.
TEST_P(KvCacheStorage, ValuesWhoseSumPassesFltMaxGiveFiniteOutputs) {
  const Config c = serving_config(32, 2, 0, 128);
  const int64_t E = c.d_model, W = c.query_width(), N = 70, steps = 3;
  Weights w = Weights::random(c, 17);
  const std::vector<float> column = {1.5e38f, -1.5e38f, 1e-30f, 0.75f};
  for (int64_t e = 0; e < E; ++e) {
    const float top = column[static_cast<size_t>(e) % column.size()];
    w.b_v[static_cast<size_t>(e)] = top;
    for (int64_t i = 0; i < W; ++i) w.w_v[static_cast<size_t>(e * W + i)] *= std::fabs(top) > 1.0f ? 1e36f : 1e-32f;
  }
  std::fill(w.w_o.begin(), w.w_o.end(), 0.0f);
  for (int64_t e = 0; e < E; ++e) w.w_o[static_cast<size_t>(e * E + e)] = 0x1p-8f;
  std::fill(w.b_o.begin(), w.b_o.end(), 0.0f);
  std::mt19937_64 rng(11);
  const std::vector<float> x = random_uniform(static_cast<size_t>((N + steps) * W), rng, -1.0f, 1.0f);
  for (DType compute : {DType::f32, DType::bf16}) {
    CausalSelfAttention block = test::make_block(c, w, isa(), 2, compute);
    const std::string in = std::string(to_string(compute)) + " compute [isa=" + to_string(isa()) + "]";
    std::vector<float> y(static_cast<size_t>(N * E), test::kNaN);
    block.forward(x.data(), 1, N, y.data());
    AttentionInputs inputs;
    inputs.query = TensorView::f32(x.data(), {1, N, W});
    EXPECT_TRUE(all_close(y, reference_forward(block.config(), w, inputs), compute, N, "forward, " + in));
    for (DType dtype : test::kv_formats()) {
      const std::string what = std::string(to_string(dtype)) + " cache, " + in;
      KvCacheOptions o = test::pool(16, N + steps + 16);
      o.dtype = dtype;
      KvCache cache(c, o);
      const SequenceId id = cache.create();
      block.extend(cache, id, x.data(), N, y.data());
      // A bf16 layer's extend rounds Q and the context to bf16 (its compute policy); decode computes in f32.
      const std::vector<double> want = attention_over_cache(cache, id, c, w, x, 0, N);
      EXPECT_TRUE(compute == DType::bf16
                      ? all_close(y, want, Dtype::bf16, N, "extend, " + what)
                      : test::all_close_over_cache(y, want, dtype, c.head_dim(), N, "extend, " + what));
      for (int64_t t = N; t < N + steps; ++t) {
        std::vector<float> out(static_cast<size_t>(E), test::kNaN);
        block.decode(cache, &id, 1, x.data() + t * W, out.data());
        EXPECT_TRUE(test::all_close_over_cache(out, attention_over_cache(cache, id, c, w, x, t, t + 1), dtype,
                                               c.head_dim(), t + 1, "decode token " + std::to_string(t) + ", " + what));
      }
    }
  }
}

// A projection whose finite inputs and weights overflow float32 is an error naming it, on every entry point; the
// cache is left as it was. The key weights times 1e30 give K rows past FLT_MAX for inputs of 1e10.
TEST_P(KvCacheStorage, AProjectionThatOverflowsIsAnErrorNamingIt) {
  const Config c = serving_config(32, 2, 0, 128);
  const int64_t E = c.d_model, W = c.query_width();
  Weights w = Weights::random(c, 23);
  for (float& k : w.w_k) k *= 1e30f;
  CausalSelfAttention block = test::make_block(c, w, isa(), 2);
  std::vector<float> x(static_cast<size_t>(4 * W), 1e10f), y(static_cast<size_t>(4 * E), 0.0f);
  const auto fails_naming = [&](auto&& call, const std::string& name) {
    try {
      call();
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("overflowed"), std::string::npos) << e.what();
    }
  };
  fails_naming([&] { block.forward(x.data(), 1, 4, y.data()); }, "forward: the key projection");
  for (DType dtype : test::kv_formats()) {
    KvCacheOptions o = test::pool(16, 64);
    o.dtype = dtype;
    KvCache cache(c, o);
    const SequenceId id = cache.create();
    fails_naming([&] { block.extend(cache, id, x.data(), 4, y.data()); }, "extend: the key projection");
    EXPECT_EQ(cache.length(id), 0) << to_string(dtype);
    const std::vector<float> small(static_cast<size_t>(2 * W), 0.5f);
    block.extend(cache, id, small.data(), 2, y.data());
    fails_naming([&] { block.decode(cache, &id, 1, x.data(), y.data()); }, "decode: the key projection");
    EXPECT_EQ(cache.length(id), 2) << to_string(dtype);
    EXPECT_EQ(cache.impl().audit(), "");
  }
  // With check_finite off the caller has taken NaN and Inf inputs on themselves: no scan, no error.
  RunOptions unchecked;
  unchecked.check_finite = false;
  EXPECT_NO_THROW(block.forward(x.data(), 1, 4, y.data(), unchecked));
}

GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheStorage);

// A pool of a fixed byte size: bf16 blocks are half the bytes, so it holds twice the tokens; int8 blocks are a
// quarter plus a scale per row (at gpt2-small, D = 64: 68 bytes a row against 256), so about 3.76x. Other dtypes
// are refused.
TEST(KvCacheStoragePool, FixedBytesHoldMoreTokens) {
  const Config c = preset("gpt2-small");
  KvCacheOptions f32;
  f32.capacity_bytes = size_t{64} << 20;
  KvCacheOptions bf = f32, i8 = f32;
  bf.dtype = DType::bf16;
  i8.dtype = DType::i8;
  const KvCache a(c, f32), b(c, bf), q(c, i8);
  EXPECT_EQ(b.block_bytes() * 2, a.block_bytes());
  EXPECT_GE(b.total_blocks(), 2 * a.total_blocks());  // 341 against 170: whole blocks, rounded down
  EXPECT_EQ(b.total_blocks(), static_cast<int64_t>(bf.capacity_bytes / b.block_bytes()));
  EXPECT_EQ(a.block_bytes(), size_t{2 * 12 * 64 * 64 * 4});
  EXPECT_EQ(q.block_bytes(), size_t{2 * 12 * 64 * 64 + 2 * 12 * 64 * 4});
  EXPECT_GE(q.total_blocks() * 100, 375 * a.total_blocks());  // 642 against 170
  EXPECT_EQ(q.capacity_bytes(), static_cast<size_t>(q.total_blocks()) * q.block_bytes());
  for (DType bad : {DType::u8, DType::f16}) {
    KvCacheOptions o = f32;
    o.dtype = bad;
    try {
      KvCache cache(c, o);
      ADD_FAILURE() << to_string(bad) << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("KvCacheOptions.dtype"), std::string::npos) << e.what();
    }
  }
}

// Round to nearest, ties to even, on the bit patterns; inf and NaN kept; overflow to inf.
TEST(KvCacheStoragePool, Bf16RoundsToNearestEven) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  auto from = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  EXPECT_EQ(kernels::to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(kernels::to_bf16(from(0x3f808000u)).bits, 0x3f80);  // tie, even below: stays
  EXPECT_EQ(kernels::to_bf16(from(0x3f818000u)).bits, 0x3f82);  // tie, odd below: up to even
  EXPECT_EQ(kernels::to_bf16(from(0x3f808001u)).bits, 0x3f81);  // above the tie: up
  EXPECT_EQ(kernels::to_bf16(from(0x3f807fffu)).bits, 0x3f80);  // below the tie: down
  EXPECT_EQ(kernels::to_bf16(-2.5f).bits, 0xc020);
  EXPECT_EQ(kernels::to_bf16(INFINITY).bits, 0x7f80);
  EXPECT_EQ(kernels::to_bf16(from(0x7f7fffffu)).bits, 0x7f80);  // FLT_MAX rounds to inf
  EXPECT_TRUE(std::isnan(kernels::widen(kernels::to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(kernels::widen(kernels::to_bf16(from(0x7f800001u)))));  // a NaN whose payload is low bits
  EXPECT_EQ(bits(kernels::widen(kernels::bf16{0xc020})), 0xc0200000u);
}

// The int8 codec: the row's largest magnitude maps to +-127 exactly; every value within half a step; zeros, inf and
// NaN rows; rows of any length, with scales of rows of odd sizes still 4-byte aligned inside a block.
TEST(KvCacheStoragePool, Int8QuantisesPerRow) {
  for (int64_t D : {1, 3, 7, 64, 129}) {
    const kernels::KvLayout layout{DType::i8, 3, 5, D};
    ASSERT_EQ(layout.block_bytes() % 4, 0) << "D=" << D;
    std::vector<std::byte> block(static_cast<size_t>(layout.block_bytes()));
    std::mt19937_64 rng(static_cast<uint64_t>(D));
    std::vector<float> row = random_uniform(static_cast<size_t>(D), rng, -3.0f, 3.0f), back(row.size());
    row[static_cast<size_t>(D / 2)] = -4.0f;  // the row's largest magnitude
    kernels::store_kv_row(layout, block.data(), kernels::KvPart::value, 2, 4, row.data());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(layout.scales(block.data(), kernels::KvPart::value, 2, 4)) % 4, 0u);
    EXPECT_EQ(*layout.scales(block.data(), kernels::KvPart::value, 2, 4), 4.0f / 127.0f);
    EXPECT_EQ(layout.row<int8_t>(block.data(), kernels::KvPart::value, 2, 4)[D / 2], -127);
    kernels::load_kv_row(layout, block.data(), kernels::KvPart::value, 2, 4, back.data());
    for (int64_t d = 0; d < D; ++d) EXPECT_LE(std::fabs(back[d] - row[d]), 4.0 / 254.0 * (1 + 1e-6)) << d;
  }
  auto round_trip = [](const std::vector<float>& row) { return restored(row, DType::i8); };
  EXPECT_EQ(round_trip({0, 0, 0, 0}), std::vector<float>(4, 0.0f));  // scale 0, no division by zero
  // A row below 127 / FLT_MAX: 127 / amax overflowed float, so zeros became 0 * inf = NaN (cast to int8: undefined)
  // and every other value +-127.
  const std::vector<float> tiny = {1e-38f, 0.0f, 1e-40f, -2e-38f};
  const std::vector<float> tiny_back = round_trip(tiny);
  for (size_t d = 0; d < tiny.size(); ++d) {
    EXPECT_LE(std::fabs(tiny_back[d] - tiny[d]), 2e-38 / 254.0 * 1.01) << d << ": " << tiny_back[d];
  }
  EXPECT_EQ(tiny_back[1], 0.0f);
  for (float bad : {NAN, INFINITY, -INFINITY}) {  // a bad value turns the row into NaN, never into numbers
    for (float e : round_trip({1.0f, bad, 2.0f, 3.0f})) EXPECT_TRUE(std::isnan(e)) << bad;
  }
}

// The fp8 codec: a power-of-two scale per row puts the row's largest magnitude in e4m3's top binade, so every value
// of rows of any size, from denormal to FLT_MAX (whose rows take amax / 1.75), comes back within one e4m3 rounding
// (2^-4 of itself, or a subnormal step of the row's scale below 2^-14 of its largest value); a stored row is a fixed
// point; zeros, inf and NaN rows as int8's; scales of rows of odd sizes 4-byte aligned inside a block.
TEST(KvCacheStoragePool, Fp8ScalesEachRowByAPowerOfTwo) {
  for (int64_t D : {1, 3, 7, 64, 129}) {
    const kernels::KvLayout layout{DType::fp8, 3, 5, D};
    ASSERT_EQ(layout.block_bytes() % 4, 0) << "D=" << D;
    std::vector<std::byte> block(static_cast<size_t>(layout.block_bytes()));
    std::mt19937_64 rng(static_cast<uint64_t>(D) + 7);
    for (float amax : {1e-40f, 3e-30f, 1.0f, 448.0f, 449.0f, 7e5f, 2e30f, 3.0e38f, FLT_MAX}) {
      std::vector<float> row = random_uniform(static_cast<size_t>(D), rng, -1.0f, 1.0f), back(row.size());
      for (float& x : row) x *= amax;
      row[static_cast<size_t>(D / 2)] = -amax;
      kernels::store_kv_row(layout, block.data(), kernels::KvPart::value, 2, 4, row.data());
      const float* scale = layout.scales(block.data(), kernels::KvPart::value, 2, 4);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(scale) % 4, 0u);
      int e = 0;
      const bool power_of_two = amax <= 1.75f * 0x1p127f;  // past it, amax / 1.75
      if (power_of_two) {
        EXPECT_EQ(std::frexp(*scale, &e), 0.5f) << "not a power of two: " << *scale;
      }
      const double top = amax / (*scale * 0x1p-8);  // the largest magnitude in e4m3 units
      EXPECT_TRUE(top > 224.0 && top <= 448.0 * (1 + 0x1p-23)) << amax << ": " << top;
      kernels::load_kv_row(layout, block.data(), kernels::KvPart::value, 2, 4, back.data());
      // Half a subnormal step (2^-10 e4m3 units), or of f32's own where a denormal row's value reads back as one.
      const double floor = std::max(*scale * 0x1p-18, 0x1p-150);
      for (int64_t d = 0; d < D; ++d) {
        const double err = std::fabs(double{back[d]} - row[d]);
        EXPECT_LE(err, 0x1p-4 * (1 + 0x1p-22) * std::fabs(row[d]) + floor) << "amax " << amax << " d " << d;
        EXPECT_TRUE(std::isfinite(back[d])) << "amax " << amax << " d " << d;
      }
      EXPECT_EQ(back, restored(back, DType::fp8)) << "amax " << amax;
    }
  }
  auto round_trip = [](const std::vector<float>& row) { return restored(row, DType::fp8); };
  EXPECT_EQ(round_trip({0, 0, 0, 0}), std::vector<float>(4, 0.0f));
  EXPECT_EQ(round_trip({1.0f, -0.5f, 448.0f, 3.0f}), (std::vector<float>{1.0f, -0.5f, 448.0f, 3.0f}));  // e4m3 values
  // FLT_MAX itself is held (its row's scale is amax / 1.75), finite, never inf.
  const std::vector<float> top = round_trip({FLT_MAX, 1.0f, 0.0f, -FLT_MAX});
  EXPECT_TRUE(std::isfinite(top[0]) && std::isfinite(top[3])) << top[0] << " " << top[3];
  EXPECT_GE(top[0], FLT_MAX * (1.0f - 0x1p-20f));
  EXPECT_EQ(top[3], -top[0]);
  for (float bad : {NAN, INFINITY, -INFINITY}) {  // a bad value turns the row into NaN, never into numbers
    for (float e : round_trip({1.0f, bad, 2.0f, 3.0f})) EXPECT_TRUE(std::isnan(e)) << bad;
  }
}

}  // namespace
}  // namespace gpt2attn
