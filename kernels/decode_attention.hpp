// kernels/decode_attention.hpp: attention of ONE new token (a decode step) against a range of a sequence's keys in
// the paged KV cache, for every head, producing that range's partial softmax states; and the exact merge of partial
// states (split-KV / flash-decoding). Pure compute on pointers: no allocation, threads or oneDNN. Written once
// (decode_attention_impl.hpp), generic over the instruction set and the K/V element type; instantiated by each row of
// kernels/kernel_list.def.
//
// For each query head h, reading K/V head g = h / (H / H_kv), and keys j in [j_begin, j_end), with
// s_j = q_h . k_gj * scale * log2(e):
//   m ~ max_j s_j,   l = sum_j 2^(s_j - m),   acc = sum_j 2^(s_j - m) v_hj      (acc (D), unnormalised)
// computed key block by key block with the online rescale of attention.hpp (alpha = 2^(m_old - m_new)), except
// that m moves only when a block's scores pass it by more than 8 (log2 units): m is the range's max, or below it by
// at most 8, so p stays at most 2^8, and most blocks need neither a horizontal max nor a rescale. Any m serves the
// states' meaning (the ratios acc / l and the merge below are the same for every m).
// Partial states of disjoint key ranges merge exactly:
//   M = max_s m_s,   l = sum_s 2^(m_s - M) l_s,   out = sum_s 2^(m_s - M) acc_s / l   (0 when l == 0).
// Why a kernel of its own: with one query the tiled kernel's query lanes would be 1/16 used; here the head
// dimension D sits in the SIMD lanes. Why all heads in one call: a block stores K [H_kv][bt][D] then V
// (kernels/kv_layout.hpp), so walking the heads inside each block streams the block front to back, which the
// hardware prefetchers follow; one (head, block) tile alone is only bt*D elements at an unrelated address. With
// grouped K/V heads, each K/V head's run is read once for its whole query group: keys outer, the group's heads
// inner, so every row streams from memory once (heads outer left memory idle while later heads re-read L1).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "gpt2attn/isa.hpp"
#include "kernels/attention.hpp"
#include "kernels/kv_layout.hpp"

namespace gpt2attn::kernels {

struct DecodeArgs {
  const float* q = nullptr;                // (H, D): the new token's query, head h at q + h * ldq
  int64_t ldq = 0;
  // Several new tokens of one sequence (a speculative draft to verify, a short chunk) share one pass over the keys:
  // token i's query at q + i * ld_token, and token i sees keys j <= last_key + i (causal within the new tokens).
  // Each K/V head's rows are read once for all tokens x group heads, which sit in the kernel's rows as its grouped
  // heads do: row r = (g * tokens + i) * group + hg is token i's head g * group + hg, and the partial states come out
  // in that order (H * tokens rows). One token (a decode step): row r is head r, and last_key does not cut the range.
  int64_t tokens = 1, ld_token = 0;
  int64_t last_key = INT64_MAX;
  const std::byte* const* blocks = nullptr;  // the sequence's block table, blocks laid out as `layout` says
  KvLayout layout;                         // heads = H_kv, which divides H; D as below
  int64_t H = 0, D = 0;                    // query heads, head size
  float scale = 1.0f;                      // 1 / sqrt(D)
  // Log2 units subtracted from every exponent: 0, or kRescueShift when the engine runs a sequence again because its
  // merged output was not finite (attention.hpp, "Overflow"). Every part of one merge must have the same shift.
  float shift = 0.0f;
};

// One implementation per (compute dtype, K/V dtype, instruction set), chosen once by the engine.
struct DecodeKernel {
  Isa isa;   // the level whose flags compiled it
  DType kv;  // K/V elements read (queries, scores and partial states are f32 whatever the compute type)
  // Floats of scratch one call needs for `rows` = H * tokens query rows: the scaled queries and the scores of one run
  // of keys (at most one block of block_tokens, and at most tiles::kDecodeMaxScoreKeys).
  size_t (*scratch_floats)(int64_t rows, int64_t D, int64_t block_tokens);
  // Partial states of keys [j_begin, j_end) (j_end > j_begin) for every query row r (DecodeArgs::tokens): m[r], l[r]
  // and acc + r * D.
  void (*run)(const DecodeArgs& args, int64_t j_begin, int64_t j_end, float* scratch, float* m, float* l, float* acc);
};

// The integer dot products of an int8 cache's scores (kernels/int_dot.hpp): out[r] = sum_{d < n} q[d] * k[r * ldk + d]
// for r < keys <= IntDot<Arch>::kKeys, exact in int32 for n <= kIntDotMaxLen (the kernel sums longer rows in
// chunks). One instantiation per instruction set (IsaKernels::int_dot), for the tests that pin each to the scalar twin.
inline constexpr int64_t kIntDotMaxLen = 512;
struct IntDotKernel {
  Isa isa;
  int keys;  // IntDot<Arch>::kKeys
  void (*dots)(const int16_t* q, const int8_t* k, int64_t ldk, int64_t n, int keys, int32_t* out);
  float (*quantize)(const float* x, float c, int64_t n, int16_t* q);  // quantize_query_i16<Arch>, for the tests
};

// Merges `parts` partial states into out (D), as in the header comment: part s has m[s * stride], l[s * stride]
// and acc + s * acc_stride.
inline void merge_softmax_partials(const float* m, const float* l, int64_t stride, const float* acc,
                                   int64_t acc_stride, int64_t parts, int64_t D, float* out) {
  float M = -INFINITY;
  for (int64_t s = 0; s < parts; ++s) M = m[s * stride] > M ? m[s * stride] : M;
  const float m_safe = M == -INFINITY ? 0.0f : M;
  float total = 0.0f;
  for (int64_t s = 0; s < parts; ++s) total += std::exp2(m[s * stride] - m_safe) * l[s * stride];
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t s = 0; s < parts; ++s) {
    const float w = std::exp2(m[s * stride] - m_safe) * inv;
    const float* a = acc + s * acc_stride;
    for (int64_t d = 0; d < D; ++d) out[d] += w * a[d];
  }
}

}  // namespace gpt2attn::kernels
