// engine/split_kv.hpp: how decode() cuts a step's attention into work items (split-KV). An item is one range of
// one sequence's keys, for every head; the team takes items from a dynamic schedule, and a sequence's partial
// softmax states are merged by whichever of its items ends last. Pure arithmetic on key counts.
#pragma once

#include <algorithm>
#include <cstdint>

#include "engine/util.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn::detail {

// How many items a step of `total_keys` keys (every sequence's cached keys plus its new one) aims at: k per thread,
// k as large as kDecodeItemsPerThread while every item keeps at least kDecodeMinSplitKeys keys, and at least one
// per thread. A multiple of the thread count, so that a single sequence splits evenly: the earlier rule (splits of
// at least 256 keys, whatever their count) cut gpt2-small B = 1, T = 1024 in 5 items on 2 threads, 3 for one thread
// and 2 for the other. Measured with an instrumented build (each thread's attention stage plus its barrier wait,
// the slower thread's, median of 4 alternated rounds of `gpt2attn bench --mode decode --cache cold --threads 2
// --batch 1`, f32 cache): T = 1024 250 -> 215 us (the step 0.53 -> 0.48 ms), T = 512 149 -> 118 us, T = 128 78 ->
// 49 us, T = 32 44 -> 30 us; int8 at T = 1024 105 -> 91 us; T = 2048, B = 3 and B = 16 within noise. One thread
// still splits a long sequence, as before (unsplit measured within noise of it), so the soak test's one-thread
// calls keep the merge running under its pool operations.
inline int64_t decode_item_target(int64_t total_keys, int threads) {
  threads = std::max(threads, 1);
  const int64_t per_thread = std::clamp<int64_t>(total_keys / (int64_t{threads} * kernels::tiles::kDecodeMinSplitKeys),
                                                 1, kernels::tiles::kDecodeItemsPerThread);
  return per_thread * threads;
}

// Items of a sequence of n keys (n >= 1) in a step of total_keys keys aiming at `target` items: its share of the
// target, rounded up, at least one and at most one per key. A single sequence gets exactly min(target, n). Summed
// over B sequences the items stay at most target + B <= decode_max_items(B, threads).
inline int64_t decode_splits(int64_t n, int64_t total_keys, int64_t target) {
  return std::clamp<int64_t>(ceil_div(n * target, total_keys), 1, n);
}

// The most items a step of B sequences on `threads` threads makes (decode_item_target's largest target plus one
// rounding per sequence): what decode's workspace plan sizes its partial softmax states for.
// With RunOptions::batch_invariant a sequence takes up to kDecodeItemsPerThread items of its own
// (decode_invariant_splits): the bound covers both.
inline int64_t decode_max_items(int64_t B, int threads) {
  return checked_add(checked_mul(B, kernels::tiles::kDecodeItemsPerThread, "decode: work items"),
                     int64_t{kernels::tiles::kDecodeItemsPerThread} * std::max(threads, 1), "decode: work items");
}

// RunOptions::batch_invariant's split of a sequence of n keys: ranges of kDecodeMinSplitKeys keys, at most
// kDecodeItemsPerThread of them, a function of n alone (so of the sequence alone, not of its step or the threads).
inline int64_t decode_invariant_splits(int64_t n) {
  return std::clamp<int64_t>(ceil_div(n, kernels::tiles::kDecodeMinSplitKeys), 1, kernels::tiles::kDecodeItemsPerThread);
}

// Keys [first, end) of item s (0 <= s < splits <= n) of a sequence of n keys: the splits partition [0, n), none
// empty, their sizes at most one apart; only the last ends at n (it holds the new token, whose K/V rows it stores).
struct KeyRange {
  int64_t first, end;
};
inline KeyRange decode_split_range(int64_t n, int64_t splits, int64_t s) {
  return {s * n / splits, (s + 1) * n / splits};
}

}  // namespace gpt2attn::detail
