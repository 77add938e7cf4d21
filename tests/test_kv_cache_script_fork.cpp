// tests/test_kv_cache_script_fork.cpp: many sequences sharing one KV pool, on every instruction set this CPU runs:
// a random create/extend/decode/fork/release script checked after every step against a model of block
// accounting, blocks reused after release, pool sizing, and forks with copy on write. Each sequence's outputs are
// checked against reference_forward over its own history; the single-sequence numerics are in
// test_kv_cache_prefill_decode.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::block_of;
using test::BlockModel;
using test::CacheSnapshot;
using test::Harness;
using test::IsaTest;
using test::serving_config;
using test::pool;
using test::Rng;
using test::same_snapshot;
using test::snapshot;

// =============================================================================================================
// Many sequences: a random script, block reuse, forks.

class KvCacheScript : public IsaTest {};

// ~40 random operations (create + prefill, extend a chunk, decode a random subset, fork, release) on a pool that
// always holds the live set; the bookkeeping follows the block model after every operation, each sequence's
// outputs match the reference over its own history when it is released, and blocks are reused.
TEST_P(KvCacheScript, RandomCreateExtendDecodeForkRelease) {
  Harness h(serving_config(48, 3, 40, 96), isa(), 8, 24 * 8, 130, 2);
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
  Harness h(serving_config(32, 2, 0, 64), isa(), 4, 40, 140, 1);  // 10 blocks
  ASSERT_EQ(h.cache.total_blocks(), 10);
  const SequenceId a = h.create(), b = h.create();
  h.extend(a, 18);  // 5 blocks
  h.extend(b, 20);  // 5 blocks
  ASSERT_EQ(h.cache.free_blocks(), 0);
  SequenceId victim = a;
  for (int round = 0; round < 4; ++round) {
    const int64_t L = h.model.len.at(victim);
    std::set<int32_t> released_blocks;
    for (int64_t t = 0; t < L; t += 4) released_blocks.insert(block_of(h.cache, victim, t));
    EXPECT_TRUE(h.matches_reference(victim, "round " + std::to_string(round)));
    h.release(victim);
    EXPECT_TRUE(h.accounting("round " + std::to_string(round) + " after release"));
    const SequenceId n = h.create();
    h.extend(n, 9);
    for (int s = 0; s < 7 && h.model.needed(n, 1) <= h.model.free(); ++s) h.decode({n});
    std::set<int32_t> new_blocks;
    for (int64_t t = 0; t < h.model.len.at(n); t += 4) new_blocks.insert(block_of(h.cache, n, t));
    for (int32_t b : new_blocks) {
      EXPECT_TRUE(released_blocks.count(b)) << h.ctx("round " + std::to_string(round)) << ": new sequence " << n
                                            << " got block " << b
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
  const Config c = serving_config(48, 3, 0, 1024);  // D = 16
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

class KvCacheFork : public IsaTest {};

// A parent and its fork, each against the reference over its own history: outputs and cached K/V.
void expect_both_match(const Harness& h, SequenceId p, SequenceId c, const std::string& tag) {
  EXPECT_TRUE(h.matches_reference(p, tag + " parent"));
  EXPECT_TRUE(h.matches_reference(c, tag + " child"));
  EXPECT_TRUE(h.kv_ok(p, tag + " parent"));
  EXPECT_TRUE(h.kv_ok(c, tag + " child"));
}

// Parent lengths 6 (partially filled shared last block: copy on write) and 8 (full blocks: never written again);
// the child and the parent continue with different tokens, each matching its own reference, and neither's
// cached K/V changes when the other appends.
TEST_P(KvCacheFork, ChildDivergesWithCopyOnWrite) {
  for (int64_t L : {int64_t{6}, int64_t{8}}) {
    Harness h(serving_config(32, 2, 24, 64), isa(), 4, 64, 150 + L, 2);
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
    expect_both_match(h, p, c, tag);

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
  Harness h(serving_config(32, 2, 0, 64), isa(), 4, 64, 160, 1);
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
// fork(parent, prefix) at every place a prefix can end (empty, inside the first block, on a boundary, inside a later
// one, the whole parent): the child shares the blocks of its tokens and no more, takes no block until it appends, then
// continues as the reference over the parent's first `prefix` tokens and its own; neither side's cached K/V changes
// when the other appends.
TEST_P(KvCacheFork, PrefixForkSharesOnlyThePrefixBlocks) {
  for (int64_t prefix : {int64_t{0}, int64_t{3}, int64_t{4}, int64_t{6}, int64_t{10}}) {
    Harness h(serving_config(32, 2, 24, 64), isa(), 4, 64, 170 + prefix, 2);
    const std::string tag = "prefix " + std::to_string(prefix) + " of 10";
    const SequenceId p = h.create();
    h.extend(p, 10);
    const int64_t free_before = h.cache.free_blocks();
    const SequenceId c = h.fork(p, prefix);
    ASSERT_TRUE(h.accounting(tag + ", after fork"));
    EXPECT_EQ(h.cache.free_blocks(), free_before) << h.ctx(tag) << ": a prefix fork must share, not copy";
    EXPECT_EQ(h.cache.length(c), prefix);
    for (int64_t t = 0; t < prefix; ++t) EXPECT_EQ(block_of(h.cache, c, t), block_of(h.cache, p, t)) << tag;
    const CacheSnapshot parent0 = snapshot(h.cache, {p});
    h.extend(c, 5);
    ASSERT_TRUE(h.accounting(tag + ", child extended"));
    EXPECT_TRUE(same_snapshot(parent0, snapshot(h.cache, {p}), false))
        << h.ctx(tag) << ": the child changed the parent";
    const CacheSnapshot child1 = snapshot(h.cache, {c});
    h.decode({p});
    EXPECT_TRUE(same_snapshot(child1, snapshot(h.cache, {c}), false)) << h.ctx(tag) << ": the parent changed the child";
    h.decode({c, p});
    ASSERT_TRUE(h.accounting(tag + ", both decoded"));
    expect_both_match(h, p, c, tag);
    h.release(p);
    h.release(c);
    EXPECT_EQ(h.cache.free_blocks(), h.cache.total_blocks()) << h.ctx(tag);
  }
}

// truncate: the blocks past the new length go back unless a fork holds them; a kept block that a fork still shares
// is copied on the next append (the fork's tokens never change); appends after it continue the reference over the
// kept history; truncate to 0 and to the same length.
TEST_P(KvCacheFork, TruncateGivesBackBlocksAndKeepsForksIntact) {
  Harness h(serving_config(32, 2, 24, 64), isa(), 4, 64, 180, 2);
  const SequenceId a = h.create();
  h.extend(a, 10);  // 3 blocks
  const int64_t free0 = h.cache.free_blocks();
  h.truncate(a, 5);  // 2 blocks: one back
  ASSERT_TRUE(h.accounting("truncated 10 -> 5"));
  EXPECT_EQ(h.cache.free_blocks(), free0 + 1);
  h.extend(a, 4);
  h.decode({a});
  EXPECT_TRUE(h.matches_reference(a, "extended after truncate"));
  EXPECT_TRUE(h.kv_ok(a, "extended after truncate"));
  h.truncate(a, h.cache.length(a));  // nothing dropped
  ASSERT_TRUE(h.accounting("truncated to its own length"));

  const SequenceId f = h.fork(a);  // shares all of a's blocks
  const CacheSnapshot fork0 = snapshot(h.cache, {f});
  const int64_t free1 = h.cache.free_blocks();
  h.truncate(a, 6);  // the fork holds every block: none comes back
  ASSERT_TRUE(h.accounting("truncated under a fork"));
  EXPECT_EQ(h.cache.free_blocks(), free1) << h.ctx("a block the fork holds was freed");
  h.decode({a});  // writes into the shared partial block: a copy, not the fork's
  h.extend(a, 3);
  ASSERT_TRUE(h.accounting("appended after the truncate under a fork"));
  EXPECT_TRUE(same_snapshot(fork0, snapshot(h.cache, {f}), false)) << h.ctx("the truncated sequence changed its fork");
  EXPECT_TRUE(h.matches_reference(a, "truncated under a fork, continued"));
  EXPECT_TRUE(h.matches_reference(f, "the fork"));

  h.truncate(a, 0);
  ASSERT_TRUE(h.accounting("truncated to 0"));
  h.extend(a, 2);
  EXPECT_TRUE(h.matches_reference(a, "restarted after truncate to 0"));
  h.release(a);
  h.release(f);
  EXPECT_EQ(h.cache.free_blocks(), h.cache.total_blocks());
}

// Out-of-range lengths and unknown ids are refused by name, with nothing changed.
TEST_P(KvCacheFork, TruncateAndPrefixForkRefuseBadArguments) {
  Harness h(serving_config(32, 2, 24, 64), isa(), 4, 64, 190, 1);
  const SequenceId a = h.create();
  h.extend(a, 6);
  const CacheSnapshot before = snapshot(h.cache, {a});
  const int64_t free = h.cache.free_blocks(), n = h.cache.num_sequences();
  auto refused = [&](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << h.ctx(needle) << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::invalid_argument)) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { h.cache.truncate(a, 7); }, "KvCache::truncate: new_length 7 for sequence");
  refused([&] { h.cache.truncate(a, -1); }, "new_length -1");
  refused([&] { h.cache.truncate(a + 1000, 0); }, "unknown sequence id");
  refused([&] { h.cache.fork(a, 7); }, "KvCache::fork: prefix_tokens 7 of sequence");
  refused([&] { h.cache.fork(a, -1); }, "prefix_tokens -1");
  refused([&] { h.cache.fork(a + 1000, 0); }, "unknown sequence id");
  EXPECT_TRUE(same_snapshot(before, snapshot(h.cache, {a})));
  EXPECT_EQ(h.cache.free_blocks(), free);
  EXPECT_EQ(h.cache.num_sequences(), n);
}

GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheScript);
GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheFork);

}  // namespace
}  // namespace gpt2attn
