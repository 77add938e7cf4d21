// kernels/tiles.hpp: every kernel tunable in one place, with the reason for each value.
// Changing a number here is justified by `bench/bench_gpt2attn --benchmark_filter=Tiles` (tile sweep).
#pragma once

namespace gpt2attn::kernels::tiles {

// Micro-kernel register blocking, per instruction set:
//   query_vectors (QV) x row_block (R) accumulators + QV loads + 1 broadcast must fit the register file.
//   AVX-512: 32 zmm -> QV=4, R=6: 24 accumulators + 4 + 1 = 29. BQ = 4 x 16 = 64 queries per tile.
//   AVX2:    16 ymm -> QV=2, R=6: 12 accumulators + 2 + 1 = 15. BQ = 2 x 8 = 16 queries per tile.
//   scalar:  QV=4, R=4: the compiler keeps 16 floats in registers; BQ = 4.
// Per FMA step the score kernel issues QV loads + R broadcasts for QV*R FMAs (AVX-512: 10 for 24), below
// the two load ports' budget, so it stays FMA-bound.
struct Blocking {
  int query_vectors;
  int row_block;
};
inline constexpr Blocking kAvx512{4, 6};
inline constexpr Blocking kAvx2{2, 6};
inline constexpr Blocking kScalar{4, 4};

// Keys per tile. The per-call working set is qt (D x BQ) + scores (BK x BQ) + acc (D x BQ) floats:
// for D=64, BQ=64, BK=64 that is 48 KiB = L1d here (48 KiB), with the K and V tiles (2 x 16 KiB) streaming
// from L2 (2 MiB). Larger BK amortises the per-tile softmax bookkeeping but spills the score tile to L2.
inline constexpr int kKeyTile = 64;

// Decode (one query per sequence) splits a sequence's keys across threads (split-KV) so that every thread
// gets about kDecodeItemsPerThread work items of similar size: when B*H is below that, or one sequence is
// much longer than a thread's share. A split holds at least kDecodeMinSplitKeys keys: its fixed cost (the
// query, the merge of D floats) stays under a few percent of streaming its keys and values.
// Justified by `bench_gpt2attn --benchmark_filter=Decode`.
inline constexpr int kDecodeItemsPerThread = 4;
inline constexpr int kDecodeMinSplitKeys = 256;

}  // namespace gpt2attn::kernels::tiles
