// kernels/attention.hpp: the tiled attention core (flash-attention style, online softmax) for one (batch, head)
// slice and a range of query rows: its arguments, its entry points and the algebra. Pure compute on pointers and
// strides: no allocation, no threads, no oneDNN. The engine plans the work and hands each call a scratch slice.
// The algorithm is written once (kernels/attention_impl.hpp), generic over the instruction set, the K/V element
// type and where K/V come from; the micro-kernels (score and P.V tiles) are the only arithmetic a new compute type
// replaces. Each row of kernels/kernel_list.def instantiates it for its (instruction set, compute type, K/V type).
//
// Layouts (one head h of one sequence b; all pointers already offset to that slice):
//   q   (T, D)  row stride ldq    out (T, D)  row stride ldo    (each row's D values contiguous)
//   K, V (Tk, D): contiguous with row strides ldk / ldv, or the KV cache's blocks (kernels/kv_layout.hpp), as
//   described by AttentionArgs::kv (kernels/kv_source.hpp). Key tiles end where a source's run ends (a block
//   boundary), so every tile is one strided (nk, D) slab.
//
// Algorithm. Queries sit in SIMD lanes: a query tile of BQ rows is packed transposed, qt (D, BQ), so the
// score tile s (BK, BQ) = K_tile . qt is a register-blocked outer-product GEMM (summed over D in chunks, see
// tiles::kScoreChunk), and every per-query quantity (running max m, running sum l, rescale alpha) is a
// vertical vector op. With c the units factor below, for each key tile:
//   m_new = max(m, max_j s_j)                 (m = -inf while every key so far was masked)
//   alpha = 2^((m - m_new) c),  p_j = 2^((s_j - m_new) c)   (with m_new = 0 substituted when it is -inf)
//   l     = alpha * l + sum_j p_j
//   acc   = alpha * acc + V_tile^T . p          (acc (D, BQ), unnormalised output, transposed)
// and at the end out_i = acc_i / l_i, or 0 when l_i == 0 (a query that may attend to nothing).
// Dropout multiplies p_j by keep/(1-p) after l has been accumulated: it acts on the normalised weights.
//
// Units, chosen once per call. Without an additive mask, qt is pre-scaled by scale * log2(e): scores are in
// log2 units, c = 1, and exp is a cheap exp2 with no per-element multiply (the measured fast path). An
// additive mask x must instead meet the score where torch adds it, s + x in fp32 natural units: in log2
// units it would be x * log2(e), which is +-inf for |x| > FLT_MAX / log2(e) ~ 2.36e38. Hugging Face writes
// torch.finfo(float32).min for masked positions; a row of it would turn into -inf (treated as fully masked:
// output = the out-projection bias) where torch, whose s + finfo.min rounds to finfo.min for every key, gives
// uniform attention; a mask of +3e38 would give inf - inf = NaN. So a call with an additive mask keeps the
// scores in natural units: qt scaled by `scale` only, s_j = q.k * scale + x_j in fp32 exactly as torch, and
// c = log2(e) applied inside the exponent, after the max subtraction. s_j - m_new <= 0 cannot overflow upward;
// where it overflows downward (s_j = finfo.min, m_new >= 0) it is -inf and p_j = 0, also the exact value;
// equal huge scores give s_j - m_new = 0, p_j = 1: the uniform row torch computes. Clamping x to
// +-FLT_MAX / log2(e) instead would keep one path but merge distinct huge values (finfo.min and -2.4e38 would
// weigh alike; torch gives the first exp(-1e38) = 0 of the second's weight).
//
// Overflow: acc sums p_j v_j before the division by l, so V values whose sum passes FLT_MAX (1e38 from 4 keys on)
// would give inf or NaN where the result, a convex combination of V's rows, is finite. A tile whose acc holds a
// non-finite value after its last key (a scan of acc, D x BQ vector adds) is run again with every exponent lowered by
// kRescueShift: p, l and acc all shrink by 2^-64 (their ratio is unchanged), so no sum of fewer than 2^56 keys' p v
// (p <= 2^8 in decode's lazy max) reaches FLT_MAX; the outputs that were non-finite take the re-run's value, the
// others keep theirs (where the shift would have flushed p v of tiny values to zero). The decode step does the same
// for a sequence whose merged output is non-finite (DecodeArgs::shift). V holding inf or NaN stays non-finite.
//
// Accuracy: the score dot product over D is summed in chunks (tiles::kScoreChunk), which halves the kernel's share of
// the error at D = 256; the figures, stage by stage against the double reference and torch, are in docs/accuracy.md.
//
// The causal mask is index arithmetic: query i sees keys j <= i + causal_offset, so key tiles past the last
// query's horizon are never touched, tiles below the diagonal are not masked at all, and only tiles crossing it
// compare indices. Inside such a tile the micro-kernels also leave out the products of key blocks and query
// vectors the diagonal masks whole (Visible, attention_impl.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/kv_source.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn::kernels {

// log2 units subtracted from every exponent of a re-run of rows whose P.V overflowed (the "Overflow" paragraph).
inline constexpr float kRescueShift = 64.0f;

enum class MaskDType : uint8_t { u8, f32 };
enum class MaskMode : uint8_t { keep, block, additive };

// A user mask or key padding, already offset to this (b, h); element (i, j) at data[i*stride_i + j*stride_j].
struct MaskRef {
  const void* data = nullptr;  // null = no mask
  MaskDType dtype = MaskDType::f32;
  MaskMode mode = MaskMode::keep;
  int64_t stride_i = 0, stride_j = 0;
};

struct AttentionArgs {
  const void* q = nullptr;  // (T, D), row stride ldq, of the kernel's compute type (f32 or bf16)
  KvRef kv;                 // K, V (Tk, D): contiguous or paged, of the kernel's K/V element type
  void* out = nullptr;      // (T, D), row stride ldo, of the kernel's compute type
  int64_t ldq = 0, ldo = 0;
  int64_t T = 0, Tk = 0, D = 0;
  float scale = 1.0f;  // 1 / sqrt(D)

  bool causal = false;
  int64_t causal_offset = 0;  // Tk - T: bottom-right alignment

  MaskRef mask;         // (T, Tk) user mask
  MaskRef key_padding;  // (1, Tk): stride_i unused; nonzero = padding (mode block)

  float dropout_p = 0.0f;       // 0 = no dropout
  uint64_t dropout_seed = 0;
  uint64_t dropout_base = 0;    // ((b*H + h)*T)*Tk: index of (i=0, j=0) in the dropout contract
};

// The kernel's tile geometry for one instruction set (see kernels/tiles.hpp for the reasons).
struct TileShape {
  int64_t query_tile;  // BQ: query rows per tile (lanes x query vectors of the micro-kernel)
  int64_t key_tile;    // BK: keys per tile
};

// One implementation per (compute dtype, K/V dtype, instruction set), chosen once by the engine. Its identity comes
// from the template arguments it was instantiated with (kernels/kernel_sets_impl.hpp), so the tests can check a
// dispatch row against it.
struct AttentionKernel {
  Isa isa;        // the level whose flags compiled it
  DType compute;  // queries and output
  DType kv;       // K/V elements read
  TileShape tiles;
  // Floats of scratch one call needs for head size D; the engine allocates threads x this, once.
  size_t (*scratch_floats)(int64_t D);
  // Query tiles to give one call at once for K/V of Tk rows and head size D (1 where K/V stay in L2 between
  // calls; more where each key tile read from memory should serve several query tiles).
  int64_t (*tiles_per_call)(int64_t Tk, int64_t D);
  // Computes out rows [q_begin, q_end) (q_begin a multiple of tiles.query_tile) for one (b, h).
  void (*run)(const AttentionArgs& args, int64_t q_begin, int64_t q_end, float* scratch);
};

// How a caller splits one (b, h) slice's T query rows into work items for kernel k: `per_slice` items of G query tiles
// (k.tiles_per_call), counted from the slice's last tile, so item 0 is the longest under causal masking and the last
// is the shortest (the first tiles, fewer than G where G does not divide the tiles).
struct QueryItems {
  int64_t T, BQ, tiles, G, per_slice;
  QueryItems(const AttentionKernel& k, int64_t T_, int64_t Tk, int64_t D)
      : T(T_), BQ(k.tiles.query_tile), tiles((T_ + BQ - 1) / BQ), G(std::max<int64_t>(1, k.tiles_per_call(Tk, D))),
        per_slice((tiles + G - 1) / G) {}
  // Item i's rows [row_begin(i), row_end(i)), 0 <= i < per_slice: q_begin and q_end of one run() call.
  int64_t row_begin(int64_t i) const { return std::max<int64_t>(0, tiles - (i + 1) * G) * BQ; }
  int64_t row_end(int64_t i) const { return std::min(T, (tiles - i * G) * BQ); }
};

}  // namespace gpt2attn::kernels
