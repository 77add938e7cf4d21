// tests/test_split_kv.cpp: decode's split-KV plan (engine/split_kv.hpp): how many work items a step aims at, how
// many each sequence gets, and the key ranges they cover. The decode results themselves are checked against the
// naive reference by the KV-cache suites, which run every split this plan makes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/split_kv.hpp"

namespace gpt2attn::detail {
namespace {

using kernels::tiles::kDecodeItemsPerThread;
using kernels::tiles::kDecodeMinSplitKeys;

TEST(SplitKv, TargetIsAMultipleOfTheThreads) {
  for (int threads = 1; threads <= 64; ++threads) {
    for (int64_t total : {int64_t{1}, int64_t{7}, int64_t{255}, int64_t{1025}, int64_t{16400}, int64_t{1} << 30}) {
      const int64_t target = decode_item_target(total, threads);
      EXPECT_EQ(target % threads, 0) << threads << " threads, " << total << " keys";
      EXPECT_GE(target, threads);
      EXPECT_LE(target, int64_t{kDecodeItemsPerThread} * threads);
      // More than one item a thread only while each keeps kDecodeMinSplitKeys keys.
      if (target > threads) {
        EXPECT_GE(total / target, kDecodeMinSplitKeys) << threads << " threads, " << total;
      }
    }
  }
}

TEST(SplitKv, OneThreadSplitsOnlyLongSequences) {
  EXPECT_EQ(decode_item_target(2 * kDecodeMinSplitKeys - 1, 1), 1);
  EXPECT_EQ(decode_item_target(2 * kDecodeMinSplitKeys, 1), 2);
  EXPECT_EQ(decode_item_target(1025, 1), 4);
  EXPECT_EQ(decode_item_target(int64_t{1} << 20, 1), kDecodeItemsPerThread);
}

// The case the rule is for: one gpt2-small sequence of 1024 cached tokens on 2 threads splits in 4 even items, two a
// thread (the earlier rule made 5: three for one thread, two for the other).
TEST(SplitKv, OneSequenceSplitsEvenlyAcrossTheThreads) {
  const int64_t n = 1025;
  const int64_t target = decode_item_target(n, 2);
  EXPECT_EQ(target, 4);
  EXPECT_EQ(decode_splits(n, n, target), 4);
  for (int threads = 2; threads <= 32; ++threads) {
    for (int64_t len : {int64_t{2}, int64_t{33}, int64_t{129}, int64_t{1025}, int64_t{4097}, int64_t{32769}}) {
      const int64_t t = decode_item_target(len, threads);
      EXPECT_EQ(decode_splits(len, len, t), std::min(t, len)) << threads << " threads, " << len << " keys";
    }
  }
}

TEST(SplitKv, RangesPartitionTheKeysEvenly) {
  for (int64_t n = 1; n <= 300; ++n) {
    for (int64_t splits = 1; splits <= n && splits <= 40; ++splits) {
      int64_t next = 0, shortest = n, longest = 0;
      for (int64_t s = 0; s < splits; ++s) {
        const KeyRange r = decode_split_range(n, splits, s);
        ASSERT_EQ(r.first, next) << n << " keys, split " << s << " of " << splits;
        ASSERT_LT(r.first, r.end) << "empty split " << s << " of " << splits << " over " << n << " keys";
        // Only the last split ends at n: it alone stores the new token's K/V rows.
        ASSERT_EQ(r.end == n, s == splits - 1);
        shortest = std::min(shortest, r.end - r.first);
        longest = std::max(longest, r.end - r.first);
        next = r.end;
      }
      EXPECT_EQ(next, n);
      EXPECT_LE(longest - shortest, 1) << n << " keys in " << splits;
    }
  }
}

// Mixed batches: every sequence gets at least one item and at most one a key, and the step's items stay within the
// bound decode's workspace is sized for (decode_max_items, B + kDecodeItemsPerThread * threads).
TEST(SplitKv, BatchItemsStayWithinTheWorkspaceBound) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int threads = 1 + static_cast<int>(rng() % 24);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 70);
    std::vector<int64_t> n(static_cast<size_t>(B));
    int64_t total = 0;
    for (int64_t& len : n) {
      len = 1 + static_cast<int64_t>(rng() % (trial % 2 ? 40 : 5000));
      total += len;
    }
    const int64_t target = decode_item_target(total, threads);
    int64_t items = 0, invariant_items = 0;
    for (int64_t len : n) {
      const int64_t s = decode_splits(len, total, target);
      ASSERT_GE(s, 1);
      ASSERT_LE(s, len);
      items += s;
      // batch_invariant's split: a function of the length alone, 1 to kDecodeItemsPerThread ranges, none empty.
      const int64_t v = decode_invariant_splits(len);
      ASSERT_GE(v, 1);
      ASSERT_LE(v, std::min<int64_t>(len, kDecodeItemsPerThread));
      ASSERT_EQ(v, std::min<int64_t>((len + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys, kDecodeItemsPerThread));
      invariant_items += v;
    }
    ASSERT_EQ(decode_max_items(B, threads), (B + threads) * int64_t{kDecodeItemsPerThread});
    EXPECT_LE(items, decode_max_items(B, threads)) << B << " sequences, " << threads << " threads";
    EXPECT_LE(invariant_items, decode_max_items(B, threads)) << B << " sequences, " << threads << " threads";
    EXPECT_GE(items, std::min<int64_t>(target, total)) << B << " sequences, " << threads << " threads";
  }
}

}  // namespace
}  // namespace gpt2attn::detail
