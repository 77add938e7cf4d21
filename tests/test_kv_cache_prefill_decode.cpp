// tests/test_kv_cache_prefill_decode.cpp: the serving calls (CausalSelfAttention::extend / decode) on a paged KV
// cache against reference_forward over each sequence's whole history, on every instruction set this CPU runs:
// prefill + decode equals one prefill (preset widths, random shapes), chunked prefill, extend vs forward, batched
// decode of different lengths, split-KV over a long context, one-token prefills. One sequence's numerics per
// case; many sequences sharing a pool are test_kv_cache_script_fork.cpp's. Suite prefix "KvCache", as in all
// test_kv_cache_*.cpp files, so --gtest_filter='KvCache*' selects them together.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/attn_case.hpp"
#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::AttnCase;
using test::Dtype;
using test::Harness;
using test::IsaTest;
using test::kNaN;
using test::kv_matches_projection;
using test::label;
using test::make_block;
using test::serving_config;
using test::pool;
using test::random_uniform;
using test::reduction_length;
using test::reference_sequence;
using test::Rng;
using test::rows;

// =============================================================================================================
// 1. Prefill of T tokens then n decode steps equals the reference over the whole T + n tokens.

class KvCachePrefillDecode : public IsaTest {};

// Prefill T, decode `steps` one token at a time; every row checked against the reference over the T + steps
// tokens (computed once per case and shared by the ISAs: `ref_cache`).
void prefill_then_decode(Isa isa, const Config& c, uint64_t seed, int64_t T, int64_t steps, int64_t block_tokens,
                         int threads, const std::string& what, std::map<std::string, std::vector<double>>& ref_cache,
                         bool check_kv = true) {
  const Weights w = Weights::random(c, seed);
  CausalSelfAttention block = make_block(c, w, isa, threads);
  const Config& cc = block.config();
  const int64_t N = T + steps, W = cc.query_width(), E = cc.d_model;
  std::mt19937_64 rng(seed + 17);
  const std::vector<float> x = random_uniform(static_cast<size_t>(N * W), rng, -2.0f, 2.0f);
  std::vector<double>& ref = ref_cache[what];
  if (ref.empty()) ref = reference_sequence(cc, w, x);
  KvCache cache(cc, pool(block_tokens, N + block_tokens));
  const SequenceId id = cache.create();
  Workspace ws;
  const RunOptions run{.threads = threads};
  const std::string ctx = label(isa, threads, what) + " | " + test::describe(cc) +
                          " block_tokens=" + std::to_string(block_tokens) + " T=" + std::to_string(T) +
                          " steps=" + std::to_string(steps);

  std::vector<float> out(static_cast<size_t>(T * E), kNaN);
  block.extend(cache, id, x.data(), T, out.data(), run, &ws);
  EXPECT_EQ(cache.length(id), T) << ctx;
  EXPECT_TRUE(all_close(out, rows(ref, E, 0, T), Dtype::f32, reduction_length(cc, N),
                        ctx + " | prefill rows; index = t * E + e"));
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> o(static_cast<size_t>(E), kNaN);
    block.decode(cache, &id, 1, x.data() + (T + s) * W, o.data(), run, s % 2 ? &ws : nullptr);
    EXPECT_TRUE(all_close(o, rows(ref, E, T + s, 1), Dtype::f32, reduction_length(cc, N),
                          ctx + " | decode step " + std::to_string(s) + " (token " + std::to_string(T + s) +
                              "); index = e"));
  }
  EXPECT_EQ(cache.length(id), N) << ctx;
  if (check_kv) {
    EXPECT_TRUE(kv_matches_projection(cache, id, cc, w, x, ctx));
  }
}

TEST_P(KvCachePrefillDecode, EveryPresetWidth) {
  static std::map<std::string, std::vector<double>> refs;  // shared by the ISAs: the reference dominates
  int64_t i = 0;
  int tested = 0;
  for (const std::string& name : preset_names()) {
    const Config c = preset(name);
    if (c.d_model > 2048) continue;  // gpt3-2.7b and up: too slow for the double reference in a unit test
    const int64_t T = 3 + (i * 2) % 7;  // 3, 5, 7, 9, 4, 6, 8, ...
    const int64_t block_tokens = i % 2 ? 4 : 64;
    prefill_then_decode(isa(), c, 40 + i, T, 2, block_tokens, 2, "preset " + name, refs, /*check_kv=*/false);
    ++i;
    ++tested;
  }
  EXPECT_GE(tested, 8) << "expected gpt2-small..xl and gpt3-small..xl";
}

// One sequence: a prefill of axes.T tokens, then `steps` single-token decodes, so the last decode sees
// Tk = T + steps keys (B = 1, self, causal, no mask or padding: what extend and decode take).
struct ShapeCase {
  AttnCase axes;
  Config cfg;
  int64_t steps = 0, block_tokens = 0;
  std::string desc;  // "shape case i: " + axes.name()
};

// Case i: T, D and block_tokens cycle through their lists with coprime periods (9, 8, 5), so 32 cases reach
// every value of each; heads, d_in, biases, decode steps and context slack are drawn from the case's seed.
ShapeCase make_shape_case(int index) {
  constexpr int64_t kT[] = {1, 2, 7, 33, 63, 64, 65, 113, 130};
  constexpr int64_t kD[] = {1, 3, 4, 16, 33, 64, 80, 128};
  constexpr int64_t kBlock[] = {1, 3, 16, 64, 128};
  ShapeCase k;
  AttnCase& a = k.axes;
  a.causal = true;
  a.seed = 0xcace0000ull + static_cast<uint64_t>(index);
  Rng r(a.seed);
  a.T = kT[index % 9];
  a.D = kD[index % 8];
  k.block_tokens = kBlock[index % 5];
  // E <= 512: cheap reference
  a.H = r.between(1, std::min<int64_t>(16, std::max<int64_t>(1, 512 / a.D)));
  a.H_kv = test::kv_heads_for(a.H, index);
  k.steps = r.between(1, 3);
  a.Tk = a.T + k.steps;
  a.threads = 1 + index % 2;
  const int64_t d_in = r.chance(0.75) ? r.between(3, 96) : 0;
  const int64_t slack = r.chance(0.3) ? 0 : r.between(1, 200);  // 0: the last decode reaches context_length
  // The pool refuses blocks longer than the context (KvCache: block_tokens <= context_length).
  const int64_t context = std::max(a.T + k.steps + slack, k.block_tokens);
  k.cfg = serving_config(a.E(), a.H, d_in, context, r.chance(0.7), r.chance(0.7));
  k.cfg.num_kv_heads = a.H_kv;
  k.desc = "shape case " + std::to_string(index) + ": " + a.name();
  return k;
}

TEST_P(KvCachePrefillDecode, RandomShapes) {
  static std::map<std::string, std::vector<double>> refs;
  constexpr int kCases = 32;
  int d_in_differs = 0, no_bias = 0, at_context = 0, threads2 = 0, grouped = 0;
  std::set<int64_t> heads;
  for (int i = 0; i < kCases; ++i) {
    const ShapeCase k = make_shape_case(i);
    const AttnCase& a = k.axes;
    prefill_then_decode(isa(), k.cfg, a.seed, a.T, k.steps, k.block_tokens, a.threads, k.desc, refs);
    if (HasFailure()) {
      ADD_FAILURE() << "stopping the random shapes at the first failing case";
      return;
    }
    d_in_differs += k.cfg.query_width() != k.cfg.d_model;
    no_bias += !k.cfg.qkv_bias || !k.cfg.out_bias;
    at_context += a.Tk == k.cfg.context_length;
    threads2 += a.threads == 2;
    heads.insert(k.cfg.num_heads);
    grouped += a.H_kv < a.H;
  }
  EXPECT_GE(d_in_differs, kCases / 2);
  EXPECT_GE(no_bias, 4);
  EXPECT_GE(at_context, 3);
  EXPECT_GE(threads2, kCases / 2);
  EXPECT_GE(heads.size(), 6u);
  EXPECT_GE(grouped, 4) << "grouped or multi-query K/V heads";
}

// bf16 compute serving a cache of each K/V dtype: a prefill in two extend() chunks, then decode steps, against the
// reference over the plain f32 inputs and weights at gpt2attn/tolerance.hpp's layer_tolerance (bf16's own
// roundings, the inputs' and weights', and an int8 cache's storage).
void bf16_serving_matches_reference(Isa isa, const Config& c, uint64_t seed, int64_t T, int64_t steps,
                                    int64_t block_tokens, int threads, const std::string& what,
                                    std::map<std::string, std::vector<double>>& ref_cache) {
  const Weights w = Weights::random(c, seed);
  CausalSelfAttention block = make_block(c, w, isa, threads, DType::bf16);
  const Config& cc = block.config();
  const int64_t N = T + steps, W = cc.query_width(), E = cc.d_model, D = cc.head_dim();
  std::mt19937_64 rng(seed + 17);
  const std::vector<float> x = random_uniform(static_cast<size_t>(N * W), rng, -2.0f, 2.0f);
  std::vector<double>& ref = ref_cache[what];
  if (ref.empty()) ref = reference_sequence(cc, w, x);
  const RunOptions run{.threads = threads};
  for (DType kv : test::kv_formats()) {
    KvCacheOptions opts = pool(block_tokens, N + block_tokens);
    opts.dtype = kv;
    KvCache cache(cc, opts);
    const SequenceId id = cache.create();
    const std::string ctx = label(isa, threads, what) + " | bf16 compute, " + to_string(kv) + " cache | " +
                            test::describe(cc) + " block_tokens=" + std::to_string(block_tokens);
    std::vector<float> got(static_cast<size_t>(N * E), kNaN);
    const int64_t first = T / 2;  // two chunks (the first empty when T = 1)
    if (first > 0) block.extend(cache, id, x.data(), first, got.data(), run);
    block.extend(cache, id, x.data() + first * W, T - first, got.data() + first * E, run);
    for (int64_t s = 0; s < steps; ++s) {
      block.decode(cache, &id, 1, x.data() + (T + s) * W, got.data() + (T + s) * E, run);
    }
    const int64_t K = reduction_length(cc, N);
    EXPECT_TRUE(test::all_close_within(
        got, ref, [&](double m) { return layer_tolerance(DType::bf16, kv, D, K, m); },
        ctx + " | prefill in 2 chunks then " + std::to_string(steps) + " decode steps; index = t * E + e"));
  }
}

// The random shapes above.
TEST_P(KvCachePrefillDecode, Bf16ComputeEveryCacheDtype) {
  static std::map<std::string, std::vector<double>> refs;
  constexpr int kCases = 16;
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const ShapeCase k = make_shape_case(i);
    bf16_serving_matches_reference(isa(), k.cfg, k.axes.seed, k.axes.T, k.steps, k.block_tokens, k.axes.threads,
                                   k.desc, refs);
  }
}

// One head and a 1030-token prefill: the decode steps' keys are split across the 2 threads (split-KV) and merged.
TEST_P(KvCachePrefillDecode, Bf16ComputeLongContextSplitKv) {
  static std::map<std::string, std::vector<double>> refs;
  const Config c = serving_config(64, 1, 48, 1040, true, true);
  bf16_serving_matches_reference(isa(), c, 95, 1030, 2, 64, 2, "bf16 H=1 T=1030", refs);
}

// One prefill through extend() and CausalSelfAttention::forward on the same tokens agree (and both match the
// reference).
TEST_P(KvCachePrefillDecode, ExtendOfEmptySequenceEqualsForward) {
  const Config c = serving_config(96, 3, 40, 256);
  const Weights w = Weights::random(c, 70);
  CausalSelfAttention block = make_block(c, w, isa(), 2);
  KvCache cache(block.config(), pool(16, 512));
  for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{130}}) {
    std::mt19937_64 rng(71 + T);
    const std::vector<float> x = random_uniform(static_cast<size_t>(T * 40), rng, -2.0f, 2.0f);
    std::vector<float> fwd(static_cast<size_t>(T * 96), kNaN), ext(static_cast<size_t>(T * 96), kNaN);
    block.forward(x.data(), 1, T, fwd.data());
    const SequenceId id = cache.create();
    block.extend(cache, id, x.data(), T, ext.data());
    const std::string ctx = label(isa(), 2, "T=" + std::to_string(T)) + " | " + test::describe(block.config());
    const std::vector<double> ref = reference_sequence(block.config(), w, x);
    EXPECT_TRUE(all_close(ext, ref, Dtype::f32, reduction_length(c, T), ctx + " | extend vs reference; index t*E+e"));
    EXPECT_TRUE(all_close(fwd, ref, Dtype::f32, reduction_length(c, T), ctx + " | forward vs reference"));
    EXPECT_TRUE(all_close(ext, std::vector<double>(fwd.begin(), fwd.end()), Dtype::f32, reduction_length(c, T),
                          ctx + " | extend (got) vs forward (expected); index t*E+e"));
    cache.release(id);
  }
}

// The same sequence fed as chunks (sizes 1, chunks straddling block boundaries, one token at a time, random)
// equals one prefill, and decoding after a chunked prefill still matches the reference.
TEST_P(KvCachePrefillDecode, ChunkedPrefillEqualsOnePrefill) {
  struct Setup {
    Config c;
    int64_t L, bt;
    int threads;
  };
  const Setup setups[] = {
      {serving_config(96, 3, 50, 256), 100, 16, 2},
      {serving_config(66, 2, 0, 64, false, false), 40, 3, 1},
      {serving_config(64, 1, 24, 256), 130, 64, 2},
  };
  uint64_t seed = 80;
  for (const Setup& s : setups) {
    const int64_t steps = 2, N = s.L + steps, bt = s.bt;
    const Weights w = Weights::random(s.c, ++seed);
    CausalSelfAttention block = make_block(s.c, w, isa(), s.threads);
    const Config& cc = block.config();
    const int64_t W = cc.query_width(), E = cc.d_model;
    std::mt19937_64 rng(seed * 7);
    const std::vector<float> x = random_uniform(static_cast<size_t>(N * W), rng, -2.0f, 2.0f);
    const std::vector<double> ref = reference_sequence(cc, w, x);
    KvCache cache(cc, pool(bt, N + bt));  // room for one sequence: each plan reuses the previous one's blocks

    std::vector<std::vector<int64_t>> plans;
    plans.push_back({s.L});
    plans.push_back({1, 1, 1, s.L - 3});
    std::vector<int64_t> straddle{bt - 1, 2};  // the second chunk crosses the first block boundary
    for (int64_t done = bt + 1; done < s.L;) {
      const int64_t n = std::min(bt + 2, s.L - done);  // every chunk crosses a boundary
      straddle.push_back(n);
      done += n;
    }
    plans.push_back(straddle);
    if (s.L <= 40) plans.push_back(std::vector<int64_t>(static_cast<size_t>(s.L), 1));
    std::vector<int64_t> random_plan;
    for (int64_t done = 0; done < s.L;) {
      const int64_t n = std::min<int64_t>(std::uniform_int_distribution<int64_t>(1, 2 * bt + 1)(rng), s.L - done);
      random_plan.push_back(n);
      done += n;
    }
    plans.push_back(random_plan);

    std::vector<float> one_prefill;
    for (size_t p = 0; p < plans.size(); ++p) {
      std::ostringstream d;
      d << test::describe(cc) << " block_tokens=" << bt << " plan " << p << " chunks {";
      for (int64_t n : plans[p]) d << n << " ";
      d << "}";
      const std::string ctx = label(isa(), s.threads, d.str());
      const SequenceId id = cache.create();
      std::vector<float> got;
      int64_t done = 0;
      Workspace ws;
      for (int64_t n : plans[p]) {
        std::vector<float> out(static_cast<size_t>(n * E), kNaN);
        block.extend(cache, id, x.data() + done * W, n, out.data(), RunOptions{.threads = s.threads}, &ws);
        got.insert(got.end(), out.begin(), out.end());
        done += n;
        ASSERT_EQ(cache.length(id), done) << ctx;
      }
      ASSERT_EQ(done, s.L) << ctx;
      EXPECT_TRUE(all_close(got, rows(ref, E, 0, s.L), Dtype::f32, reduction_length(cc, N),
                            ctx + " | prefill rows vs reference; index t*E+e"));
      if (p == 0) {
        one_prefill = got;
      } else {
        EXPECT_TRUE(all_close(got, std::vector<double>(one_prefill.begin(), one_prefill.end()), Dtype::f32,
                              reduction_length(cc, N), ctx + " | chunked (got) vs one prefill (expected); index t*E+e"));
      }
      for (int64_t k = 0; k < steps; ++k) {
        std::vector<float> o(static_cast<size_t>(E), kNaN);
        block.decode(cache, &id, 1, x.data() + (s.L + k) * W, o.data(), RunOptions{.threads = s.threads}, &ws);
        EXPECT_TRUE(all_close(o, rows(ref, E, s.L + k, 1), Dtype::f32, reduction_length(cc, N),
                              ctx + " | decode after chunked prefill, token " + std::to_string(s.L + k)));
      }
      EXPECT_TRUE(kv_matches_projection(cache, id, cc, w, x, ctx));
      cache.release(id);
      EXPECT_EQ(cache.free_blocks(), cache.total_blocks()) << ctx;
    }
  }
}
GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCachePrefillDecode);

// =============================================================================================================
// 2. Decode batches: different lengths in one call; long contexts with few heads (split-KV); T = 1.

class KvCacheDecode : public IsaTest {};

TEST_P(KvCacheDecode, BatchOfDifferentLengthsEqualsEachAlone) {
  const Config c = serving_config(64, 4, 48, 256);
  // 19 sequences: the decode projections' row blocks (8 rows on AVX-512, 6 on AVX2, 4 scalar) full and ragged.
  const int64_t lens[] = {1, 3, 16, 17, 64, 65, 130, 2, 5, 9, 33, 40, 70, 90, 100, 110, 120, 7, 11};
  const int64_t B = std::size(lens), steps = 3, W = 48, E = 64;
  for (int threads : {1, 2}) {
    // Two harnesses with the same weights and seeds: one decodes the batch, the other each sequence alone.
    Harness batched(c, isa(), 16, 2048, 90, threads), alone(c, isa(), 16, 2048, 90, threads);
    std::vector<SequenceId> ib, ia;
    std::mt19937_64 rng(91);
    for (int64_t L : lens) {
      const std::vector<float> x = random_uniform(static_cast<size_t>(L * W), rng, -2.0f, 2.0f);
      ib.push_back(batched.create());
      batched.extend_with(ib.back(), x);
      ia.push_back(alone.create());
      alone.extend_with(ia.back(), x);
    }
    // The batch in a shuffled order, so a slot is not its sequence id's position.
    std::vector<int64_t> order(B);
    for (int64_t b = 0; b < B; ++b) order[b] = (b * 3 + 2) % B;
    for (int64_t s = 0; s < steps; ++s) {
      const std::vector<float> x = random_uniform(static_cast<size_t>(B * W), rng, -2.0f, 2.0f);
      std::vector<SequenceId> ids;
      for (int64_t b = 0; b < B; ++b) ids.push_back(ib[order[b]]);
      const std::vector<float> got = batched.decode_with(ids, x);
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<float> xb(x.begin() + b * W, x.begin() + (b + 1) * W);
        const std::vector<float> want = alone.decode_with({ia[order[b]]}, xb);
        const std::vector<float> gb(got.begin() + b * E, got.begin() + (b + 1) * E);
        EXPECT_TRUE(all_close(gb, std::vector<double>(want.begin(), want.end()), Dtype::f32,
                              reduction_length(c, 130 + steps),
                              batched.ctx("step " + std::to_string(s) + " batch slot " + std::to_string(b) +
                                          " (length " + std::to_string(lens[order[b]] + s) +
                                          "): batched (got) vs alone (expected); index e")));
      }
    }
    for (SequenceId id : ib) EXPECT_TRUE(batched.matches_reference(id, "batched decode"));
    for (SequenceId id : ia) EXPECT_TRUE(alone.matches_reference(id, "decode alone"));
    EXPECT_TRUE(batched.accounting("after batched decode"));
  }
}

// H = 1 and a 1030-token context: few (sequence, head) items for 2 threads, so the keys are split across
// threads and the partial softmax states merged. threads=1 and threads=2 must agree, both with the reference.
TEST_P(KvCacheDecode, LongContextFewHeadsSplitKv) {
  for (int64_t H : {int64_t{1}, int64_t{2}}) {
    const Config c = serving_config(32 * H, H, 0, 1100);
    const int64_t T = 1030, T2 = 700, steps = 3;
    Harness one(c, isa(), 64, 2 * 1100, 100 + H, 1), two(c, isa(), 64, 2 * 1100, 100 + H, 2);
    std::mt19937_64 rng(110 + H);
    const std::vector<float> x = random_uniform(static_cast<size_t>(T * c.d_model), rng, -2.0f, 2.0f);
    const std::vector<float> x2 = random_uniform(static_cast<size_t>(T2 * c.d_model), rng, -2.0f, 2.0f);
    SequenceId ids1[2], ids2[2];
    for (int s = 0; s < 2; ++s) {
      ids1[s] = one.create();
      one.extend_with(ids1[s], s == 0 ? x : x2);
      ids2[s] = two.create();
      two.extend_with(ids2[s], s == 0 ? x : x2);
    }
    for (int64_t s = 0; s < steps; ++s) {
      const std::vector<float> xs = random_uniform(static_cast<size_t>(2 * c.d_model), rng, -2.0f, 2.0f);
      const std::vector<float> xs0(xs.begin(), xs.begin() + c.d_model);
      // B = 1 (the longest context alone) on even steps, B = 2 on odd ones.
      if (s % 2 == 0) {
        const std::vector<float> a = one.decode_with({ids1[0]}, xs0);
        const std::vector<float> b = two.decode_with({ids2[0]}, xs0);
        EXPECT_TRUE(all_close(b, std::vector<double>(a.begin(), a.end()), Dtype::f32, reduction_length(c, T + steps),
                              two.ctx("B=1 T=" + std::to_string(T + s) + ": threads=2 (got) vs threads=1; index e")));
        // keep the second sequence's history in step
        one.decode_with({ids1[1]}, std::vector<float>(xs.begin() + c.d_model, xs.end()));
        two.decode_with({ids2[1]}, std::vector<float>(xs.begin() + c.d_model, xs.end()));
      } else {
        const std::vector<float> a = one.decode_with({ids1[0], ids1[1]}, xs);
        const std::vector<float> b = two.decode_with({ids2[0], ids2[1]}, xs);
        EXPECT_TRUE(all_close(b, std::vector<double>(a.begin(), a.end()), Dtype::f32, reduction_length(c, T + steps),
                              two.ctx("B=2: threads=2 (got) vs threads=1; index b*E+e")));
      }
    }
    // `one` is the comparison above; the reference (the slow part) checks the split run.
    for (SequenceId id : ids2) EXPECT_TRUE(two.matches_reference(id, "long context H=" + std::to_string(H)));
  }
}

// One-token prefills, then decoding; block_tokens 1 (every token a new block) and 64.
TEST_P(KvCacheDecode, SingleTokenPrefill) {
  for (int64_t bt : {int64_t{1}, int64_t{64}}) {
    Harness h(serving_config(48, 3, 20, 64), isa(), bt, 256, 120 + bt, 2);
    const SequenceId a = h.create(), b = h.create();
    h.extend(a, 1);
    h.extend(b, 1);
    EXPECT_TRUE(h.accounting("after one-token prefills"));
    for (int s = 0; s < 4; ++s) h.decode({b, a});
    h.decode({a});
    EXPECT_TRUE(h.accounting("after decoding"));
    EXPECT_TRUE(h.matches_reference(a, "T=1 prefill + 5 decodes"));
    EXPECT_TRUE(h.matches_reference(b, "T=1 prefill + 4 decodes"));
    EXPECT_TRUE(h.kv_ok(a, "T=1 prefill"));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheDecode);

}  // namespace
}  // namespace gpt2attn
