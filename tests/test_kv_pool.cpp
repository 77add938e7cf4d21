// tests/test_kv_pool.cpp: the KV pool's lease protocol (engine/kv_cache.hpp) that the layer's calls rely on: a
// failed call is undone exactly, copy-on-write is counted once per block across a batch, busy sequences are
// refused; and decode at thread counts above the machine's cores, and with a cache whose context differs from
// the layer's. The layer-level behaviour lives in test_kv_cache_*.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "engine/kv_cache.hpp"
#include "gpt2attn/gpt2attn.hpp"
#include "tests/file_test_util.hpp"
#include "tests/kv_harness.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::block_of;
using test::cached_key;
using test::cached_value;
using test::Dtype;
using test::random_uniform;
using test::reduction_length;

Config small_config(int64_t context = 64) { return test::small_causal_config(context); }

// The bytes of every block some sequence holds (a free block's bytes mean nothing), the lengths and the pool
// counts: what "the cache is as it was" means.
struct Snapshot {
  std::vector<uint32_t> pool;  // bit patterns: unwritten slots of a block may hold NaNs, which never compare equal
  std::vector<int64_t> lengths;
  int64_t free_blocks;
  bool operator==(const Snapshot&) const = default;
};
Snapshot snapshot(KvCache& cache, const std::vector<SequenceId>& ids) {
  KvCache::Impl& p = cache.impl();
  const int64_t words = static_cast<int64_t>(p.block_bytes / sizeof(uint32_t));
  Snapshot s{std::vector<uint32_t>(p.nblocks * words), {}, cache.free_blocks()};
  std::memcpy(s.pool.data(), p.pool.get(), s.pool.size() * sizeof(uint32_t));
  for (int64_t b = 0; b < p.nblocks; ++b) {
    if (p.refcount[b] == 0) std::fill_n(s.pool.begin() + b * words, words, 0u);
  }
  for (SequenceId id : ids) s.lengths.push_back(cache.length(id));
  return s;
}

void fill(CausalSelfAttention& layer, KvCache& cache, SequenceId seq, int64_t T, std::mt19937_64& rng) {
  const int64_t d_in = layer.config().query_width();
  const std::vector<float> x = random_uniform(static_cast<size_t>(T * d_in), rng);
  std::vector<float> out(static_cast<size_t>(T * layer.config().d_model));
  layer.extend(cache, seq, x.data(), T, out.data());
}

// A call that fails after begin_append (oneDNN could) ends with end_append(false): the blocks it took, and a
// copy-on-write copy, are returned, so every count and byte is as before and a retry behaves like a first try.
TEST(KvPool, FailedAppendIsUndone) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 1));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 64});
  std::mt19937_64 rng(2);
  const SequenceId parent = cache.create();
  fill(layer, cache, parent, 6, rng);               // blocks 0 (full) and 1 (half), shared below
  const SequenceId child = cache.fork(parent);
  const std::vector<SequenceId> ids = {parent, child};
  const Snapshot before = snapshot(cache, ids);
  const int64_t needed = cache.blocks_needed(child, 7);  // a copy of block 1 + 2 new blocks
  EXPECT_EQ(needed, 3);

  KvCache::Impl& p = cache.impl();
  std::byte* tables[16];
  int64_t length = -1;
  p.begin_append(&child, 1, 7, c.context_length, tables, 16, &length);
  EXPECT_EQ(length, 6);
  EXPECT_EQ(cache.free_blocks(), before.free_blocks - 3);
  EXPECT_NE(tables[1], p.block(block_of(cache, parent, 4)));  // the child's block 1 is a copy now
  p.end_append(&child, 1, 7, /*success=*/false);

  EXPECT_TRUE(snapshot(cache, ids) == before) << "pool bytes, lengths or free blocks changed by a failed call";
  EXPECT_EQ(cache.blocks_needed(child, 7), needed);
  // The child still shares the parent's block: a real append copies it and leaves the parent untouched.
  const std::vector<float> parent_k = cached_key(cache, parent, 1, 5);
  fill(layer, cache, child, 7, rng);
  EXPECT_EQ(cached_key(cache, parent, 1, 5), parent_k);
  EXPECT_EQ(cache.free_blocks(), before.free_blocks - 3);
}

// A parent and its fork, sharing a half-filled block, decoded in one batch: the first copies the block, the
// second then holds it alone and writes in place, so the call needs one block, not two.
TEST(KvPool, CopyOnWriteCountedOncePerBlockInABatch) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 3));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 8});  // 2 blocks
  std::mt19937_64 rng(4);
  const SequenceId parent = cache.create();
  fill(layer, cache, parent, 3, rng);  // one half-filled block
  const SequenceId child = cache.fork(parent);
  ASSERT_EQ(cache.free_blocks(), 1);
  const SequenceId both[2] = {parent, child};
  const std::vector<float> x = random_uniform(static_cast<size_t>(2 * c.d_model), rng);
  std::vector<float> out(static_cast<size_t>(2 * c.d_model));
  EXPECT_NO_THROW(layer.decode(cache, both, 2, x.data(), out.data()));
  EXPECT_EQ(cache.free_blocks(), 0);
  EXPECT_EQ(cache.length(parent), 4);
  EXPECT_EQ(cache.length(child), 4);
}

// While a call holds a sequence, fork, release and another append of it are refused and change nothing.
TEST(KvPool, BusySequenceIsRefused) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 5));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 32});
  std::mt19937_64 rng(6);
  const SequenceId seq = cache.create();
  fill(layer, cache, seq, 5, rng);
  KvCache::Impl& p = cache.impl();
  std::byte* tables[16];
  int64_t length = 0;
  p.begin_append(&seq, 1, 1, c.context_length, tables, 16, &length);
  const int64_t free_blocks = cache.free_blocks();
  auto refused = [&](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return e.code() == ErrorCode::invalid_argument && std::string(e.what()).find("in use") != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused([&] { cache.fork(seq); }));
  EXPECT_TRUE(refused([&] { cache.release(seq); }));
  EXPECT_TRUE(refused([&] { fill(layer, cache, seq, 2, rng); }));
  EXPECT_EQ(cache.free_blocks(), free_blocks);
  p.end_append(&seq, 1, 1, /*success=*/false);
  EXPECT_EQ(cache.length(seq), 5);
  EXPECT_NO_THROW(cache.release(seq));
}

// More threads than cores and than work items (oversubscribed on purpose): split-KV bounds, scratch slots and
// merges hold; the result equals the single-thread one within the fp32 tolerance.
TEST(KvPool, DecodeAtManyThreadsEqualsOneThread) {
  const Config c = small_config(700);
  const Weights w = Weights::random(c, 7);
  for (int threads : {3, 5, 8}) {
    CausalSelfAttention one(c, w, {.threads = 1}), many(c, w, {.threads = threads});
    KvCache c1(c, KvCacheOptions{.block_tokens = 16, .capacity_tokens = 2048});
    KvCache c2(c, KvCacheOptions{.block_tokens = 16, .capacity_tokens = 2048});
    std::mt19937_64 r1(8), r2(8);
    const int64_t lens[] = {1, 650, 20};
    std::vector<SequenceId> s1, s2;
    for (int64_t L : lens) {
      s1.push_back(c1.create());
      fill(one, c1, s1.back(), L, r1);
      s2.push_back(c2.create());
      fill(many, c2, s2.back(), L, r2);
    }
    std::mt19937_64 rx(9);
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> x = random_uniform(static_cast<size_t>(3 * c.d_model), rx);
      std::vector<float> y1(x.size()), y2(x.size());
      one.decode(c1, s1.data(), 3, x.data(), y1.data());
      many.decode(c2, s2.data(), 3, x.data(), y2.data());
      EXPECT_TRUE(all_close(y2, std::vector<double>(y1.begin(), y1.end()), Dtype::f32, reduction_length(c, 700),
                            "threads=" + std::to_string(threads) + " (got) vs 1 thread, step " + std::to_string(step)));
    }
  }
}

// The layer and the cache may have different context lengths: the shorter one bounds a sequence.
TEST(KvPool, CacheContextDiffersFromLayer) {
  for (int64_t cache_context : {int64_t{20}, int64_t{200}}) {
    const Config lc = small_config(50);
    Config cc = lc;
    cc.context_length = cache_context;
    CausalSelfAttention layer(lc, Weights::random(lc, 10));
    KvCache cache(cc, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 256});
    std::mt19937_64 rng(11);
    const SequenceId seq = cache.create();
    const int64_t limit = std::min<int64_t>(50, cache_context);
    fill(layer, cache, seq, limit - 1, rng);
    const std::vector<float> x = random_uniform(static_cast<size_t>(lc.d_model), rng);
    std::vector<float> y(x.size());
    EXPECT_NO_THROW(layer.decode(cache, &seq, 1, x.data(), y.data()));
    EXPECT_THROW(layer.decode(cache, &seq, 1, x.data(), y.data()), Error) << "past min(layer, cache) context";
    EXPECT_EQ(cache.length(seq), limit);
  }
}

// reserve_serving sizes decode for any cache the layer can serve, including one whose blocks are longer than the
// layer's context (the kernel scores up to kDecodeMaxScoreKeys keys of a block at once): the steps after it do not
// grow the workspace. Before, the scratch was sized for runs of the layer's context (50 keys here) and a cache of
// 128-token blocks made the first decode step allocate.
TEST(KvPool, ReserveServingCoversBlocksLongerThanTheLayersContext) {
  const Config lc = small_config(50);
  Config cc = lc;
  cc.context_length = 512;
  CausalSelfAttention layer(lc, Weights::random(lc, 15));
  KvCache cache(cc, KvCacheOptions{.block_tokens = 128, .capacity_tokens = 512});
  std::mt19937_64 rng(16);
  SequenceId seqs[2] = {cache.create(), cache.create()};
  fill(layer, cache, seqs[0], 40, rng);
  fill(layer, cache, seqs[1], 9, rng);
  Workspace ws;
  layer.reserve_serving(0, 2, 2, &ws);
  const size_t reserved = ws.bytes();
  const std::vector<float> x = random_uniform(static_cast<size_t>(2 * lc.d_model), rng);
  std::vector<float> y(x.size());
  layer.decode(cache, seqs, 2, x.data(), y.data(), RunOptions{.threads = 2}, &ws);
  EXPECT_EQ(ws.bytes(), reserved) << "decode grew the workspace reserve_serving sized";
}

// serving_workspace_bytes() is what reserve_serving() makes a fresh workspace hold, below and above the 2 MiB from
// which workspaces take whole huge pages (it returned the plan's bytes, short of the rounded allocation).
TEST(KvPool, ServingWorkspaceBytesIsWhatReserveHolds) {
  const Config c = small_config(512);
  CausalSelfAttention layer(c, Weights::random(c, 17));
  ASSERT_GE(layer.serving_workspace_bytes(512, 512, 2), size_t{2} << 20) << "the last case must reach huge pages";
  for (const auto& [extend, batch] : {std::pair<int64_t, int64_t>{0, 0}, {0, 3}, {7, 1}, {512, 512}}) {
    Workspace ws;
    layer.reserve_serving(extend, batch, 2, &ws);
    EXPECT_EQ(ws.bytes(), layer.serving_workspace_bytes(extend, batch, 2)) << extend << " tokens, " << batch << " rows";
  }
}

// Decode's few-row projections at a width where every path of kernels/linear_f32 runs: B = 19 (full and ragged
// row blocks on every ISA), K = d_in = 1000 (two K chunks, the second partial), N = 3E = 3000 (a partial last
// panel), D = 125; each sequence's output against the naive reference over its own history.
TEST(KvPool, DecodeProjectionsAtOddWidthsMatchReference) {
  Config c;
  c.d_model = 1000;
  c.num_heads = 8;
  c.context_length = 32;
  c.causal = true;
  const Weights w = Weights::random(c, 12);
  for (Isa isa : compiled_isas()) {
    if (!isa_supported(isa)) continue;
    CausalSelfAttention layer(c, w, {.threads = 2, .isa = isa});
    KvCache cache(c, KvCacheOptions{.block_tokens = 8, .capacity_tokens = 19 * 16});
    std::mt19937_64 rng(13);
    const int64_t B = 19, E = c.d_model;
    std::vector<SequenceId> ids;
    std::vector<std::vector<float>> history(B);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t T = 1 + b % 5;
      history[b] = random_uniform(static_cast<size_t>(T * E), rng);
      std::vector<float> out(history[b].size());
      ids.push_back(cache.create());
      layer.extend(cache, ids.back(), history[b].data(), T, out.data());
    }
    for (int step = 0; step < 2; ++step) {
      const std::vector<float> x = random_uniform(static_cast<size_t>(B * E), rng);
      std::vector<float> y(x.size());
      layer.decode(cache, ids.data(), B, x.data(), y.data());
      for (int64_t b = 0; b < B; ++b) {
        history[b].insert(history[b].end(), x.begin() + b * E, x.begin() + (b + 1) * E);
        const int64_t n = static_cast<int64_t>(history[b].size()) / E;
        AttentionInputs in;
        in.query = TensorView::f32(history[b].data(), {1, n, E});
        const std::vector<double> ref = reference_forward(c, w, in);
        EXPECT_TRUE(all_close(std::vector<float>(y.begin() + b * E, y.begin() + (b + 1) * E),
                              std::vector<double>(ref.end() - E, ref.end()), Dtype::f32, reduction_length(c, n),
                              std::string("[isa=") + to_string(isa) + "] step " + std::to_string(step) +
                                  " sequence " + std::to_string(b) + ": decode (got) vs reference; index e"));
      }
    }
  }
}

// The copy-on-write undo must never hand back a block that left the sequence's keeping. A fork appends into a
// shared, half-filled block X (begin_append copies X); before the call ends, X's other holder is released and a
// third sequence takes every free block and writes its own K/V; then the fork's call fails. The fork must read
// its own keys again, and X must not be both free and held. Before the fix, X went back to the free list on
// the release, the third sequence took and overwrote it, and the undo gave it to the fork: another request's K/V.
TEST(KvPool, FailedCopyOnWriteUndoKeepsTheOriginalOutOfThePool) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 7));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 16});  // 4 blocks
  KvCache::Impl& p = cache.impl();
  std::mt19937_64 rng(8);
  const SequenceId parent = cache.create();
  fill(layer, cache, parent, 6, rng);  // block 0 full, block 1 (X) half-filled
  const SequenceId child = cache.fork(parent);
  ASSERT_EQ(p.audit(), "");
  std::vector<std::vector<float>> child_rows;  // every cached K and V row of the child, before the call
  for (int64_t h = 0; h < c.num_heads; ++h) {
    for (int64_t t = 0; t < 6; ++t) {
      child_rows.push_back(cached_key(cache, child, h, t));
      child_rows.push_back(cached_value(cache, child, h, t));
    }
  }

  std::byte* tables[16];
  int64_t length = -1;
  p.begin_append(&child, 1, 1, c.context_length, tables, 16, &length);  // copies X
  ASSERT_EQ(p.audit(), "");
  cache.release(parent);  // X's other holder goes while the child's call runs
  ASSERT_EQ(p.audit(), "");
  const SequenceId other = cache.create();
  fill(layer, cache, other, 4 * cache.free_blocks(), rng);  // takes every free block and writes it
  ASSERT_EQ(p.audit(), "");
  p.end_append(&child, 1, 1, /*success=*/false);  // the call failed (oneDNN could)
  ASSERT_EQ(p.audit(), "");

  EXPECT_EQ(cache.length(child), 6);
  size_t i = 0;
  for (int64_t h = 0; h < c.num_heads; ++h) {
    for (int64_t t = 0; t < 6; ++t) {
      EXPECT_EQ(cached_key(cache, child, h, t), child_rows[i++])
          << "key h=" << h << " t=" << t << " is not the child's own";
      EXPECT_EQ(cached_value(cache, child, h, t), child_rows[i++])
          << "value h=" << h << " t=" << t << " is not the child's own";
    }
  }
  cache.release(other);
  cache.release(child);
  EXPECT_EQ(p.audit(), "");
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks());
}

// The same race when the call succeeds: the original, released by its other holder meanwhile, returns to the
// pool when the call commits, and no block is lost or counted twice.
TEST(KvPool, CommittedCopyOnWriteReturnsAReleasedOriginal) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 9));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 16});
  KvCache::Impl& p = cache.impl();
  std::mt19937_64 rng(10);
  const SequenceId parent = cache.create();
  fill(layer, cache, parent, 6, rng);
  const SequenceId child = cache.fork(parent);
  std::byte* tables[16];
  int64_t length = -1;
  p.begin_append(&child, 1, 1, c.context_length, tables, 16, &length);
  cache.release(parent);
  EXPECT_EQ(cache.free_blocks(), 1) << "the pinned original must stay out of the pool until the call ends";
  p.end_append(&child, 1, 1, /*success=*/true);
  ASSERT_EQ(p.audit(), "");
  EXPECT_EQ(cache.free_blocks(), 2);  // the original is free now; the child holds block 0 and its copy
  EXPECT_EQ(cache.length(child), 7);
  cache.release(child);
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks());
}

// Every cached K and V row of `seq`'s tokens [0, n), head by head.
std::vector<std::vector<float>> rows_of(KvCache& cache, SequenceId seq, int64_t n) {
  std::vector<std::vector<float>> rows;
  for (int64_t h = 0; h < cache.config().kv_heads(); ++h) {
    for (int64_t t = 0; t < n; ++t) {
      rows.push_back(cached_key(cache, seq, h, t));
      rows.push_back(cached_value(cache, seq, h, t));
    }
  }
  return rows;
}

// While one call's copy-on-write copy is pending, the original it may hand back on failure counts as shared: a
// concurrent append of its other holder copies it rather than write into it. Before, that holder wrote the
// original in place and committed; the failed call then put it back under its own sequence, so the two shared a
// block holding the other's tokens past one length, and the next such round (roles swapped) wrote one sequence's
// K/V over the other's committed tokens.
TEST(KvPool, PinnedOriginalIsNotWrittenInPlace) {
  const Config c = small_config();
  CausalSelfAttention layer(c, Weights::random(c, 11));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 32});
  KvCache::Impl& p = cache.impl();
  std::mt19937_64 rng(12);
  const SequenceId a = cache.create();
  fill(layer, cache, a, 6, rng);  // block 0 full, block 1 (X) half-filled
  const SequenceId b = cache.fork(a);
  const int32_t x = block_of(cache, a, 5);
  const auto a_rows = rows_of(cache, a, 6);
  std::byte* tables[16];
  int64_t length = -1;

  // Round 1: a's call copies X and is pending; b appends a token (its own call) and commits; a's call fails.
  p.begin_append(&a, 1, 1, c.context_length, tables, 16, &length);
  EXPECT_EQ(cache.blocks_needed(b, 1), 1) << "X is pinned by a's pending copy: b's append must copy it";
  fill(layer, cache, b, 1, rng);
  EXPECT_NE(block_of(cache, b, 6), x) << "b wrote into the block a's failure hands back";
  p.end_append(&a, 1, 1, /*success=*/false);
  ASSERT_EQ(p.audit(), "");
  EXPECT_EQ(block_of(cache, a, 5), x);
  EXPECT_EQ(rows_of(cache, a, 6), a_rows);
  const auto b_rows = rows_of(cache, b, 7);

  // Round 2, roles swapped: b's call is pending, a appends and commits, b's call fails. b's committed token 6
  // must still be b's own.
  p.begin_append(&b, 1, 1, c.context_length, tables, 16, &length);
  fill(layer, cache, a, 1, rng);
  p.end_append(&b, 1, 1, /*success=*/false);
  ASSERT_EQ(p.audit(), "");
  EXPECT_EQ(rows_of(cache, b, 7), b_rows) << "a's append changed b's committed K/V";
  EXPECT_EQ(rows_of(cache, a, 6), a_rows);
  cache.release(a);
  cache.release(b);
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks());
}

// blocks_needed refuses what an append would refuse: a negative count, or a length past the cache's context
// (before, INT64_MAX overflowed the block arithmetic and answered 1, and a count past the context a large number).
TEST(KvPool, BlocksNeededRefusesPastTheContext) {
  const Config c = small_config(40);
  CausalSelfAttention layer(c, Weights::random(c, 13));
  KvCache cache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = 12});  // 3 blocks
  std::mt19937_64 rng(14);
  const SequenceId s = cache.create();
  fill(layer, cache, s, 6, rng);
  EXPECT_EQ(cache.blocks_needed(s, 0), 0);
  EXPECT_EQ(cache.blocks_needed(s, 2), 0);
  EXPECT_EQ(cache.blocks_needed(s, 34), 8);  // to the context's end: 10 blocks in all, 2 held
  const auto needed = [&](int64_t tokens) { return [&cache, s, tokens] { cache.blocks_needed(s, tokens); }; };
  EXPECT_TRUE(testutil::ThrowsError(needed(35), ErrorCode::invalid_argument, "exceeds context_length=40"));
  EXPECT_TRUE(testutil::ThrowsError(needed(std::numeric_limits<int64_t>::max()), ErrorCode::invalid_argument,
                                    "exceeds context_length=40"));
  EXPECT_TRUE(testutil::ThrowsError(needed(-1), ErrorCode::invalid_argument, "must be >= 0"));
}

}  // namespace
}  // namespace gpt2attn
