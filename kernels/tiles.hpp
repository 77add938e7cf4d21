// kernels/tiles.hpp: every kernel tunable in one place, with the reason for each value.
// Changing a number here is justified by `bench/bench_gpt2attn --benchmark_filter=Tiles` (tile sweep).
#pragma once

#include <cstddef>
#include <cstdint>

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

// Keys per tile. The per-call working set is qt (D x BQ) + scores (BK x BQ) + acc (D x BQ) floats: for D=64,
// BQ=64, BK=64 that is 48 KiB, a Zen 5's or Sapphire Rapids' L1d (48 KiB) and more than a Zen 4's (32 KiB), with
// the K and V tiles (2 x 16 KiB) streaming from L2 (1-2 MiB a core). Larger BK amortises the per-tile softmax
// bookkeeping but spills the score tile to L2; a smaller one pays that bookkeeping twice as often. 32 keys took
// 1.00-1.06x the time of 64 on Zen 4, even though its working set (40 KiB) is nearer that L1d (bench/ab.py over
// Core/gpt2-{small,xl}/T:{1024,4096}/threads:{1,2}); docs/perf-log.md has the other sizes tried.
inline constexpr int kKeyTile = 64;

// The score dot product over the head size D is summed in chunks of kScoreChunk: each chunk in fresh registers,
// then added to the partial score held in the score tile. One fp32 accumulator over all of D rounds D partial
// sums as large as the score itself, an error that grows like D; chunks of C cut it to about
// sqrt(D*C + D^2/C). 64 is the head size of every GPT-2 preset, which so takes one chunk and spills nothing;
// larger heads pay one load and add of the score tile per chunk, 1/64 of their score FMAs
// (Tiles/avx512/.../D:128: 33.5 ms against 33.8 with one accumulator). Accuracy figures: docs/accuracy.md.
inline constexpr int kScoreChunk = 64;

// The tiled core prefetches the next key tile's K and V into L2 while it computes on this one when the K and V a
// query tile reads exceed this many bytes: below, they stay in L2 from one query tile to the next and the
// prefetches only cost issue slots. Measured with Core/gpt2-xl/T:8192/threads:1: 0.54 -> 0.58 of peak; at T = 1024
// (512 KiB of K and V per head) prefetching gained nothing (docs/perf-log.md).
inline constexpr int64_t kCorePrefetchMinBytes = int64_t{1} << 20;
// Past the same size, a call takes its query tiles in groups of this many, each key tile in turn for every tile of
// the group (TiledAttention::group), and the engine gives a call that many tiles at once: a key tile then comes from
// L3 or memory once per group instead of once per query tile. The group's state (packed queries, accumulators,
// running max and sum: 33.5 KiB a tile at D = 64) stays in L2. Measured (Core, 2 threads, bench/ab.py, 3 rounds):
// gpt2-small T = 8192 470 -> 402 ms, gpt2-xl 1087 -> 826 ms; groups of 8 were slower than 4 (1.05-1.15x), of 2
// mixed (0.95-1.11x); groups of 4 where K and V fit in L2 were slower than single tiles (T = 1024-2048, 1.13-1.25x).
inline constexpr int kQueryTileGroup = 4;
// The tiled core streams its output past the caches (Vec::stream) where the rows a slice spans, T rows of the
// output's stride (the whole context (T, E) at B = 1), pass this many bytes: below, the context fits in L2 and the
// output projection that reads it next finds it there. Streaming was measured at T >= 1024 (a 3 MiB context at
// gpt2-small): 0.94-0.95 of the core's time at T = 1024 on one thread, 0.89 at T = 4096 on two.
inline constexpr int64_t kStreamOutputMinBytes = int64_t{1} << 20;

// Decode (one query per sequence): a work item is a range of one sequence's keys for every head. A step aims at
// up to kDecodeItemsPerThread items per thread, a multiple of the thread count (engine/split_kv.hpp), and a sequence
// holding more keys than its share is split into several (split-KV). More than one item per thread only while each
// holds at least kDecodeMinSplitKeys keys: its fixed cost (scaling H queries, merging H x D floats) stays under a few
// percent of streaming its keys and values.
// Justified by `bench_gpt2attn --benchmark_filter=Decode`.
inline constexpr int kDecodeItemsPerThread = 4;
inline constexpr int kDecodeMinSplitKeys = 256;
// Decode's few-row projections (kernels/linear_f32*) keep a block of RB rows x PG 16-output panels in registers:
// per k, PG * 16 / lanes weight loads and RB broadcasts feed RB * PG * 16 / lanes FMAs.
//   AVX-512: RB=8, PG=3: 24 accumulators + 3 weights + 1 broadcast = 28 of 32 zmm, 11 loads per 24 FMAs; with
//            its weights in L2 one Zen 5 core runs it at 190-220 GFLOP/s (one panel x 8 rows: 140). 8 rows split
//            B = 16 and 64 evenly; 4 panels x 6 rows measured no better.
//   AVX2:    RB=6, PG=1: 12 accumulators + 2 + 1 = 15 of 16 ymm; a second panel leaves room for 2 rows only.
//   scalar:  RB=4, PG=1, the compiler's choice.
// The quantized formats' integer kernels keep int32 sums instead: int8 the same blocks (its int32 sums become f32 once
// per chunk); int4 scales its int32 sums into f32 ones at every group of 32 inputs, so it holds both, and an input
// quad's two int16 weight vectors per panel:
//   AVX-512: RB=3, PG=3: 9 int32 + 9 f32 sums + 6 weights + 2 broadcasts + 3 scales = 29 zmm (against RB=4, PG=2, a
//            decode step B=1 over int4 weights, bench/ab.py 5 rounds: gpt2-xl 0.976x, gpt2-small 0.894x the time);
//   AVX2:    RB=2, PG=1: 4 + 4 + 4 + 2 + 2 = 16 ymm.
// linear_row_block(lanes, int4), linear_panel_group(lanes, int4).
constexpr int linear_row_block(int lanes, bool int4 = false) {
  if (int4) return lanes >= 16 ? 3 : (lanes == 8 ? 2 : 4);
  return lanes >= 16 ? 8 : (lanes == 8 ? 6 : 4);
}
constexpr int linear_panel_group(int lanes, [[maybe_unused]] bool int4 = false) { return lanes >= 16 ? 3 : 1; }
// ... over K in equal chunks of at most kLinearKChunk: a group's chunk (3 x 256 x 64 B = 48 KiB, L1-sized) is
// re-read by every row block from L1/L2 while the next chunk is prefetched. 128 to 768 measured within noise of
// each other in cold decode steps; 256 had the best medians.
inline constexpr int kLinearKChunk = 256;
// The engine splits each projection into about this many runs of whole panel groups per thread, dynamically
// scheduled (engine/serving.cpp, panel_items). One: a run's kernel prefetches each chunk's successor, so only a
// run's first chunk starts cold. The output projection of a gpt2-small B = 16 step (weights cold, 2 threads) took
// 0.86-0.88x the time of four runs a thread, timed call by call (docs/perf-log.md).
inline constexpr int kLinearItemsPerThread = 1;
// ... and at most this many panel groups a run (2.4 MB of bf16 weights at K = 768), so a large matrix (the LM head's
// 50257 outputs) is many runs, and a thread whose vCPU the host takes away for a while does not hold up the call: the
// LM head at M = 16 (bf16, 2 threads, Xeon VM) took 5.6-5.7 ms a call against 6.3-6.4 with one run a thread in three
// of four alternated runs, where the slow vCPU came and went. The runs are a multiple of the team's size, of equal
// length (engine/few_rows.cpp, panel_items).
inline constexpr int64_t kLinearMaxItemGroups = 32;

// A ragged step (CausalSelfAttention::step): an entry of at most kStepDecodeTokens new tokens (a decode token, a
// draft to verify, a short chunk) runs on the decode kernel, its tokens sharing each pass over its keys
// (DecodeArgs::tokens), split across threads like a decode step's; a longer one on the tiled kernel by query tiles.
// Over a cold paged cache the decode kernel's block-order streaming with prefetch beats the tiled kernel's head-by-head
// reads up to about 64 tokens and loses from 128 on. The step's attention stage, decode kernel against tiled kernel
// (Zen 3, 2 threads, gpt2-small, 1024 cached tokens a sequence, `gpt2attn bench --mode step --cache cold`, timed
// inside the step): 16 chunks of 32 tokens + 16 decode tokens 28 against 36 ms, 8 x 64 + 4 decode 19 against 25 ms,
// 4 x 128 + 4 decode 31 against 19 ms. 32 keeps the decode kernel's scratch (H x 32 query rows) small.
// A step of at most kStepFewRowTokens tokens runs its projections on the few-row kernel (one pass over the fused
// W_qkv; no oneDNN, so nothing allocated), a longer one on oneDNN's GEMMs: at 64 and 128 tokens the two measured
// alike, at 528 the few-row kernel took 72 ms a step against oneDNN's 57.
inline constexpr int64_t kStepDecodeTokens = 32;
inline constexpr int64_t kStepFewRowTokens = 64;
// Rows a few-row work item takes where a call has more (RunOptions::batch_invariant keeps long steps on the few-row
// kernel; LinearPaths::few_rows): an item streams its panels once per block of rows, and the block of x (256 x K
// floats, 768 KiB at K = 768) stays in L2 across them rather than coming from memory for every panel group.
inline constexpr int64_t kFewRowBlock = 256;

// The decode kernel scores at most this many keys of a block at once (one head's run): it bounds the kernel's
// scratch for any block size, and is above the default block (kKeyTile), so default blocks are scored whole.
inline constexpr int kDecodeMaxScoreKeys = 256;

// The decode kernel streams K and V with software prefetch this many bytes ahead (16 f32 rows at D = 64), into L2,
// following the sequence's block table across blocks (DecodeAttention::Ahead): it takes a cold gpt2-small B=16
// T=1024 step (gpt2attn bench --mode decode --cache cold) from 3.4 to 2.0 ms; 2, 8 and 16 KiB ahead were slower
// than 4 for every cache dtype. In bytes, not rows, so a bf16 or int8 cache keeps as many lines in flight as f32.
inline constexpr size_t kDecodePrefetchBytes = 4096;

}  // namespace gpt2attn::kernels::tiles
