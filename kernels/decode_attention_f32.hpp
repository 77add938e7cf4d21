// kernels/decode_attention_f32.hpp: fp32 attention of ONE query (a decode step) against a range of a
// sequence's keys in the paged KV cache, producing that range's partial softmax state; and the exact merge of
// partial states (split-KV / flash-decoding). Pure compute on pointers: no allocation, threads or oneDNN.
//
// For keys j in [j_begin, j_end) of one (sequence, head), with s_j = q . k_j * scale * log2(e):
//   m = max_j s_j,   l = sum_j 2^(s_j - m),   acc = sum_j 2^(s_j - m) v_j      (acc (D), unnormalised)
// computed key block by key block with the online rescale of attention_f32.hpp (alpha = 2^(m_old - m_new)).
// Partial states of disjoint key ranges merge exactly:
//   M = max_s m_s,   l = sum_s 2^(m_s - M) l_s,   out = sum_s 2^(m_s - M) acc_s / l   (0 when l == 0).
// Why a kernel of its own: with one query the tiled kernel's query lanes would be 1/16 used; here the
// head dimension D sits in the SIMD lanes instead, and the step is bound by reading K and V once.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/attention_f32.hpp"

namespace gpt2attn::kernels {

struct DecodeArgs {
  const float* q = nullptr;  // (D): the new token's query for this head
  PagedKv kv;                // this (sequence, head)'s keys and values
  int64_t D = 0;
  float scale = 1.0f;        // 1 / sqrt(D)
};

struct DecodeKernel {
  const char* isa;
  // Floats of scratch one call needs: the scaled query and one block's scores.
  size_t (*scratch_floats)(int64_t D, int64_t block_tokens);
  // Partial state of keys [j_begin, j_end) (j_end > j_begin): *m, *l and acc (D floats).
  void (*run)(const DecodeArgs& args, int64_t j_begin, int64_t j_end, float* scratch, float* m, float* l, float* acc);
};

const DecodeKernel& decode_attention_f32_scalar();
const DecodeKernel& decode_attention_f32_avx2();
const DecodeKernel& decode_attention_f32_avx512();

// Merges `parts` partial states (m[s], l[s], acc + s * acc_stride) into out (D), as in the header comment.
inline void merge_softmax_partials(const float* m, const float* l, const float* acc, int64_t acc_stride,
                                   int64_t parts, int64_t D, float* out) {
  float M = -INFINITY;
  for (int64_t s = 0; s < parts; ++s) M = m[s] > M ? m[s] : M;
  const float m_safe = M == -INFINITY ? 0.0f : M;
  float total = 0.0f;
  for (int64_t s = 0; s < parts; ++s) total += std::exp2(m[s] - m_safe) * l[s];
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t s = 0; s < parts; ++s) {
    const float w = std::exp2(m[s] - m_safe) * inv;
    const float* a = acc + s * acc_stride;
    for (int64_t d = 0; d < D; ++d) out[d] += w * a[d];
  }
}

}  // namespace gpt2attn::kernels
