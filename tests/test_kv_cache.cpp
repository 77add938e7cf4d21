// tests/test_kv_cache.cpp: the paged KV cache and the serving calls (CausalSelfAttention::extend / decode) against
// reference_forward over each sequence's whole history, on every instruction set this CPU runs: prefill + decode
// equals one prefill (preset widths, random shapes), chunked prefill, batched decode, split-KV over a long
// context, a random create/extend/decode/fork/release script checked against a model of block accounting,
// copy on write, every error's atomicity, and concurrent callers (suite KvCacheConcurrency, also run under TSan).
// The steady-state allocation check lives in tests/alloc/no_alloc_test.cpp (it replaces malloc for its process).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/kv_cache.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::Rng;
using test::Dtype;
using test::random_uniform;
using test::reduction_length;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSentinel = -12345.5f;

// Every suite is parameterised over the forced instruction set, like tests/test_fastpath.cpp.
class KvCacheTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU lacks " << to_string(GetParam());
  }
  Isa isa() const { return GetParam(); }
};

std::string isa_name(const ::testing::TestParamInfo<Isa>& info) { return to_string(info.param); }

// The prefix is "KvCache" so that --gtest_filter='KvCache*' selects every test of this file.
#define GPT2ATTN_KV_INSTANTIATE_ISAS(Suite) \
  INSTANTIATE_TEST_SUITE_P(KvCache, Suite, ::testing::Values(Isa::avx512, Isa::avx2, Isa::scalar), isa_name)

Config make_config(int64_t E, int64_t H, int64_t d_in = 0, int64_t context = 1024, bool qkv_bias = true,
                   bool out_bias = true) {
  Config c;
  c.d_model = E;
  c.num_heads = H;
  c.d_in = d_in;
  c.context_length = context;
  c.qkv_bias = qkv_bias;
  c.out_bias = out_bias;
  c.causal = true;
  return c;
}

CausalSelfAttention make_block(const Config& c, const Weights& w, Isa isa, int threads) {
  CausalSelfAttention b(c, w, EngineOptions{.threads = threads, .isa = isa});
  EXPECT_EQ(b.layer().isa(), isa) << "forced " << to_string(isa) << ", engine chose " << to_string(b.layer().isa());
  EXPECT_TRUE(b.config().causal) << "CausalSelfAttention must turn causal on";
  return b;
}

KvCacheOptions pool(int64_t block_tokens, int64_t capacity_tokens) {
  KvCacheOptions o;
  o.block_tokens = block_tokens;
  o.capacity_tokens = capacity_tokens;
  return o;
}

// The naive reference over one sequence's whole history x (N, d_in): (N, E) in double, causal.
std::vector<double> reference_sequence(const Config& causal, const Weights& w, const std::vector<float>& x) {
  const int64_t N = static_cast<int64_t>(x.size()) / causal.query_width();
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, N, causal.query_width()});
  return reference_forward(causal, w, in);
}

std::string label(Isa isa, int threads, const std::string& what) {
  std::ostringstream s;
  s << "[isa=" << to_string(isa) << " threads=" << threads << "] " << what;
  return s.str();
}

// Rows [first, first + n) of a (N, E) reference; compared with all_close the flat index is (row - first) * E + e.
std::vector<double> rows(const std::vector<double>& ref, int64_t E, int64_t first, int64_t n) {
  return std::vector<double>(ref.begin() + first * E, ref.begin() + (first + n) * E);
}

// =============================================================================================================
// Block accounting model: what free_blocks() and blocks_needed() must say. A sequence holds a table of blocks;
// a fork shares all of them (reference counted); an append into a shared, partially filled last block copies it
// first (copy on write); a block returns to the pool when its last holder releases it.

struct BlockModel {
  int64_t bt = 0, total = 0;
  int64_t next_block = 0;
  int64_t allocated_ever = 0;  // blocks taken from the pool over the model's life (reuse shows as > total)
  std::map<int64_t, int> refs;  // live block -> holders
  std::map<SequenceId, std::vector<int64_t>> tables;
  std::map<SequenceId, int64_t> len;

  int64_t free() const { return total - static_cast<int64_t>(refs.size()); }
  static int64_t blocks_for(int64_t tokens, int64_t bt) { return (tokens + bt - 1) / bt; }
  bool cow(SequenceId s) const {
    const int64_t l = len.at(s);
    return l % bt != 0 && refs.at(tables.at(s).back()) > 1;
  }
  int64_t needed(SequenceId s, int64_t n) const {
    const int64_t l = len.at(s);
    return (cow(s) ? 1 : 0) + blocks_for(l + n, bt) - blocks_for(l, bt);
  }
  int64_t take() {
    ++allocated_ever;
    refs[next_block] = 1;
    return next_block++;
  }
  void drop(int64_t b) {
    if (--refs[b] == 0) refs.erase(b);
  }
  void create(SequenceId s) {
    tables[s] = {};
    len[s] = 0;
  }
  void append(SequenceId s, int64_t n) {
    std::vector<int64_t>& t = tables[s];
    if (cow(s)) {
      drop(t.back());
      t.back() = take();
    }
    const int64_t add = blocks_for(len[s] + n, bt) - blocks_for(len[s], bt);
    for (int64_t i = 0; i < add; ++i) t.push_back(take());
    len[s] += n;
  }
  void fork(SequenceId parent, SequenceId child) {
    tables[child] = tables[parent];
    len[child] = len[parent];
    for (int64_t b : tables[child]) ++refs[b];
  }
  void release(SequenceId s) {
    for (int64_t b : tables[s]) drop(b);
    tables.erase(s);
    len.erase(s);
  }
};

// One sequence's history: every token fed (fork prefix included) and the layer's output for each.
struct SeqTrack {
  std::vector<float> x;    // (len, d_in)
  std::vector<float> out;  // (len, E)
};

// A snapshot of everything a failed call must leave alone: each sequence's length and cached K/V, bit for bit.
struct CacheSnapshot {
  std::map<SequenceId, int64_t> len;
  std::map<SequenceId, std::vector<float>> kv;  // [t][h][K then V][D]
  int64_t free_blocks = 0, num_sequences = 0;
};

CacheSnapshot snapshot(const KvCache& cache, const std::vector<SequenceId>& ids) {
  CacheSnapshot s;
  const int64_t H = cache.config().num_heads, D = cache.config().head_dim();
  for (SequenceId id : ids) {
    const int64_t L = cache.length(id);
    s.len[id] = L;
    std::vector<float>& v = s.kv[id];
    v.reserve(static_cast<size_t>(L * H * 2 * D));
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> k = test::cached_key(cache, id, h, t), vv = test::cached_value(cache, id, h, t);
        v.insert(v.end(), k.begin(), k.end());
        v.insert(v.end(), vv.begin(), vv.end());
      }
    }
  }
  s.free_blocks = cache.free_blocks();
  s.num_sequences = cache.num_sequences();
  return s;
}

// `pool_counts`: also free_blocks and num_sequences (false when another sequence legitimately changed them).
::testing::AssertionResult same_snapshot(const CacheSnapshot& before, const CacheSnapshot& after,
                                         bool pool_counts = true) {
  if (pool_counts && before.free_blocks != after.free_blocks) {
    return ::testing::AssertionFailure() << "free_blocks " << before.free_blocks << " -> " << after.free_blocks;
  }
  if (pool_counts && before.num_sequences != after.num_sequences) {
    return ::testing::AssertionFailure() << "num_sequences " << before.num_sequences << " -> " << after.num_sequences;
  }
  for (const auto& [id, L] : before.len) {
    if (after.len.at(id) != L) {
      return ::testing::AssertionFailure() << "sequence " << id << " length " << L << " -> " << after.len.at(id);
    }
    const std::vector<float>& a = before.kv.at(id);
    const std::vector<float>& b = after.kv.at(id);
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
        return ::testing::AssertionFailure() << "sequence " << id << " cached K/V changed at flat [t][h][k|v][d] index "
                                             << i << ": " << a[i] << " -> " << b[i];
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// The K/V a sequence's cache must hold: x W_k^T + b_k and x W_v^T + b_v in double, for tokens [0, L).
::testing::AssertionResult kv_matches_projection(const KvCache& cache, SequenceId id, const Config& c,
                                                 const Weights& w, const std::vector<float>& x,
                                                 const std::string& ctx) {
  const int64_t L = cache.length(id), H = c.num_heads, D = c.head_dim(), W = c.query_width();
  std::vector<float> got;
  std::vector<double> want;
  for (int which = 0; which < 2; ++which) {
    const std::vector<float>& wm = which == 0 ? w.w_k : w.w_v;
    const std::vector<float>& bm = which == 0 ? w.b_k : w.b_v;
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> p = which == 0 ? test::cached_key(cache, id, h, t) : test::cached_value(cache, id, h, t);
        for (int64_t d = 0; d < D; ++d) {
          const int64_t e = h * D + d;
          double acc = bm.empty() ? 0.0 : bm[e];
          for (int64_t i = 0; i < W; ++i) acc += static_cast<double>(x[t * W + i]) * wm[e * W + i];
          want.push_back(acc);
          got.push_back(p[d]);
        }
      }
    }
  }
  return all_close(got, want, Dtype::f32, W,
                   ctx + " | cached K then V; flat index = ((k|v * L + t) * H + h) * D + d, L=" + std::to_string(L));
}

// =============================================================================================================
// A layer, a pool, the block model and every sequence's history; each operation feeds random tokens, records
// the outputs, and updates the model. Checks compare against reference_forward over a sequence's history.

struct Harness {
  Config cfg;
  Weights w;
  CausalSelfAttention block;
  KvCache cache;
  BlockModel model;
  std::map<SequenceId, SeqTrack> seqs;
  Rng rng;
  Isa isa;
  int threads;
  Workspace ws;
  int calls = 0;  // alternates the caller's Workspace and the layer's own

  Harness(const Config& c, Isa isa_, int64_t block_tokens, int64_t capacity_tokens, uint64_t seed, int threads_)
      : cfg(c),
        w(Weights::random(c, seed)),
        block(make_block(c, w, isa_, threads_)),
        cache(block.config(), pool(block_tokens, capacity_tokens)),
        rng(seed + 1),
        isa(isa_),
        threads(threads_) {
    cfg = block.config();
    model.bt = cache.block_tokens();
    model.total = cache.total_blocks();
  }

  int64_t E() const { return cfg.d_model; }
  int64_t W() const { return cfg.query_width(); }
  Workspace* next_ws() { return (calls++ % 2) ? &ws : nullptr; }
  RunOptions run() const { return RunOptions{.threads = threads}; }
  std::string ctx(const std::string& what) const {
    return label(isa, threads, what) + " | " + test::describe(cfg) + " block_tokens=" + std::to_string(model.bt);
  }

  SequenceId create() {
    const SequenceId id = cache.create();
    EXPECT_FALSE(seqs.count(id)) << "id " << id << " reused";
    seqs[id] = {};
    model.create(id);
    return id;
  }
  // Appends T random tokens through extend(); returns the (T, E) outputs.
  std::vector<float> extend(SequenceId id, int64_t T) {
    std::vector<float> x = random_uniform(static_cast<size_t>(T * W()), rng.g, -2.0f, 2.0f);
    return extend_with(id, x);
  }
  std::vector<float> extend_with(SequenceId id, const std::vector<float>& x) {
    const int64_t T = static_cast<int64_t>(x.size()) / W();
    std::vector<float> out(static_cast<size_t>(T * E()), kNaN);
    block.extend(cache, id, x.data(), T, out.data(), run(), next_ws());
    SeqTrack& s = seqs.at(id);
    s.x.insert(s.x.end(), x.begin(), x.end());
    s.out.insert(s.out.end(), out.begin(), out.end());
    model.append(id, T);
    return out;
  }
  // One decode step for `ids`, each with a fresh random token; returns the (B, E) outputs.
  std::vector<float> decode(const std::vector<SequenceId>& ids) {
    std::vector<float> x = random_uniform(ids.size() * static_cast<size_t>(W()), rng.g, -2.0f, 2.0f);
    return decode_with(ids, x);
  }
  std::vector<float> decode_with(const std::vector<SequenceId>& ids, const std::vector<float>& x) {
    const int64_t B = static_cast<int64_t>(ids.size());
    std::vector<float> out(static_cast<size_t>(B * E()), kNaN);
    block.decode(cache, ids.data(), B, x.data(), out.data(), run(), next_ws());
    for (int64_t b = 0; b < B; ++b) {
      SeqTrack& s = seqs.at(ids[b]);
      s.x.insert(s.x.end(), x.begin() + b * W(), x.begin() + (b + 1) * W());
      s.out.insert(s.out.end(), out.begin() + b * E(), out.begin() + (b + 1) * E());
      model.append(ids[b], 1);
    }
    return out;
  }
  SequenceId fork(SequenceId parent) {
    const SequenceId id = cache.fork(parent);
    EXPECT_FALSE(seqs.count(id)) << "fork returned id " << id << " which was used before";
    seqs[id] = seqs.at(parent);
    model.fork(parent, id);
    return id;
  }
  void release(SequenceId id) {
    cache.release(id);
    seqs.erase(id);
    model.release(id);
  }
  std::vector<SequenceId> live() const {
    std::vector<SequenceId> v;
    for (const auto& kv : seqs) v.push_back(kv.first);
    return v;
  }

  // Every output the sequence produced against the reference over its history; flat index = token * E + e.
  ::testing::AssertionResult matches_reference(SequenceId id, const std::string& what) const {
    const SeqTrack& s = seqs.at(id);
    const int64_t N = static_cast<int64_t>(s.x.size()) / W();
    if (N == 0) return ::testing::AssertionSuccess();
    return all_close(s.out, reference_sequence(cfg, w, s.x), Dtype::f32, reduction_length(cfg, N),
                     ctx(what + " | sequence " + std::to_string(id) + " N=" + std::to_string(N) +
                         "; index = token * E + e"));
  }
  ::testing::AssertionResult kv_ok(SequenceId id, const std::string& what) const {
    return kv_matches_projection(cache, id, cfg, w, seqs.at(id).x, ctx(what + " | sequence " + std::to_string(id)));
  }
  // The cache's bookkeeping against the model: lengths, free blocks, blocks_needed, sequence count.
  ::testing::AssertionResult accounting(const std::string& what) const {
    auto fail = [&]() { return ::testing::AssertionFailure() << ctx(what) << ": "; };
    if (cache.total_blocks() != model.total) return fail() << "total_blocks changed to " << cache.total_blocks();
    // The pool's own books, from scratch: every block free once, or held by exactly its table entries, or pinned.
    if (const std::string audit = cache.impl().audit(); !audit.empty()) return fail() << audit;
    if (cache.free_blocks() != model.free()) {
      return fail() << "free_blocks " << cache.free_blocks() << ", model says " << model.free();
    }
    if (cache.num_sequences() != static_cast<int64_t>(seqs.size())) {
      return fail() << "num_sequences " << cache.num_sequences() << ", expected " << seqs.size();
    }
    for (const auto& [id, s] : seqs) {
      if (!cache.contains(id)) return fail() << "contains(" << id << ") is false for a live sequence";
      if (cache.length(id) != model.len.at(id)) {
        return fail() << "length(" << id << ") " << cache.length(id) << ", expected " << model.len.at(id);
      }
      for (int64_t n : {int64_t{1}, model.bt - 1, model.bt, model.bt + 1, 3 * model.bt + 2}) {
        if (n < 1) continue;
        if (cache.blocks_needed(id, n) != model.needed(id, n)) {
          return fail() << "blocks_needed(" << id << ", " << n << ") = " << cache.blocks_needed(id, n)
                        << ", expected " << model.needed(id, n) << " (length " << model.len.at(id)
                        << (model.len.at(id) > 0 && model.cow(id) ? ", last block shared: copy on write" : "") << ")";
        }
      }
    }
    return ::testing::AssertionSuccess();
  }
};

// =============================================================================================================
// 1. Prefill of T tokens then n decode steps equals the reference over the whole T + n tokens.

class KvCachePrefillDecode : public KvCacheTest {};

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

struct ShapeCase {
  Config cfg;
  int64_t T = 0, steps = 0, block_tokens = 0;
  int threads = 1;
  uint64_t seed = 0;
  std::string desc;
};

// Case i: T, D and block_tokens cycle through their lists with coprime periods (9, 8, 5), so 32 cases reach
// every value of each; heads, d_in, biases, decode steps and context slack are drawn from the case's seed.
ShapeCase make_shape_case(int index) {
  constexpr int64_t kT[] = {1, 2, 7, 33, 63, 64, 65, 113, 130};
  constexpr int64_t kD[] = {1, 3, 4, 16, 33, 64, 80, 128};
  constexpr int64_t kBlock[] = {1, 3, 16, 64, 128};
  ShapeCase k;
  k.seed = 0xcace0000ull + static_cast<uint64_t>(index);
  Rng r(k.seed);
  k.T = kT[index % 9];
  const int64_t D = kD[index % 8];
  k.block_tokens = kBlock[index % 5];
  const int64_t H = r.between(1, std::min<int64_t>(16, std::max<int64_t>(1, 512 / D)));  // E <= 512: cheap reference
  k.steps = r.between(1, 3);
  k.threads = 1 + index % 2;
  const int64_t d_in = r.chance(0.75) ? r.between(3, 96) : 0;
  const int64_t slack = r.chance(0.3) ? 0 : r.between(1, 200);  // 0: the last decode reaches context_length
  // The pool refuses blocks longer than the context (KvCache: block_tokens <= context_length).
  const int64_t context = std::max(k.T + k.steps + slack, k.block_tokens);
  k.cfg = make_config(H * D, H, d_in, context, r.chance(0.7), r.chance(0.7));
  std::ostringstream d;
  d << "shape case " << index << " (seed 0x" << std::hex << k.seed << std::dec << ")";
  k.desc = d.str();
  return k;
}

TEST_P(KvCachePrefillDecode, RandomShapes) {
  static std::map<std::string, std::vector<double>> refs;
  constexpr int kCases = 32;
  int d_in_differs = 0, no_bias = 0, at_context = 0, threads2 = 0;
  std::set<int64_t> heads;
  for (int i = 0; i < kCases; ++i) {
    const ShapeCase k = make_shape_case(i);
    prefill_then_decode(isa(), k.cfg, k.seed, k.T, k.steps, k.block_tokens, k.threads, k.desc, refs);
    if (HasFailure()) {
      ADD_FAILURE() << "stopping the random shapes at the first failing case";
      return;
    }
    d_in_differs += k.cfg.query_width() != k.cfg.d_model;
    no_bias += !k.cfg.qkv_bias || !k.cfg.out_bias;
    at_context += k.T + k.steps == k.cfg.context_length;
    threads2 += k.threads == 2;
    heads.insert(k.cfg.num_heads);
  }
  EXPECT_GE(d_in_differs, kCases / 2);
  EXPECT_GE(no_bias, 4);
  EXPECT_GE(at_context, 3);
  EXPECT_GE(threads2, kCases / 2);
  EXPECT_GE(heads.size(), 6u);
}

// One prefill through extend() and CausalSelfAttention::forward on the same tokens agree (and both match the
// reference).
TEST_P(KvCachePrefillDecode, ExtendOfEmptySequenceEqualsForward) {
  const Config c = make_config(96, 3, 40, 256);
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
      {make_config(96, 3, 50, 256), 100, 16, 2},
      {make_config(66, 2, 0, 64, false, false), 40, 3, 1},
      {make_config(64, 1, 24, 256), 130, 64, 2},
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
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCachePrefillDecode);

// =============================================================================================================
// 2. Decode batches: different lengths in one call; long contexts with few heads (split-KV); T = 1.

class KvCacheDecode : public KvCacheTest {};

TEST_P(KvCacheDecode, BatchOfDifferentLengthsEqualsEachAlone) {
  const Config c = make_config(64, 4, 48, 256);
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
    const Config c = make_config(32 * H, H, 0, 1100);
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
    Harness h(make_config(48, 3, 20, 64), isa(), bt, 256, 120 + bt, 2);
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
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCacheDecode);

// =============================================================================================================
// 3. Many sequences: a random script, block reuse, forks.

class KvCacheScript : public KvCacheTest {};

// ~40 random operations (create + prefill, extend a chunk, decode a random subset, fork, release) on a pool that
// always holds the live set; the bookkeeping follows the block model after every operation, each sequence's
// outputs match the reference over its own history when it is released, and blocks are reused.
TEST_P(KvCacheScript, RandomCreateExtendDecodeForkRelease) {
  Harness h(make_config(48, 3, 40, 96), isa(), 8, 24 * 8, 130, 2);
  Rng& r = h.rng;
  ASSERT_EQ(h.cache.total_blocks(), 24);
  const int64_t context = h.cfg.context_length;
  int ops = 0, forks = 0, releases = 0, decodes = 0, extends = 0, max_batch = 0;
  std::set<SequenceId> ever;
  auto release_one = [&](SequenceId id, const std::string& why) {
    EXPECT_TRUE(h.matches_reference(id, "released (" + why + ")"));
    h.release(id);
    ++releases;
    EXPECT_FALSE(h.cache.contains(id)) << "contains() true after release of " << id;
  };
  // Frees room for `blocks` more by releasing the longest sequences.
  auto make_room = [&](int64_t blocks) {
    while (h.model.free() < blocks && !h.seqs.empty()) {
      SequenceId longest = h.seqs.begin()->first;
      for (const auto& kv : h.seqs) {
        if (h.model.len.at(kv.first) > h.model.len.at(longest)) longest = kv.first;
      }
      release_one(longest, "making room");
    }
  };
  // 40 operations that really happen (an operation that does not apply now is drawn again).
  for (int attempt = 0, op = 0; op < 40 && attempt < 400; ++attempt, op = ops) {
    const int64_t kind = h.seqs.empty() ? 0 : r.between(0, 9);
    std::string what;
    if (kind <= 1) {  // create + prefill
      const int64_t T = r.between(1, 40);
      make_room(BlockModel::blocks_for(T, 8));
      const SequenceId id = h.create();
      ever.insert(id);
      h.extend(id, T);
      ++extends;
      what = "create " + std::to_string(id) + " + prefill " + std::to_string(T);
    } else if (kind <= 2) {  // extend a chunk
      const std::vector<SequenceId> ids = h.live();
      const SequenceId id = ids[r.between(0, ids.size() - 1)];
      const int64_t T = std::min<int64_t>(r.between(1, 20), context - h.model.len.at(id));
      if (T < 1) continue;
      if (h.model.needed(id, T) > h.model.free()) continue;
      h.extend(id, T);
      ++extends;
      what = "extend " + std::to_string(id) + " by " + std::to_string(T);
    } else if (kind <= 6) {  // decode a random subset of the non-empty sequences below context_length
      std::vector<SequenceId> ids;
      for (SequenceId id : h.live()) {
        if (h.model.len.at(id) > 0 && h.model.len.at(id) < context && r.chance(0.6)) ids.push_back(id);
      }
      if (ids.empty()) continue;
      std::shuffle(ids.begin(), ids.end(), r.g);
      int64_t need = 0;
      for (SequenceId id : ids) need += h.model.needed(id, 1);
      if (need > h.model.free()) continue;
      h.decode(ids);
      ++decodes;
      max_batch = std::max<int>(max_batch, static_cast<int>(ids.size()));
      what = "decode of " + std::to_string(ids.size()) + " sequences";
    } else if (kind <= 7) {  // fork
      const std::vector<SequenceId> ids = h.live();
      const SequenceId parent = ids[r.between(0, ids.size() - 1)];
      const SequenceId child = h.fork(parent);
      ever.insert(child);
      ++forks;
      what = "fork " + std::to_string(parent) + " -> " + std::to_string(child);
    } else {  // release
      const std::vector<SequenceId> ids = h.live();
      const SequenceId id = ids[r.between(0, ids.size() - 1)];
      release_one(id, "script");
      what = "release " + std::to_string(id);
    }
    ++ops;
    ASSERT_TRUE(h.accounting("after op " + std::to_string(op) + ": " + what));
  }
  for (SequenceId id : h.live()) {
    EXPECT_TRUE(h.kv_ok(id, "end of script"));
    release_one(id, "end of script");
  }
  EXPECT_TRUE(h.accounting("everything released"));
  EXPECT_EQ(h.cache.free_blocks(), h.cache.total_blocks());
  EXPECT_EQ(h.cache.num_sequences(), 0);
  for (SequenceId id : ever) EXPECT_FALSE(h.cache.contains(id)) << "released id " << id << " still valid";
  // The script must really reach what it claims to.
  EXPECT_EQ(ops, 40);
  EXPECT_GE(forks, 2);
  EXPECT_GE(decodes, 10);
  EXPECT_GE(max_batch, 3);
  EXPECT_GT(h.model.allocated_ever, h.model.total) << "the script never needed a released block again";
}

// A full pool, one sequence released, a new one of the same size: it fits, and takes exactly the released
// blocks (the only free ones). Repeated, so blocks go round several times.
TEST_P(KvCacheScript, BlocksAreReusedAfterRelease) {
  Harness h(make_config(32, 2, 0, 64), isa(), 4, 40, 140, 1);  // 10 blocks
  ASSERT_EQ(h.cache.total_blocks(), 10);
  const SequenceId a = h.create(), b = h.create();
  h.extend(a, 18);  // 5 blocks
  h.extend(b, 20);  // 5 blocks
  ASSERT_EQ(h.cache.free_blocks(), 0);
  SequenceId victim = a;
  for (int round = 0; round < 4; ++round) {
    const int64_t L = h.model.len.at(victim);
    std::set<int32_t> released_blocks;
    for (int64_t t = 0; t < L; t += 4) released_blocks.insert(test::block_of(h.cache, victim, t));
    EXPECT_TRUE(h.matches_reference(victim, "round " + std::to_string(round)));
    h.release(victim);
    EXPECT_TRUE(h.accounting("round " + std::to_string(round) + " after release"));
    const SequenceId n = h.create();
    h.extend(n, 9);
    for (int s = 0; s < 7 && h.model.needed(n, 1) <= h.model.free(); ++s) h.decode({n});
    std::set<int32_t> new_blocks;
    for (int64_t t = 0; t < h.model.len.at(n); t += 4) new_blocks.insert(test::block_of(h.cache, n, t));
    for (int32_t p : new_blocks) {
      EXPECT_TRUE(released_blocks.count(p)) << h.ctx("round " + std::to_string(round)) << ": new sequence " << n
                                            << " got block " << p
                                            << " that the released one did not hold (the pool was full)";
    }
    EXPECT_TRUE(h.accounting("round " + std::to_string(round) + " after refill"));
    victim = n;
  }
  for (SequenceId id : h.live()) EXPECT_TRUE(h.matches_reference(id, "after rounds"));
}

// Pool sizing as kv_cache.hpp states it: tokens round up to whole blocks, bytes round down; exactly one is set;
// block_tokens 0 = min(64, context_length).
TEST_P(KvCacheScript, PoolSizing) {
  const Config c = make_config(48, 3, 0, 1024);  // D = 16
  const size_t block_bytes = 2 * 3 * 16 * 16 * sizeof(float);
  KvCache by_tokens(c, pool(16, 100));
  EXPECT_EQ(by_tokens.block_tokens(), 16);
  EXPECT_EQ(by_tokens.total_blocks(), 7);  // ceil(100 / 16)
  EXPECT_EQ(by_tokens.block_bytes(), block_bytes);
  EXPECT_EQ(by_tokens.capacity_bytes(), 7 * block_bytes);
  EXPECT_EQ(by_tokens.free_blocks(), 7);
  KvCacheOptions bytes;
  bytes.block_tokens = 16;
  bytes.capacity_bytes = 5 * block_bytes + block_bytes / 2;
  KvCache by_bytes(c, bytes);
  EXPECT_EQ(by_bytes.total_blocks(), 5);  // rounded down
  KvCacheOptions defaults;
  defaults.capacity_tokens = 64;
  EXPECT_EQ(KvCache(c, defaults).block_tokens(), 64);
  Config short_context = c;
  short_context.context_length = 24;
  EXPECT_EQ(KvCache(short_context, defaults).block_tokens(), 24);
  for (int which = 0; which < 2; ++which) {
    KvCacheOptions bad;
    bad.block_tokens = 16;
    if (which == 1) {
      bad.capacity_tokens = 64;
      bad.capacity_bytes = 4 * block_bytes;
    }
    try {
      KvCache cache(c, bad);
      ADD_FAILURE() << (which ? "both capacity_tokens and capacity_bytes set" : "no capacity set") << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::invalid_argument)) << e.what();
      EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
    }
  }
}

class KvCacheFork : public KvCacheTest {};

// Parent lengths 6 (partially filled shared last block: copy on write) and 8 (full blocks: never written again);
// the child and the parent continue with different tokens, each matching its own reference, and neither's
// cached K/V changes when the other appends.
TEST_P(KvCacheFork, ChildDivergesWithCopyOnWrite) {
  for (int64_t L : {int64_t{6}, int64_t{8}}) {
    Harness h(make_config(32, 2, 24, 64), isa(), 4, 64, 150 + L, 2);
    const SequenceId p = h.create();
    h.extend(p, L);
    const int64_t free_before = h.cache.free_blocks();
    const SequenceId c = h.fork(p);
    const std::string tag = "parent length " + std::to_string(L);
    ASSERT_TRUE(h.accounting(tag + ", after fork"));
    EXPECT_EQ(h.cache.free_blocks(), free_before) << h.ctx(tag) << ": a fork must share, not copy";
    EXPECT_EQ(h.cache.length(c), L);
    const CacheSnapshot parent0 = snapshot(h.cache, {p});

    h.decode({c});  // the child appends first
    ASSERT_TRUE(h.accounting(tag + ", child decoded"));
    EXPECT_TRUE(same_snapshot(parent0, snapshot(h.cache, {p}), false)) << h.ctx(tag) << ": the child's append changed the parent";
    const CacheSnapshot child1 = snapshot(h.cache, {c});
    h.decode({p});  // the parent diverges
    ASSERT_TRUE(h.accounting(tag + ", parent decoded"));
    CacheSnapshot child_now = snapshot(h.cache, {c});
    EXPECT_TRUE(same_snapshot(child1, child_now, false)) << h.ctx(tag) << ": the parent's append changed the child";

    h.extend(c, 5);  // a chunk into the child, crossing block boundaries
    h.decode({p, c});
    h.decode({c, p});
    ASSERT_TRUE(h.accounting(tag + ", both continued"));
    EXPECT_TRUE(h.matches_reference(p, tag + " parent"));
    EXPECT_TRUE(h.matches_reference(c, tag + " child"));
    EXPECT_TRUE(h.kv_ok(p, tag + " parent"));
    EXPECT_TRUE(h.kv_ok(c, tag + " child"));

    // A grandchild, then the middle generation released: the shared blocks stay with the others.
    const SequenceId g = h.fork(c);
    h.decode({g});
    h.release(c);
    ASSERT_TRUE(h.accounting(tag + ", child released, grandchild alive"));
    h.decode({g, p});
    EXPECT_TRUE(h.matches_reference(g, tag + " grandchild"));
    EXPECT_TRUE(h.matches_reference(p, tag + " parent after the child's release"));
    h.release(p);
    h.release(g);
    EXPECT_TRUE(h.accounting(tag + ", all released"));
    EXPECT_EQ(h.cache.free_blocks(), h.cache.total_blocks());
  }
}

TEST_P(KvCacheFork, ForkOfEmptySequence) {
  Harness h(make_config(32, 2, 0, 64), isa(), 4, 64, 160, 1);
  const SequenceId p = h.create();
  const SequenceId c = h.fork(p);
  ASSERT_TRUE(h.accounting("fork of an empty sequence"));
  EXPECT_EQ(h.cache.length(c), 0);
  h.extend(c, 3);
  h.extend(p, 5);
  h.decode({p, c});
  ASSERT_TRUE(h.accounting("both extended"));
  EXPECT_TRUE(h.matches_reference(p, "parent"));
  EXPECT_TRUE(h.matches_reference(c, "child"));
}
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCacheScript);
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCacheFork);

// =============================================================================================================
// 4. Errors: each refused call throws Error with the right code and a message naming the problem, and leaves
// every sequence's length and cached K/V bit-identical, the pool's counts, and `out`, untouched.

class KvCacheErrors : public KvCacheTest {
 protected:
  // Two sequences: a (length 6) and b (length 8, full blocks), on a 5-block pool of 4-token blocks (1 free),
  // context_length 16.
  void SetUp() override {
    KvCacheTest::SetUp();
    if (IsSkipped()) return;
    rebuild(20);
  }
  void rebuild(int64_t capacity_tokens) {
    h = std::make_unique<Harness>(make_config(32, 2, 24, 16), isa(), 4, capacity_tokens, 170, 2);
    a = h->create();
    b = h->create();
    h->extend(a, 6);
    h->extend(b, 8);
  }
  std::unique_ptr<Harness> h;
  SequenceId a = 0, b = 0;

  // Runs `call` (which must throw), then checks code, message words (each group: one alternative must appear),
  // the cache state and `out`. `out` is the buffer the call was given, prefilled with kSentinel.
  void expect_refused(const std::string& what, ErrorCode code, const std::vector<std::vector<std::string>>& words,
                      const std::vector<float>& out, const std::function<void()>& call) {
    const std::string ctx = h->ctx(what);
    const CacheSnapshot before = snapshot(h->cache, h->live());
    try {
      call();
      ADD_FAILURE() << ctx << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << ctx << ": wrong code for: " << e.what();
      const std::string msg = e.what();
      for (const auto& group : words) {
        bool found = false;
        for (const std::string& w : group) found = found || msg.find(w) != std::string::npos;
        std::string alts;
        for (const std::string& w : group) alts += " \"" + w + "\"";
        EXPECT_TRUE(found) << ctx << ": message names none of" << alts << ": " << msg;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << ctx << ": threw a non-gpt2attn exception: " << e.what();
    }
    EXPECT_TRUE(same_snapshot(before, snapshot(h->cache, h->live()))) << ctx << ": state changed by a refused call";
    for (size_t i = 0; i < out.size(); ++i) {
      if (std::memcmp(&out[i], &kSentinel, sizeof(float)) != 0) {
        ADD_FAILURE() << ctx << ": refused call wrote out[" << i << "] = " << out[i];
        break;
      }
    }
    EXPECT_TRUE(h->accounting(what + ", after the refused call"));
  }
  std::vector<float> tokens(int64_t n) { return random_uniform(static_cast<size_t>(n * h->W()), h->rng.g); }
  std::vector<float> sentinel_out(int64_t rows) {
    return std::vector<float>(static_cast<size_t>(rows * h->E()), kSentinel);
  }
  // After the refusals the sequences still work and match their references.
  void still_works() {
    h->decode({a});
    EXPECT_TRUE(h->matches_reference(a, "after refused calls"));
    EXPECT_TRUE(h->matches_reference(b, "after refused calls"));
  }
};

TEST_P(KvCacheErrors, PoolExhaustedInExtend) {
  // a: 2 blocks, b: 2 blocks, 1 free. c needs 2 for 5 tokens; a needs 2 more for 6 tokens (8 -> 12 is 3 blocks).
  ASSERT_EQ(h->cache.free_blocks(), 1);
  const SequenceId c = h->create();
  std::vector<float> out = sentinel_out(7);
  const std::vector<float> x = tokens(7);
  const std::vector<std::vector<std::string>> words{{"block", "pool", "capacity", "KV", "memory"}};
  expect_refused("extend of 5 tokens into an empty sequence, 1 block free", ErrorCode::out_of_memory, words, out,
                 [&] { h->block.extend(h->cache, c, x.data(), 5, out.data()); });
  expect_refused("extend of 7 tokens into a (length 6 -> 13: 2 more blocks), 1 block free",
                 ErrorCode::out_of_memory, words, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 7, out.data()); });
  // Exactly enough: 2 tokens into a (6 -> 8) takes no block; 4 more into c takes the last one.
  h->extend(a, 2);
  h->extend(c, 4);
  ASSERT_EQ(h->cache.free_blocks(), 0);
  EXPECT_TRUE(h->accounting("pool exactly full"));
  std::vector<float> out1 = sentinel_out(1);
  expect_refused("extend of 1 token into c (length 4, full block), pool empty", ErrorCode::out_of_memory, words, out1,
                 [&] { h->block.extend(h->cache, c, x.data(), 1, out1.data()); });
  // Releasing b makes room; everything else is as it was.
  h->release(b);
  h->extend(c, 3);
  h->decode({a, c});
  EXPECT_TRUE(h->accounting("after release and reuse"));
  EXPECT_TRUE(h->matches_reference(a, "a after exhaustion"));
  EXPECT_TRUE(h->matches_reference(c, "c after exhaustion"));
}

TEST_P(KvCacheErrors, PoolExhaustedInDecodeIsAllOrNothing) {
  // Fill: c takes the last block with 3 tokens. Then decode {c, b}: c fits in its block, b (length 8, full) needs
  // a new one: the whole batch is refused and c is not appended either.
  const SequenceId c = h->create();
  h->extend(c, 3);
  ASSERT_EQ(h->cache.free_blocks(), 0);
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const std::vector<std::vector<std::string>> words{{"block", "pool", "capacity", "KV", "memory"}};
  const SequenceId cb[] = {c, b};
  expect_refused("decode {c (fits), b (needs a block)}, pool empty", ErrorCode::out_of_memory, words, out,
                 [&] { h->block.decode(h->cache, cb, 2, x.data(), out.data()); });
  // c alone fits.
  h->decode({c});
  EXPECT_TRUE(h->accounting("c decoded alone"));
  h->release(a);
  h->decode({c, b});
  EXPECT_TRUE(h->accounting("after release"));
  for (SequenceId id : h->live()) EXPECT_TRUE(h->matches_reference(id, "after exhaustion in decode"));
}

TEST_P(KvCacheErrors, UnknownAndReleasedIds) {
  const SequenceId gone = h->create();
  h->extend(gone, 2);
  h->release(gone);
  const SequenceId never = 987654321;
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  for (SequenceId bad : {gone, never}) {
    const std::string id = std::to_string(bad);
    const std::string which = bad == gone ? "released" : "unknown";
    expect_refused("extend of " + which + " id " + id, ErrorCode::invalid_argument, {{id}}, out,
                   [&] { h->block.extend(h->cache, bad, x.data(), 1, out.data()); });
    const SequenceId ids[] = {a, bad};
    expect_refused("decode {a, " + which + " id " + id + "}", ErrorCode::invalid_argument, {{id}}, out,
                   [&] { h->block.decode(h->cache, ids, 2, x.data(), out.data()); });
    EXPECT_FALSE(h->cache.contains(bad));
    for (const char* m : {"length", "fork", "release", "blocks_needed"}) {
      try {
        const std::string mm = m;
        if (mm == "length") h->cache.length(bad);
        if (mm == "fork") h->cache.fork(bad);
        if (mm == "release") h->cache.release(bad);
        if (mm == "blocks_needed") h->cache.blocks_needed(bad, 1);
        ADD_FAILURE() << h->ctx("KvCache::" + mm + "(" + which + " id " + id + ")") << " accepted";
      } catch (const Error& e) {
        EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::invalid_argument)) << e.what();
        EXPECT_NE(std::string(e.what()).find(id), std::string::npos) << "message lacks the id: " << e.what();
      }
    }
    EXPECT_TRUE(h->accounting("after " + which + " id"));
  }
  still_works();
}

TEST_P(KvCacheErrors, SameIdTwiceInOneBatch) {
  std::vector<float> out = sentinel_out(3);
  const std::vector<float> x = tokens(3);
  const SequenceId ids[] = {a, b, a};
  expect_refused("decode {a, b, a}", ErrorCode::invalid_argument,
                 {{std::to_string(a)}, {"twice", "duplicate", "more than once", "repeated", "appears", "distinct"}},
                 out, [&] { h->block.decode(h->cache, ids, 3, x.data(), out.data()); });
  still_works();
}

TEST_P(KvCacheErrors, PastContextLength) {
  // context_length 16: a has 6, so extend of 11 is refused, 10 is fine; then a decode at length 16 is refused.
  // The pool has room for everything here, so the only problem is the length.
  rebuild(64);
  std::vector<float> out = sentinel_out(11);
  const std::vector<float> x = tokens(11);
  expect_refused("extend of 11 tokens into a (length 6), context 16", ErrorCode::invalid_argument,
                 {{"context_length"}}, out, [&] { h->block.extend(h->cache, a, x.data(), 11, out.data()); });
  h->extend(a, 10);
  ASSERT_EQ(h->cache.length(a), 16);
  const SequenceId c = h->create();
  h->extend(c, 2);
  std::vector<float> out2 = sentinel_out(2);
  const SequenceId ids[] = {c, a};
  expect_refused("decode {c (length 2), a (length 16 = context)}", ErrorCode::invalid_argument, {{"context_length"}},
                 out2, [&] { h->block.decode(h->cache, ids, 2, x.data(), out2.data()); });
  EXPECT_TRUE(h->matches_reference(a, "a at context_length"));
  h->decode({c});
  EXPECT_TRUE(h->matches_reference(c, "c after the refusal"));
}

TEST_P(KvCacheErrors, NonFiniteInput) {
  std::vector<float> out = sentinel_out(3);
  std::vector<float> x = tokens(3);
  x[1 * h->W() + 5] = kNaN;  // token 1, element 5
  expect_refused("extend with NaN at token 1, element 5", ErrorCode::invalid_argument, {{"NaN"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 3, out.data()); });
  const SequenceId ids[] = {a, b};
  std::vector<float> xd = tokens(2);
  xd[1 * h->W() + 3] = std::numeric_limits<float>::infinity();  // b's token
  std::vector<float> out2 = sentinel_out(2);
  expect_refused("decode {a, b} with +Inf in b's token", ErrorCode::invalid_argument, {{"Inf", "inf", "finite"}},
                 out2, [&] { h->block.decode(h->cache, ids, 2, xd.data(), out2.data()); });
  still_works();
}

TEST_P(KvCacheErrors, TrainingRefused) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const RunOptions train{.training = true};
  expect_refused("extend with training=true", ErrorCode::invalid_argument, {{"training"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 1, out.data(), train); });
  const SequenceId ids[] = {a, b};
  expect_refused("decode with training=true", ErrorCode::invalid_argument, {{"training"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, x.data(), out.data(), train); });
  still_works();
}

TEST_P(KvCacheErrors, EmptyCallsAndNullPointers) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const SequenceId ids[] = {a, b};
  expect_refused("extend with T=0", ErrorCode::invalid_argument, {{"T"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 0, out.data()); });
  expect_refused("extend with T=-1", ErrorCode::invalid_argument, {{"T"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), -1, out.data()); });
  expect_refused("decode with B=0", ErrorCode::invalid_argument, {{"B", "batch"}}, out,
                 [&] { h->block.decode(h->cache, ids, 0, x.data(), out.data()); });
  expect_refused("extend with x = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.extend(h->cache, a, nullptr, 1, out.data()); });
  expect_refused("extend with out = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 1, nullptr); });
  expect_refused("decode with seqs = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, nullptr, 2, x.data(), out.data()); });
  expect_refused("decode with x = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, nullptr, out.data()); });
  expect_refused("decode with out = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, x.data(), nullptr); });
  still_works();
}

TEST_P(KvCacheErrors, CacheBuiltForAnotherShape) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  Config wider = h->cfg;
  wider.d_model = 48;  // H = 2, D = 24
  Config more_heads = h->cfg;
  more_heads.num_heads = 4;  // E = 32, D = 8
  for (const Config* other : {&wider, &more_heads}) {
    KvCache foreign(*other, pool(4, 20));
    const SequenceId f = foreign.create();
    const std::string shape = "a cache for E=" + std::to_string(other->d_model) +
                              " H=" + std::to_string(other->num_heads);
    expect_refused("extend into " + shape, ErrorCode::invalid_argument,
                   {{"d_model", "num_heads", "heads", "width", "E="}}, out,
                   [&] { h->block.extend(foreign, f, x.data(), 1, out.data()); });
    EXPECT_EQ(foreign.length(f), 0) << shape;
    EXPECT_EQ(foreign.free_blocks(), foreign.total_blocks()) << shape;
    const SequenceId ids[] = {f};
    expect_refused("decode in " + shape, ErrorCode::invalid_argument,
                   {{"d_model", "num_heads", "heads", "width", "E="}}, out,
                   [&] { h->block.decode(foreign, ids, 1, x.data(), out.data()); });
  }
  still_works();
}
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCacheErrors);

// =============================================================================================================
// 5. Concurrency: 4 caller threads on one shared layer and pool, each with its own sequences (and its own
// Workspace, or none: the layer's own, serialised), give bit-identical results to the same work run
// sequentially. Each thread also forks and releases a scratch sequence off its own, so the pool's shared
// bookkeeping and copy on write race with the others' appends. Run under ThreadSanitizer by scripts/tsan.sh.

class KvCacheConcurrency : public KvCacheTest {};

constexpr int kThreads = 4, kSteps = 20;

struct ThreadWork {
  int64_t T[2];
  std::vector<float> prefill[2];  // (T[s], d_in)
  std::vector<float> steps;       // (kSteps, 2, d_in)
  std::vector<float> scratch;     // (kSteps, d_in): tokens for the forked scratch sequences
};

ThreadWork make_work(int t, int64_t W) {
  ThreadWork k;
  std::mt19937_64 rng(200 + t);
  k.T[0] = 17 + 9 * t;
  k.T[1] = 40 - 5 * t;
  for (int s = 0; s < 2; ++s) k.prefill[s] = random_uniform(static_cast<size_t>(k.T[s] * W), rng, -2.0f, 2.0f);
  k.steps = random_uniform(static_cast<size_t>(kSteps * 2 * W), rng, -2.0f, 2.0f);
  k.scratch = random_uniform(static_cast<size_t>(kSteps * W), rng, -2.0f, 2.0f);
  return k;
}

// One thread's work; returns the outputs of its two sequences, prefill rows then decode rows.
std::vector<float> run_work(CausalSelfAttention& block, KvCache& cache, const ThreadWork& k, Workspace* ws) {
  const int64_t W = block.config().query_width(), E = block.config().d_model;
  const RunOptions run{.threads = 1};
  std::vector<float> result;
  SequenceId ids[2] = {cache.create(), cache.create()};
  for (int s = 0; s < 2; ++s) {
    std::vector<float> out(static_cast<size_t>(k.T[s] * E), kNaN);
    block.extend(cache, ids[s], k.prefill[s].data(), k.T[s], out.data(), run, ws);
    result.insert(result.end(), out.begin(), out.end());
  }
  std::vector<float> out(static_cast<size_t>(2 * E), kNaN), scratch_out(static_cast<size_t>(E));
  for (int step = 0; step < kSteps; ++step) {
    block.decode(cache, ids, 2, k.steps.data() + step * 2 * W, out.data(), run, ws);
    result.insert(result.end(), out.begin(), out.end());
    if (step % 4 == 1) {  // a scratch fork appends into (a copy of) the shared last block, then goes away
      const SequenceId f = cache.fork(ids[step % 2]);
      block.decode(cache, &f, 1, k.scratch.data() + step * W, scratch_out.data(), run, ws);
      cache.release(f);
    }
  }
  cache.release(ids[0]);
  cache.release(ids[1]);
  return result;
}

void concurrent_matches_sequential(Isa isa, bool own_workspaces) {
  const Config c = make_config(64, 4, 48, 128);
  const Weights w = Weights::random(c, 210);
  CausalSelfAttention block = make_block(c, w, isa, 1);
  const int64_t W = block.config().query_width();
  std::vector<ThreadWork> work;
  for (int t = 0; t < kThreads; ++t) work.push_back(make_work(t, W));

  // Sequential: the same work, one thread after the other, on a fresh pool of the same size.
  std::vector<std::vector<float>> want(kThreads);
  {
    KvCache cache(block.config(), pool(16, 1024));
    Workspace ws;
    for (int t = 0; t < kThreads; ++t) want[t] = run_work(block, cache, work[t], own_workspaces ? &ws : nullptr);
    ASSERT_EQ(cache.free_blocks(), cache.total_blocks());
  }
  // Concurrent: all threads released together.
  KvCache cache(block.config(), pool(16, 1024));
  std::vector<std::vector<float>> got(kThreads);
  std::vector<std::string> errors(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool_threads;
  for (int t = 0; t < kThreads; ++t) {
    pool_threads.emplace_back([&, t] {
      Workspace ws;
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      try {
        got[t] = run_work(block, cache, work[t], own_workspaces ? &ws : nullptr);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (std::thread& th : pool_threads) th.join();
  const std::string ctx = label(isa, 1, own_workspaces ? "4 threads, own Workspaces" : "4 threads, no Workspace");
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << ctx << ": thread " << t << " threw: " << errors[t];
    ASSERT_EQ(got[t].size(), want[t].size()) << ctx << ": thread " << t;
    for (size_t i = 0; i < got[t].size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[t][i], &want[t][i], sizeof(float)), 0)
          << ctx << ": thread " << t << " output [" << i << "] (prefill rows, then (step, slot, e)): concurrent "
          << got[t][i] << " sequential " << want[t][i];
    }
  }
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks()) << ctx;
  EXPECT_EQ(cache.num_sequences(), 0) << ctx;

  // And the sequential results are right: thread 0's first sequence against the reference.
  const ThreadWork& k = work[0];
  std::vector<float> x = k.prefill[0];
  const int64_t E = block.config().d_model;
  std::vector<float> out0(want[0].begin(), want[0].begin() + k.T[0] * E);
  const int64_t decode_base = (k.T[0] + k.T[1]) * E;
  for (int step = 0; step < kSteps; ++step) {
    x.insert(x.end(), k.steps.begin() + step * 2 * W, k.steps.begin() + step * 2 * W + W);
    out0.insert(out0.end(), want[0].begin() + decode_base + step * 2 * E,
                want[0].begin() + decode_base + step * 2 * E + E);
  }
  EXPECT_TRUE(all_close(out0, reference_sequence(block.config(), w, x), Dtype::f32,
                        reduction_length(block.config(), k.T[0] + kSteps),
                        ctx + " | thread 0 sequence 0 vs reference; index token*E+e"));
}

TEST_P(KvCacheConcurrency, ThreadsWithOwnWorkspacesMatchSequential) { concurrent_matches_sequential(isa(), true); }
TEST_P(KvCacheConcurrency, ThreadsSharingLayerWorkspaceMatchSequential) {
  concurrent_matches_sequential(isa(), false);
}
GPT2ATTN_KV_INSTANTIATE_ISAS(KvCacheConcurrency);

}  // namespace
}  // namespace gpt2attn
