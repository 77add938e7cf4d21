// kernels/decode_attention_impl.hpp: the one-query attention of decode_attention.hpp, written once over
// Vec<Arch>. Included only by the per-ISA instantiation files (internal linkage, like attention_f32_impl.hpp).
#pragma once

#include <algorithm>
#include <cmath>

#include "kernels/decode_attention.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

template <class Arch, class KvT>
struct DecodeAttention {
  using V = Vec<Arch>;
  using B = typename V::B;
  static constexpr int W = V::W;

  static constexpr int kKeys = 4;  // keys scored at once: 4 independent FMA chains over D
  // Heads' tiles are contiguous in a block, so prefetching rows ahead runs on into the next head's tile.
  static constexpr int64_t kAhead = tiles::kDecodePrefetchRows;

  // One prefetch per 64-byte line of `rows` rows of D elements starting kAhead rows after p.
  static constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(KvT));  // elements per cache line
  static void prefetch_rows(const KvT* p, int64_t rows, int64_t D) {
    for (int64_t i = 0; i < rows * D; i += kLine) prefetch(p, static_cast<size_t>(kAhead * D + i) * sizeof(KvT));
  }

  // Scratch: qs (H, D padded to W) | s (score_keys, padded to W), where a run of keys scored at once is at most
  // one block and at most kDecodeMaxScoreKeys, so the scratch does not grow with the block size.
  static int64_t padded(int64_t n) { return (n + W - 1) / W * W; }
  static int64_t score_keys(int64_t block_tokens) { return std::min<int64_t>(block_tokens, tiles::kDecodeMaxScoreKeys); }
  static size_t scratch_floats(int64_t H, int64_t D, int64_t block_tokens) {
    return static_cast<size_t>(H * padded(D) + padded(score_keys(block_tokens)));
  }

  // s[r] = qs . k_r for RR consecutive keys (rows D apart).
  template <int RR>
  static void dots(const float* qs, const KvT* k, int64_t D, float* s) {
    B acc[RR];
    for (int r = 0; r < RR; ++r) acc[r] = V::set1(0.0f);
    prefetch_rows(k, RR, D);
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      const B q = V::load(qs + d);
      for (int r = 0; r < RR; ++r) acc[r] = V::fma(q, V::load(k + r * D + d), acc[r]);
    }
    for (int r = 0; r < RR; ++r) {
      float t = V::sum(acc[r]);
      for (int64_t e = d; e < D; ++e) t += qs[e] * widen(k[r * D + e]);
      s[r] = t;
    }
  }

  // acc[d..d+N*W) = alpha * acc + sum_j p_j v_j[d..d+N*W) for nk keys (rows D apart).
  template <int N>
  static void pv(const KvT* v, int64_t D, const float* p, int64_t nk, float alpha, float* acc) {
    B c[N];
    for (int n = 0; n < N; ++n) c[n] = V::load(acc + n * W) * V::set1(alpha);
    for (int64_t j = 0; j < nk; ++j) {
      for (int n = 0; n < N * W; n += kLine) prefetch(v, static_cast<size_t>((j + kAhead) * D + n) * sizeof(KvT));
      const B pj = V::set1(p[j]);
      for (int n = 0; n < N; ++n) c[n] = V::fma(pj, V::load(v + j * D + n * W), c[n]);
    }
    for (int n = 0; n < N; ++n) V::store(acc + n * W, c[n]);
  }

  // One head over nk keys of one block: scores, online softmax update of (m, l), acc += p V.
  static void head_block(const float* qs, const KvT* k, const KvT* v, int64_t nk, int64_t D, float* s, float& m,
                         float& l, float* acc) {
    int64_t j = 0;
    for (; j + kKeys <= nk; j += kKeys) dots<kKeys>(qs, k + j * D, D, s + j);
    for (; j < nk; ++j) dots<1>(qs, k + j * D, D, s + j);
    float m_new = m;
    for (j = 0; j < nk; ++j) m_new = std::max(m_new, s[j]);
    for (j = nk; j < padded(nk); ++j) s[j] = -INFINITY;  // pad lanes: exp2 gives 0

    // p_j = 2^(s_j - m_new) in place, l = alpha * l + sum_j p_j.
    const float m_safe = m_new == -INFINITY ? 0.0f : m_new;
    B sum = V::set1(0.0f);
    for (j = 0; j < nk; j += W) {
      const B p = V::exp2(V::load(s + j) - V::set1(m_safe));
      V::store(s + j, p);
      sum = sum + p;
    }
    const float alpha = std::exp2(m - m_safe);
    l = l * alpha + V::sum(sum);
    m = m_new;

    int64_t d = 0;
    for (; d + 4 * W <= D; d += 4 * W) pv<4>(v + d, D, s, nk, alpha, acc + d);
    for (; d + W <= D; d += W) pv<1>(v + d, D, s, nk, alpha, acc + d);
    for (; d < D; ++d) {
      float c = acc[d] * alpha;
      for (j = 0; j < nk; ++j) c += s[j] * widen(v[j * D + d]);
      acc[d] = c;
    }
  }

  static void run(const DecodeArgs& a, int64_t j_begin, int64_t j_end, float* scratch, float* m, float* l,
                  float* acc) {
    const KvLayout& kv = a.layout;
    const int64_t H = a.H, D = a.D, bt = kv.block_tokens, ldqs = padded(D), group = H / kv.heads;
    float* qs = scratch;
    float* s = scratch + H * ldqs;
    // Scores in log2 units, so the softmax runs on exp2 (as in the tiled kernel).
    const float qscale = a.scale * kLog2e;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) qs[h * ldqs + d] = a.q[h * a.ldq + d] * qscale;
      m[h] = -INFINITY;
      l[h] = 0.0f;
    }
    std::fill(acc, acc + H * D, 0.0f);

    int64_t nk = 0;
    for (int64_t j0 = j_begin; j0 < j_end; j0 += nk) {
      const int64_t off = j0 % bt;
      nk = std::min({j_end - j0, bt - off, score_keys(bt)});  // keys left in this block, at most a score run
      const std::byte* block = a.blocks[j0 / bt];
      for (int64_t h = 0; h < H; ++h) {  // query heads in order: their K/V heads h / group stream front to back
        const int64_t g = h / group;
        head_block(qs + h * ldqs, kv.row<KvT>(block, KvPart::key, g, off), kv.row<KvT>(block, KvPart::value, g, off),
                   nk, D, s, m[h], l[h], acc + h * D);
      }
    }
  }
};

// The decode kernel of f32 compute over K/V stored as KvT, for instruction set Arch.
template <class Arch, class KvT>
const DecodeKernel& make_decode_kernel(const char* isa) {
  using K = DecodeAttention<Arch, KvT>;
  static const DecodeKernel kernel{isa, &K::scratch_floats, &K::run};
  return kernel;
}

}  // namespace
}  // namespace gpt2attn::kernels
