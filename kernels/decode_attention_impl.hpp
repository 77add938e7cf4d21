// kernels/decode_attention_impl.hpp: the one-query attention of decode_attention.hpp, written once over
// Vec<Arch>. Included only by kernels/kernel_sets_impl.hpp, in each level's file (internal linkage, like
// attention_impl.hpp).
#pragma once

#include <algorithm>
#include <cmath>

#include "kernels/decode_attention.hpp"
#include "kernels/element.hpp"
#include "kernels/int_dot.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

template <class Arch, class KvT>
struct DecodeAttention {
  using V = Vec<Arch>;
  using B = typename V::B;
  static constexpr int W = V::W;
  // int8 keys are scored by integer dot products (kernels/int_dot.hpp) against the query quantised once per call to
  // int16 (QT); f32 and bf16 keys by f32 FMAs against the f32 query.
  static constexpr bool kIntScores = std::is_same_v<KvT, int8_t>;
  using QT = std::conditional_t<kIntScores, int16_t, float>;

  static constexpr int kKeys = 4;  // keys scored at once: 4 independent FMA chains over D
  // Query heads of one group accumulated together in P.V: kHeadBlock x 4 vectors of acc in registers, plus 4 V
  // vectors and a broadcast (AVX-512: 16 + 5 of 32 registers; AVX2: 8 + 5 of 16; scalar: the compiler's choice).
  static constexpr int kHeadBlock = W >= 16 ? 4 : 2;
  static constexpr int64_t kAhead = tiles::kDecodePrefetchBytes;
  // How far (log2 units) a run's scores may pass the running max before it moves (group_block): till then p_j may
  // reach 2^8, alpha is 1, and the run's softmax needs no horizontal max and no exp2 of alpha, a chain P.V waited
  // on. A cold gpt2-small B=16 T=1024 int8 step, 2 threads (gpt2attn bench --mode decode --cache cold): 1.437 ->
  // 1.387 ms.
  static constexpr float kLazyMax = 8.0f;

  // The K (or V) stream's prefetch, kAhead bytes ahead of the row being read. A run of one head's rows is read
  // front to back, then the run after it: the next K/V head's in the same block, or past a block's last head the
  // first head's of the sequence's next block, which lies anywhere in the pool. Lines past the run's end are asked
  // for in that next run, so a block's first rows are in flight before it starts, instead of its last head
  // prefetching its own V tile or scales. Into L2 (prefetch_l2). Both together took a cold gpt2-small B=16 T=1024
  // step over a bf16 cache from 2.58 to 2.39 ms (2 threads; f32 and int8 caches unchanged).
  struct Ahead {
    uintptr_t run = 0;   // address of this run's first row
    int64_t bytes = 0;   // this run's bytes
    uintptr_t next = 0;  // address of the next run's first row; 0 when there is none
    // One prefetch per line of the n elements from p (inside this run), kAhead bytes on.
    void fetch(const KvT* p, int64_t n) const {
      const int64_t at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) - run) + kAhead;
      for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(KvT)); i += 64) {
        if (at + i < bytes) {
          prefetch_l2(reinterpret_cast<const void*>(run), static_cast<size_t>(at + i));
        } else if (next != 0) {
          prefetch_l2(reinterpret_cast<const void*>(next), static_cast<size_t>(at + i - bytes));
        }
      }
    }
  };
  static Ahead ahead(const KvT* run, int64_t rows, int64_t D, const KvT* next) {
    return {reinterpret_cast<uintptr_t>(run), rows * D * static_cast<int64_t>(sizeof(KvT)),
            reinterpret_cast<uintptr_t>(next)};
  }

  // Scratch: qs (H, D padded to W; int scores: int16 rows in the same space) | s (H, score_keys padded to W) |
  // alpha (H) | (int scores only) qsc (H), where a run of keys scored at once is at most one block and at most
  // kDecodeMaxScoreKeys, so the scratch does not grow with the block size. The scores of one group (at most H heads)
  // are live at once.
  static int64_t padded(int64_t n) { return (n + W - 1) / W * W; }
  static int64_t score_keys(int64_t block_tokens) { return std::min<int64_t>(block_tokens, tiles::kDecodeMaxScoreKeys); }
  static size_t scratch_floats(int64_t rows, int64_t D, int64_t block_tokens) {
    return static_cast<size_t>(rows * padded(D) + rows * padded(score_keys(block_tokens)) + rows +
                               (kIntScores ? rows : 0));
  }

  // s[r] = qs . k_r for RR consecutive keys (rows D apart); `fetch`: prefetch the rows kAhead ahead (the first
  // head of a group does, the others read the same rows from L1).
  template <int RR>
  static void dots(const float* qs, const KvT* k, int64_t D, float* s, const Ahead* fetch) {
    B acc[RR];
    for (int r = 0; r < RR; ++r) acc[r] = V::set1(0.0f);
    if (fetch) fetch->fetch(k, RR * D);
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

  // s_g[0..W) = qs_g . k_r for W consecutive keys (rows D apart), D a multiple of W, and GB query heads of a group
  // (qs and s rows ldqs and lds apart): one accumulator per (head, key), reduced all at once by a transpose-add
  // (Vec::fold4, Vec::sum_folds) instead of one horizontal sum per key, which cost more than the key's FMAs at
  // D = 64. (A compile-time D, which gives every row a constant offset, measured no faster.)
  // One head takes eight keys at a time: 8 FMA chains keep both FMA units busy, and their accumulators stay in
  // registers. Several heads take four keys at a time, each K vector loaded once and pinned in a register
  // (V::in_register) for all GB heads' FMAs: unpinned, GCC folds the load into every head's FMA as a memory operand,
  // and grouping the heads measured the same as scoring them one by one. AVX-512, GB = 3: 12 accumulators + 4 K
  // vectors + 1 query vector + 12 folds of 32 registers (kScoreHeads; AVX2 has too few and scores head by head).
  // A cold gpt2-small B=16 T=1024 step with 4 K/V heads (groups of 3), 2 threads (gpt2attn bench --mode decode
  // --cache cold --kv-heads 4): 2.53-2.85 -> 2.40-2.64 ms; 12 K/V heads unchanged.
  static constexpr int kScoreHeads = W >= 16 ? 3 : 1;
  template <int GB>
  static void dots_w(const float* qs, int64_t ldqs, const KvT* k, int64_t D, float* s, int64_t lds,
                     const Ahead* fetch) {
    constexpr int KR = GB == 1 ? 8 : 4;  // keys at a time
    static_assert(W % KR == 0);
    B folds[GB][W / 4];
    if (fetch) fetch->fetch(k, W * D);
    #pragma GCC unroll 4
    for (int r0 = 0; r0 < W; r0 += KR) {
      const KvT* k0 = k + r0 * D;
      B a[GB][KR];
      #pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) {
        #pragma GCC unroll 8
        for (int r = 0; r < KR; ++r) a[g][r] = V::set1(0.0f);
      }
      for (int64_t d = 0; d < D; d += W) {
        B kv[KR];
        #pragma GCC unroll 8
        for (int r = 0; r < KR; ++r) {
          kv[r] = V::load(k0 + r * D + d);
          if constexpr (GB > 1) kv[r] = V::in_register(kv[r]);
        }
        #pragma GCC unroll 16
        for (int g = 0; g < GB; ++g) {
          const B q = V::load(qs + g * ldqs + d);
          #pragma GCC unroll 8
          for (int r = 0; r < KR; ++r) a[g][r] = V::fma(q, kv[r], a[g][r]);
        }
      }
      #pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) {
        #pragma GCC unroll 2
        for (int r = 0; r < KR; r += 4) {
          folds[g][(r0 + r) / 4] = V::fold4(a[g][r], a[g][r + 1], a[g][r + 2], a[g][r + 3]);
        }
      }
    }
    #pragma GCC unroll 16
    for (int g = 0; g < GB; ++g) V::store(s + g * lds, V::sum_folds(folds[g]));
  }

  // s_gj = (qi_g . k_j) * qsc_g for the nk keys of a run (rows D apart) and the G int16 query rows (ldqi apart),
  // kKeys at a time (IntDot's transpose-add, as in dots_w). The dot is exact in int32 over chunks of at most
  // kIntDotMaxLen = 512 elements, where it cannot overflow (kernels/int_dot.hpp); D <= 512 (every GPT-2 head size)
  // is one chunk, a longer row adds its chunks' dots in f32. The key's scale comes in the pass after, as for f32.
  static void int_scores(const int16_t* qi, int64_t ldqi, const float* qsc, int64_t G, const int8_t* k, int64_t nk,
                         int64_t D, float* s, int64_t lds, const Ahead& ka) {
    using ID = IntDot<Arch>;
    constexpr int R = ID::kKeys;
    static_assert(R == W, "a call's dots fill one vector of scores");
    // A ragged run's last call fills fewer than R; the lanes past it are the score rows' pad (which the softmax
    // pass sets to -inf), written from whatever earlier call's dots are left there: initialised, never read.
    int32_t dot[R] = {};
    const int64_t n0 = std::min(D, kIntDotMaxLen);
    for (int64_t j = 0; j < nk; j += R) {
      const int keys = static_cast<int>(std::min<int64_t>(R, nk - j));
      const int8_t* kj = k + j * D;
      ka.fetch(kj, keys * D);  // the first head's read; the group's others find the rows in L1
      for (int64_t g = 0; g < G; ++g) {
        const int16_t* q = qi + g * ldqi;
        ID::dots(q, kj, D, n0, keys, dot);
        B t = V::load(dot);
        for (int64_t c = n0; c < D; c += kIntDotMaxLen) {
          ID::dots(q + c, kj + c, D, std::min(D - c, kIntDotMaxLen), keys, dot);
          t = t + V::load(dot);
        }
        V::store(s + g * lds + j, t * V::set1(qsc[g]));
      }
    }
  }

  // For HB heads g (p, alpha and acc rows lds, 1 and D apart): acc_g[0..N*W) = alpha_g * acc_g + sum_j p_gj v_j[...]
  // over nk keys (V rows D apart). Each V row is loaded once for all HB heads. Keys go round U independent sets of
  // accumulators, added at the end: one set of HB * N FMA chains would wait on the FMA latency whenever it is
  // shorter than the latency times the FMA rate (one head, N = 4: 4 chains where 8 keep both FMA units busy).
  static constexpr int kAccRegs = W >= 16 ? 16 : 8;  // accumulators that leave room for V and p in the registers
  template <int HB, int N>
  static void pv(const KvT* v, int64_t D, const float* p, int64_t lds, int64_t nk, const float* alpha, float* acc,
                 const Ahead& va) {
    constexpr int U = HB * N >= kAccRegs ? 1 : kAccRegs / (HB * N);
    B c[U][HB][N];
    #pragma GCC unroll 16
    for (int g = 0; g < HB; ++g) {
      #pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        c[0][g][n] = V::load(acc + g * D + n * W) * V::set1(alpha[g]);
        #pragma GCC unroll 16
        for (int u = 1; u < U; ++u) c[u][g][n] = V::set1(0.0f);
      }
    }
    int64_t j = 0;
    for (; j + U <= nk; j += U) {
      #pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        const KvT* vrow = v + (j + u) * D;
        va.fetch(vrow, N * W);
        B vj[N];
        #pragma GCC unroll 16
        for (int n = 0; n < N; ++n) vj[n] = V::in_register(V::load(vrow + n * W));  // one load for HB FMAs
        #pragma GCC unroll 16
        for (int g = 0; g < HB; ++g) {
          const B pj = V::set1(p[g * lds + j + u]);
          #pragma GCC unroll 16
          for (int n = 0; n < N; ++n) c[u][g][n] = V::fma(pj, vj[n], c[u][g][n]);
        }
      }
    }
    for (; j < nk; ++j) {
      B vj[N];
      #pragma GCC unroll 16
      for (int n = 0; n < N; ++n) vj[n] = V::load(v + j * D + n * W);
      #pragma GCC unroll 16
      for (int g = 0; g < HB; ++g) {
        const B pj = V::set1(p[g * lds + j]);
        #pragma GCC unroll 16
        for (int n = 0; n < N; ++n) c[0][g][n] = V::fma(pj, vj[n], c[0][g][n]);
      }
    }
    #pragma GCC unroll 16
    for (int g = 0; g < HB; ++g) {
      #pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        B t = c[0][g][n];
        #pragma GCC unroll 16
        for (int u = 1; u < U; ++u) t = t + c[u][g][n];
        V::store(acc + g * D + n * W, t);
      }
    }
  }

  // pv<HB, N> for the G heads of a group, in blocks of kHeadBlock (the last block ragged, still in registers).
  template <int N>
  static void pv_heads(const KvT* v, int64_t D, const float* s, int64_t lds, int64_t nk, int64_t G,
                       const float* alpha, float* acc, const Ahead& va) {
    for (int64_t g = 0; g < G; g += kHeadBlock) {
      const int64_t hb = std::min<int64_t>(kHeadBlock, G - g);
      const float* p = s + g * lds;
      float* a = acc + g * D;
      if (hb == kHeadBlock) {
        pv<kHeadBlock, N>(v, D, p, lds, nk, alpha + g, a, va);
      } else if (hb == 3) {
        pv<3, N>(v, D, p, lds, nk, alpha + g, a, va);
      } else if (hb == 2) {
        pv<2, N>(v, D, p, lds, nk, alpha + g, a, va);
      } else {
        pv<1, N>(v, D, p, lds, nk, alpha + g, a, va);
      }
    }
  }

  // One K/V head's run of nk keys for the G query heads that read it (qs, s, m, l, acc rows of those heads):
  // scores, the online softmax update of (m, l), acc += p V. Row-scaled K/V (int8) bring their scales (kscale,
  // vscale: nk each; null otherwise) and int16 query rows theirs (qsc, G; null otherwise): a score is the integer
  // dot product times the query's and the key's scales, and each p_j meets its value's scale after l has summed it.
  // Keys are the outer loop and the group's heads the inner one, so every K and V row comes from memory once and
  // serves the whole group while it sits in L1; with heads outer, only the first head of a group would stream
  // memory and the others would leave it idle.
  // Causal cut of a run for rows of several new tokens (DecodeArgs::tokens): row g (of group) sees the run's keys
  // j < first_hidden + g / group only.
  struct Visible {
    int64_t first_hidden = INT64_MAX, group = 1;
    int64_t keys(int64_t g, int64_t nk) const {
      return first_hidden >= nk ? nk : std::clamp<int64_t>(first_hidden + g / group, 0, nk);
    }
  };
  static void group_block(const QT* qs, int64_t ldqs, const float* qsc, int64_t G, const KvT* k, const KvT* v,
                          const float* kscale, const float* vscale, int64_t nk, int64_t D, float* s, int64_t lds,
                          float* alpha, float* m, float* l, float* acc, float shift, const Ahead& ka,
                          const Ahead& va, const Visible& vis) {
    int64_t j = 0;
    if constexpr (kIntScores) {
      int_scores(qs, ldqs, qsc, G, k, nk, D, s, lds, ka);
    } else {
      if constexpr (W > 1) {
        if (D % W == 0) {
          for (; j + W <= nk; j += W) {
            // The group's heads kScoreHeads at a time, a remaining pair together, a last head alone.
            int64_t g = 0;
            if constexpr (kScoreHeads > 1) {
              for (; g + kScoreHeads <= G; g += kScoreHeads) {
                dots_w<kScoreHeads>(qs + g * ldqs, ldqs, k + j * D, D, s + g * lds + j, lds, g == 0 ? &ka : nullptr);
              }
              if (G - g == 2) {
                dots_w<2>(qs + g * ldqs, ldqs, k + j * D, D, s + g * lds + j, lds, g == 0 ? &ka : nullptr);
                g += 2;
              }
            }
            for (; g < G; ++g) {
              dots_w<1>(qs + g * ldqs, ldqs, k + j * D, D, s + g * lds + j, lds, g == 0 ? &ka : nullptr);
            }
          }
        }
      }
      for (; j + kKeys <= nk; j += kKeys) {
        for (int64_t g = 0; g < G; ++g) dots<kKeys>(qs + g * ldqs, k + j * D, D, s + g * lds + j, g == 0 ? &ka : nullptr);
      }
      for (; j < nk; ++j) {
        for (int64_t g = 0; g < G; ++g) dots<1>(qs + g * ldqs, k + j * D, D, s + g * lds + j, g == 0 ? &ka : nullptr);
      }
    }

    // Per head, two passes over the run's scores: (1) row-scaled K/V take the keys' scales, and the lanes' maxima,
    // from which m_new; (2) p_j = 2^(s_j - m_new - shift) in place, l = alpha * l + sum_j p_j, and row-scaled K/V
    // give each p_j its value's scale after the sum. Lanes past nk (pad) hold -inf: no effect on the max, and exp2
    // gives 0.
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * lds;
      B mv = V::set1(m[g]);
      for (j = 0; j + W <= nk; j += W) {
        B x = V::load(sg + j);
        if constexpr (kRowScaled<KvT>) x = x * V::load(kscale + j);
        V::store(sg + j, x);
        mv = V::max(mv, x);
      }
      const int64_t full = j;  // keys in whole vectors; the ragged rest, if any, fills one more with its pad
      if (full < nk) {
        for (; j < nk; ++j) {
          if constexpr (kRowScaled<KvT>) sg[j] *= kscale[j];
        }
        for (; j < padded(nk); ++j) sg[j] = -INFINITY;
        mv = V::max(mv, V::load(sg + full));
      }
      // A new token's row past its own position: the keys it may not see weigh 0 (scores -inf), set after the
      // scales so that no 0 * -inf arises, and the lanes' maxima taken again (a run crossing the new tokens only).
      if (const int64_t seen = vis.keys(g, nk); seen < nk) {
        for (j = seen; j < nk; ++j) sg[j] = -INFINITY;
        mv = V::set1(m[g]);
        for (j = 0; j < padded(nk); j += W) mv = V::max(mv, V::load(sg + j));
      }
      // The running max moves only when a score passes it by more than kLazyMax (or on the first run, from -inf):
      // otherwise p_j = 2^(s_j - m) stays at most 2^kLazyMax, alpha is 1, and neither the horizontal max nor the
      // exp2 of alpha stands between the scores and P.V.
      const float m_old = m[g];
      const float m_new = V::any_above(mv, m_old + kLazyMax) ? V::reduce_max(mv) : m_old;
      const float m_safe = m_new == -INFINITY ? 0.0f : m_new;
      B sum = V::set1(0.0f);
      for (j = 0; j < padded(nk); j += W) {
        const B p = V::exp2((V::load(sg + j) - V::set1(m_safe)) - V::set1(shift));
        sum = sum + p;
        if constexpr (kRowScaled<KvT>) {
          V::store(sg + j, j + W <= nk ? p * V::load(vscale + j) : p);  // the ragged vector: below
        } else {
          V::store(sg + j, p);
        }
      }
      if constexpr (kRowScaled<KvT>) {
        for (j = full; j < nk; ++j) sg[j] *= vscale[j];
      }
      alpha[g] = m_new == m_old ? 1.0f : std::exp2(m_old - m_safe);
      l[g] = l[g] * alpha[g] + V::sum(sum);
      m[g] = m_new;
    }

    int64_t d = 0;
    for (; d + 4 * W <= D; d += 4 * W) pv_heads<4>(v + d, D, s, lds, nk, G, alpha, acc + d, va);
    for (; d + W <= D; d += W) pv_heads<1>(v + d, D, s, lds, nk, G, alpha, acc + d, va);
    for (; d < D; ++d) {
      for (int64_t g = 0; g < G; ++g) {
        float c = acc[g * D + d] * alpha[g];
        for (j = 0; j < nk; ++j) c += s[g * lds + j] * widen(v[j * D + d]);
        acc[g * D + d] = c;
      }
    }
  }

  // Row-scaled K/V: the scales of K/V head g's run sit after every head's rows, where the rows' prefetch stream
  // does not reach before they are read, so each run asks for the next run's ahead of time.
  static void prefetch_scales(const KvLayout& kv, const std::byte* block, int64_t g, int64_t off, int64_t nk) {
    for (KvPart part : {KvPart::key, KvPart::value}) {
      const float* sc = kv.scales(block, part, g, off);
      for (int64_t i = 0; i < nk; i += 16) prefetch(sc + i, 0);
    }
  }

  static void run(const DecodeArgs& a, int64_t j_begin, int64_t j_end, float* scratch, float* m, float* l,
                  float* acc) {
    const KvLayout& kv = a.layout;
    const int64_t D = a.D, bt = kv.block_tokens, ldqs = padded(D), group = a.H / kv.heads, T = a.tokens;
    const int64_t rows = a.H * T, G = group * T;  // query rows, and those reading one K/V head
    const int64_t lds = padded(score_keys(bt));
    QT* qs = reinterpret_cast<QT*>(scratch);  // int16 rows take half of the f32 rows' space, at the same stride
    float* s = scratch + rows * ldqs;
    float* alpha = s + rows * lds;
    float* qsc = kIntScores ? alpha + rows : nullptr;
    // Scores in log2 units, so the softmax runs on exp2 (as in the tiled kernel).
    const float qscale = a.scale * kLog2e;
    for (int64_t r = 0; r < rows; ++r) {
      // Row r = (g * T + i) * group + hg: token i's head g * group + hg (DecodeArgs::tokens).
      const int64_t g = r / G, i = (r % G) / group, h = g * group + r % group;
      const float* qh = a.q + i * a.ld_token + h * a.ldq;
      if constexpr (kIntScores) {
        qsc[r] = quantize_query_i16<Arch>(qh, qscale, D, qs + r * ldqs);
      } else {
        for (int64_t d = 0; d < D; ++d) qs[r * ldqs + d] = qh[d] * qscale;
      }
      m[r] = -INFINITY;
      l[r] = 0.0f;
    }
    std::fill(acc, acc + rows * D, 0.0f);

    // A run: the keys [j0, j0 + run_keys(j0)) of one block, at most a score run, read for every K/V head in turn.
    const auto run_keys = [&](int64_t j0) { return std::min({j_end - j0, bt - j0 % bt, score_keys(bt)}); };
    if constexpr (kRowScaled<KvT>) prefetch_scales(kv, a.blocks[j_begin / bt], 0, j_begin % bt, run_keys(j_begin));
    int64_t nk = 0;
    for (int64_t j0 = j_begin; j0 < j_end; j0 += nk) {
      const int64_t off = j0 % bt;
      nk = run_keys(j0);
      const std::byte* block = a.blocks[j0 / bt];
      // After this run's last K/V head comes the next run's first, usually in another block; none after the last.
      const int64_t j1 = j0 + nk;
      const std::byte* next_block = j1 < j_end ? a.blocks[j1 / bt] : nullptr;
      // Token i sees the run's keys before j0's offset last_key + i + 1 - j0 (all of them for a decode step).
      const Visible vis{a.last_key >= j1 ? INT64_MAX : a.last_key + 1 - j0, group};
      // K/V heads in order, so the block streams front to back; query rows g * G ... read K/V head g.
      for (int64_t g = 0; g < kv.heads; ++g) {
        const int64_t h0 = g * G;
        const bool last = g + 1 == kv.heads;
        const std::byte* nb = last ? next_block : block;  // the next run's block, head and first key
        const int64_t ng = last ? 0 : g + 1, noff = last ? j1 % bt : off;
        const KvT* k = kv.row<KvT>(block, KvPart::key, g, off);
        const KvT* v = kv.row<KvT>(block, KvPart::value, g, off);
        const Ahead ka = ahead(k, nk, D, nb ? kv.row<KvT>(nb, KvPart::key, ng, noff) : nullptr);
        const Ahead va = ahead(v, nk, D, nb ? kv.row<KvT>(nb, KvPart::value, ng, noff) : nullptr);
        const float* kscale = nullptr;
        const float* vscale = nullptr;
        if constexpr (kRowScaled<KvT>) {
          kscale = kv.scales(block, KvPart::key, g, off);
          vscale = kv.scales(block, KvPart::value, g, off);
          if (nb) prefetch_scales(kv, nb, ng, noff, last ? run_keys(j1) : nk);
        }
        group_block(qs + h0 * ldqs, ldqs, kIntScores ? qsc + h0 : nullptr, G, k, v, kscale, vscale, nk, D, s, lds,
                    alpha, m + h0, l + h0, acc + h0 * D, a.shift, ka, va, vis);
      }
    }
  }
};

template <Isa Level, class Arch, class KvT>
const DecodeKernel& make_decode_kernel() {
  using K = DecodeAttention<Arch, KvT>;
  static const DecodeKernel kernel{Level, dtype_of<KvT>(), &K::scratch_floats, &K::run};
  return kernel;
}

}  // namespace
}  // namespace gpt2attn::kernels
