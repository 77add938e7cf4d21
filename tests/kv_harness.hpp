// tests/kv_harness.hpp: what the KV-cache suites (tests/test_kv_cache_*.cpp, tests/test_kv_pool.cpp,
// tests/test_kv_soak.cpp, the sweep's serving cases) share: the config and pool builders, the block accounting model,
// cache snapshots, the Harness that drives a layer and a pool while recording every sequence's history, and the only
// reads of cached K/V the tests make (cached_key, cached_value, block_of, held_blocks), so a change in how the pool
// stores K/V is absorbed here. It holds no TEST.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/kv_cache.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "tests/isa_param.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn::test {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kSentinel = -12345.5f;

// =============================================================================================================
// Reads of cached K/V. Every test reads the pool through these three, never through KvCache's own accessors.

// Cached key / value of token t (0 <= t < length) and head h of `seq`: D floats, copied out.
inline std::vector<float> cached_key(const KvCache& cache, SequenceId seq, int64_t h, int64_t t) {
  std::vector<float> row(static_cast<size_t>(cache.config().head_dim()));
  cache.read_key(seq, h, t, row.data());
  return row;
}
inline std::vector<float> cached_value(const KvCache& cache, SequenceId seq, int64_t h, int64_t t) {
  std::vector<float> row(static_cast<size_t>(cache.config().head_dim()));
  cache.read_value(seq, h, t, row.data());
  return row;
}

// The pool block holding token t (0 <= t < length) of `seq`, from the sequence's block table: which block holds a
// token is a question of identity, so it must not depend on how a block's bytes are stored or read.
inline int32_t block_of(const KvCache& cache, SequenceId seq, int64_t t) { return cache.impl().block_of(seq, t); }

// =============================================================================================================
// Builders and the reference.

// A causal config for the KV-cache tests (the cache serves CausalSelfAttention only); named apart from
// fastpath_util.hpp's make_config, whose positional arguments mean other things.
inline Config serving_config(int64_t E, int64_t H, int64_t d_in = 0, int64_t context = 1024, bool qkv_bias = true,
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

inline CausalSelfAttention make_block(const Config& c, const Weights& w, Isa isa, int threads,
                                      DType compute = DType::f32, WeightFormat weights = WeightFormat::compute) {
  CausalSelfAttention b(c, w, EngineOptions{.threads = threads, .isa = isa, .compute = compute, .weights = weights});
  EXPECT_EQ(b.layer().isa(), kernel_level(isa, compute))
      << "forced " << to_string(isa) << ", engine chose " << to_string(b.layer().isa());
  EXPECT_TRUE(b.config().causal) << "CausalSelfAttention must turn causal on";
  return b;
}

inline KvCacheOptions pool(int64_t block_tokens, int64_t capacity_tokens) {
  KvCacheOptions o;
  o.block_tokens = block_tokens;
  o.capacity_tokens = capacity_tokens;
  return o;
}

// The naive reference over one sequence's whole history x (N, d_in): (N, E) in double, causal.
inline std::vector<double> reference_sequence(const Config& causal, const Weights& w, const std::vector<float>& x) {
  const int64_t N = static_cast<int64_t>(x.size()) / causal.query_width();
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, N, causal.query_width()});
  return reference_forward(causal, w, in);
}

inline std::string label(Isa isa, int threads, const std::string& what) {
  std::ostringstream s;
  s << "[isa=" << to_string(isa) << " threads=" << threads << "] " << what;
  return s.str();
}

// Rows [first, first + n) of a (N, E) reference; compared with all_close the flat index is (row - first) * E + e.
inline std::vector<double> rows(const std::vector<double>& ref, int64_t E, int64_t first, int64_t n) {
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
  void fork(SequenceId parent, SequenceId child) { fork(parent, child, len.at(parent)); }
  // The child holds the blocks of the parent's first `prefix` tokens.
  void fork(SequenceId parent, SequenceId child, int64_t prefix) {
    const std::vector<int64_t>& p = tables.at(parent);
    tables[child].assign(p.begin(), p.begin() + blocks_for(prefix, bt));
    len[child] = prefix;
    for (int64_t b : tables[child]) ++refs[b];
  }
  void truncate(SequenceId s, int64_t n) {
    std::vector<int64_t>& t = tables.at(s);
    for (size_t i = static_cast<size_t>(blocks_for(n, bt)); i < t.size(); ++i) drop(t[i]);
    t.resize(static_cast<size_t>(blocks_for(n, bt)));
    len[s] = n;
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

inline CacheSnapshot snapshot(const KvCache& cache, const std::vector<SequenceId>& ids) {
  CacheSnapshot s;
  const int64_t H = cache.config().kv_heads(), D = cache.config().head_dim();
  for (SequenceId id : ids) {
    const int64_t L = cache.length(id);
    s.len[id] = L;
    std::vector<float>& v = s.kv[id];
    v.reserve(static_cast<size_t>(L * H * 2 * D));
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> k = cached_key(cache, id, h, t), vv = cached_value(cache, id, h, t);
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
inline ::testing::AssertionResult same_snapshot(const CacheSnapshot& before, const CacheSnapshot& after,
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

// The raw bytes of every pool block the sequences `ids` hold, by block index: their cached K/V at the storage level,
// whatever the dtype. A call may write only blocks its own sequences hold alone (a shared block is copied first),
// so every block of the other sequences, unwritten slots included, must keep these bytes exactly. Cheap enough to
// take around every operation of a long script (a memcpy per block), unlike snapshot(), which reads every row.
using BlockBytes = std::map<int32_t, std::vector<unsigned char>>;
inline BlockBytes held_blocks(const KvCache& cache, const std::vector<SequenceId>& ids) {
  BlockBytes held;
  const KvCache::Impl& p = cache.impl();
  for (SequenceId id : ids) {
    for (int64_t t = 0; t < cache.length(id); t += cache.block_tokens()) {
      const int32_t b = block_of(cache, id, t);
      if (held.count(b)) continue;
      const auto* bytes = reinterpret_cast<const unsigned char*>(p.block(b));
      held[b].assign(bytes, bytes + p.block_bytes);
    }
  }
  return held;
}
// Which blocks of `before` changed; empty when none did.
inline std::string changed_blocks(const KvCache& cache, const BlockBytes& before) {
  std::ostringstream s;
  const KvCache::Impl& p = cache.impl();
  for (const auto& [b, bytes] : before) {
    if (std::memcmp(p.block(b), bytes.data(), bytes.size()) != 0) s << " block " << b << " changed;";
  }
  return s.str();
}

// The K/V a sequence's cache must hold: x W_k^T + b_k and x W_v^T + b_v in double, for tokens [0, L).
inline ::testing::AssertionResult kv_matches_projection(const KvCache& cache, SequenceId id, const Config& c,
                                                        const Weights& w, const std::vector<float>& x,
                                                        const std::string& ctx) {
  const int64_t L = cache.length(id), H = c.kv_heads(), D = c.head_dim(), W = c.query_width();
  std::vector<float> got;
  std::vector<double> want;
  for (int which = 0; which < 2; ++which) {
    const std::vector<float>& wm = which == 0 ? w.w_k : w.w_v;
    const std::vector<float>& bm = which == 0 ? w.b_k : w.b_v;
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> p = which == 0 ? cached_key(cache, id, h, t) : cached_value(cache, id, h, t);
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
// the outputs, and updates the model. Checks compare against reference_forward over a sequence's history, at the
// policy of the layer's compute type and the cache's storage type (layer_tolerance; f32 and f32 by default).

inline KvCacheOptions pool(int64_t block_tokens, int64_t capacity_tokens, DType kv) {
  KvCacheOptions o = pool(block_tokens, capacity_tokens);
  o.dtype = kv;
  return o;
}

struct Harness {
  Config cfg;
  Weights w;
  DType compute, kv;  // the layer's compute type, the cache's storage type
  WeightFormat weights;
  CausalSelfAttention block;
  KvCache cache;
  BlockModel model;
  std::map<SequenceId, SeqTrack> seqs;
  Rng rng;
  Isa isa;
  int threads;
  Workspace ws;
  int calls = 0;  // alternates the caller's Workspace and the layer's own

  // weights_: the layer's weight format; w then holds the values it computes with (dequantized()), so every
  // reference below runs on them, within dequantized_tolerance.
  Harness(const Config& c, Isa isa_, int64_t block_tokens, int64_t capacity_tokens, uint64_t seed, int threads_,
          DType compute_ = DType::f32, DType kv_ = DType::f32, WeightFormat weights_ = WeightFormat::compute)
      : cfg(c),
        w(Weights::random(c, seed)),
        compute(compute_),
        kv(kv_),
        weights(weights_),
        block(make_block(c, w, isa_, threads_, compute_, weights_)),
        cache(block.config(), pool(block_tokens, capacity_tokens, kv_)),
        rng(seed + 1),
        isa(isa_),
        threads(threads_) {
    cfg = block.config();
    if (weights != WeightFormat::compute) w = dequantized(w.view(cfg), weights);
    model.bt = cache.block_tokens();
    model.total = cache.total_blocks();
  }

  int64_t E() const { return cfg.d_model; }
  int64_t W() const { return cfg.query_width(); }
  Workspace* next_ws() { return (calls++ % 2) ? &ws : nullptr; }
  RunOptions run() const { return RunOptions{.threads = threads}; }
  std::string ctx(const std::string& what) const {
    return label(isa, threads, what) + " | " + test::describe(cfg) + " block_tokens=" + std::to_string(model.bt) +
           " compute=" + to_string(compute) + " kv=" + to_string(kv);
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
  // One ragged step: tokens[i] random new tokens for ids[i]; returns the (sum tokens, E) outputs.
  std::vector<float> step(const std::vector<SequenceId>& ids, const std::vector<int64_t>& tokens) {
    int64_t M = 0;
    for (int64_t n : tokens) M += n;
    std::vector<float> x = random_uniform(static_cast<size_t>(M * W()), rng.g, -2.0f, 2.0f);
    return step_with(ids, tokens, x);
  }
  std::vector<float> step_with(const std::vector<SequenceId>& ids, const std::vector<int64_t>& tokens,
                               const std::vector<float>& x) {
    const int64_t M = static_cast<int64_t>(x.size()) / W();
    std::vector<float> out(static_cast<size_t>(M * E()), kNaN);
    block.step(cache, ids.data(), tokens.data(), static_cast<int64_t>(ids.size()), x.data(), out.data(), run(),
               next_ws());
    int64_t row = 0;
    for (size_t b = 0; b < ids.size(); ++b) {
      SeqTrack& s = seqs.at(ids[b]);
      const int64_t n = tokens[b];
      s.x.insert(s.x.end(), x.begin() + row * W(), x.begin() + (row + n) * W());
      s.out.insert(s.out.end(), out.begin() + row * E(), out.begin() + (row + n) * E());
      model.append(ids[b], n);
      row += n;
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
  // A fork of the parent's first `prefix` tokens: its history is theirs.
  SequenceId fork(SequenceId parent, int64_t prefix) {
    const SequenceId id = cache.fork(parent, prefix);
    EXPECT_FALSE(seqs.count(id)) << "fork returned id " << id << " which was used before";
    SeqTrack t = seqs.at(parent);
    t.x.resize(static_cast<size_t>(prefix * W()));
    t.out.resize(static_cast<size_t>(prefix * E()));
    seqs[id] = std::move(t);
    model.fork(parent, id, prefix);
    return id;
  }
  void truncate(SequenceId id, int64_t n) {
    cache.truncate(id, n);
    SeqTrack& t = seqs.at(id);
    t.x.resize(static_cast<size_t>(n * W()));
    t.out.resize(static_cast<size_t>(n * E()));
    model.truncate(id, n);
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
    const int64_t K = reduction_length(cfg, N), D = cfg.head_dim();
    return all_close_within(s.out, reference_sequence(cfg, w, s.x),
                            [&](double m) { return dequantized_tolerance(weights, compute, kv, D, K, m); },
                            ctx(what + " | sequence " + std::to_string(id) + " N=" + std::to_string(N) +
                                "; index = token * E + e"));
  }
  // The cached K/V against the f32 projection: for an f32 layer over an f32 cache (others hold rounded values).
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
        if (model.len.at(id) + n > cache.config().context_length) {  // refused, as the append would be
          bool refused = false;
          try {
            cache.blocks_needed(id, n);
          } catch (const Error& e) {
            refused = e.code() == ErrorCode::invalid_argument;
          }
          if (!refused) return fail() << "blocks_needed(" << id << ", " << n << ") past the context was not refused";
          continue;
        }
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

}  // namespace gpt2attn::test
