// kernels/attention_impl.hpp: the tiled attention algorithm described in attention.hpp, written once: the tile
// driver (TiledAttention: query packing, masks, online softmax, dropout, normalisation) over a micro-kernel that
// does the arithmetic of a score tile and a P.V tile (MicroF32: f32 products of f32 queries with K/V elements of
// type KvT widened to f32, a key tile at a time). A bf16 compute type is a second micro-kernel, nothing else.
// Included only by the one-line instantiation files; everything here has internal linkage so code compiled with
// AVX-512 flags can never be linked into the scalar path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/attention.hpp"
#include "kernels/bf16_dot.hpp"
#include "kernels/dropout.hpp"
#include "kernels/element.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

// The units the scores are kept in (see "Units" in attention.hpp), chosen once per call.
enum class Units { log2, natural };

// Calls f(std::integral_constant<int, rem>) for 1 <= rem <= RR: a ragged block keeps full register blocking
// instead of falling back to one row at a time.
template <int RR, class F>
void with_rows(int64_t rem, F&& f) {
  if constexpr (RR >= 1) {
    if (rem == RR) {
      f(std::integral_constant<int, RR>{});
    } else {
      with_rows<RR - 1>(rem, f);
    }
  }
}

// Calls f(std::integral_constant<int, F>) for the run-time 0 <= first < QV: the first query vector a block of keys
// reaches (Visible::first) becomes a compile-time loop bound, as with_rows does for a ragged row count.
template <int QV, int F = 0, class Fn>
void with_first(int first, Fn&& f) {
  if constexpr (F + 1 < QV) {
    if (first > F) return with_first<QV, F + 1>(first, f);
  }
  f(std::integral_constant<int, F>{});
}

// Calls f(std::integral_constant<int, F>) for F = 0, 1, ..., QV - 1 in order: P.V's key spans (Visible::span), each
// with its own compile-time first vector. A generic lambda, so the caller's accumulators stay in registers (a helper
// function taking them by reference kept them in memory).
template <int QV, class Fn>
void for_each_first(Fn&& f) {
  [&]<int... F>(std::integer_sequence<int, F...>) { (f(std::integral_constant<int, F>{}), ...); }(
      std::make_integer_sequence<int, QV>{});
}

// Which query vectors of a tile crossing the causal diagonal see each of its keys. Query i of the tile sees key j of
// the tile when i >= j + c (c = j0 - i0 - causal_offset), so key j is masked for every query of vectors
// v < first(j) = max(0, j + c) / W, which never decreases with j. A micro-kernel may leave those products out (their
// probabilities are exactly 0): the scores it does not compute it sets to -inf, and P.V runs over the tile's keys in
// spans of equal first(j) (span(f) is the first key with first(j) >= f). A tile below the diagonal has every key
// visible to every vector: all(), whose spans hold every key in first(j) = 0.
struct Visible {
  int64_t c = 0;
  bool diagonal = false;
  static Visible all() { return {}; }
  int first(int64_t j, int W, int QV) const {
    return diagonal ? static_cast<int>(std::min<int64_t>(std::max<int64_t>(0, j + c) / W, QV - 1)) : 0;
  }
  int64_t span(int f, int64_t nk, int W) const {
    if (f == 0) return 0;
    return diagonal ? std::clamp<int64_t>(int64_t{f} * W - c, 0, nk) : nk;
  }
};

// The micro-kernels of f32 arithmetic: QV query vectors (BQ = QV x lanes queries) x R rows of K (scores) or of D
// (P.V) in registers (tiles::Blocking has the register budget). Queries of type QT and K/V elements of type KvT are
// widened to f32 as they are packed or broadcast (`widen`, kernels/vec.hpp), so a narrower storage type (bf16 or
// int8 K/V, bf16 queries where the CPU has no bf16 dot product) reuses this arithmetic unchanged.
template <class Arch, int QV, int R, class KvT, class QT = float>
struct MicroF32 {
  using V = Vec<Arch>;
  using B = typename V::B;
  using Elem = KvT;
  using Query = QT;
  static constexpr int W = V::W;
  static constexpr int BQ = QV * W;  // queries per tile, in lanes

  // The query tile as score_rows reads it: transposed, qt (D, BQ), each row scaled by qscale (so scores() ignores
  // its own qscale); lanes past the last of the nq queries are zero.
  static int64_t packed_query_floats(int64_t D) { return D * BQ; }
  // f32 queries go W x W blocks at a time through registers (Vec::transpose); the rest, and bf16 queries, one
  // element at a time. Both multiply the same values, so the result is the same either way.
  static void pack_queries(const QT* q, int64_t ldq, int64_t nq, int64_t D, float qscale, float* qt) {
    int64_t d0 = 0;
    if constexpr (kBlocked) {
      const B c = V::set1(qscale);
      for (; d0 + W <= D; d0 += W) {
        for (int64_t i0 = 0; i0 + W <= nq; i0 += W) {
          B r[W];
          for (int i = 0; i < W; ++i) r[i] = V::load(q + (i0 + i) * ldq + d0) * c;
          V::transpose(r);
          for (int d = 0; d < W; ++d) V::store(qt + (d0 + d) * BQ + i0, r[d]);
        }
        for (int64_t d = d0; d < d0 + W; ++d) pack_column(q, ldq, nq / W * W, nq, d, qscale, qt);
      }
    }
    for (int64_t d = d0; d < D; ++d) pack_column(q, ldq, 0, nq, d, qscale, qt);
  }
  // Row d of qt from query i0 on: the queries' element d, scaled; zeros past the last query.
  static void pack_column(const QT* q, int64_t ldq, int64_t i0, int64_t nq, int64_t d, float qscale, float* qt) {
    for (int64_t i = i0; i < nq; ++i) qt[d * BQ + i] = widen(q[i * ldq + d]) * qscale;
    for (int64_t i = nq; i < BQ; ++i) qt[d * BQ + i] = 0.0f;
  }
  // Whether the transposes go through registers: f32 queries and outputs, on a vector instruction set.
  static constexpr bool kBlocked = std::is_same_v<QT, float> && W > 1;
  // K/V stored narrower than f32 (bf16, int8, fp8) are widened a tile at a time into the micro-kernel's scratch
  // (tile_rows), so that the inner loops broadcast f32 from memory, one load each: widening an element where it is
  // broadcast takes a scalar load, a shift or conversion and a move to a vector, for each of the R broadcasts per
  // QV x R FMAs. A bf16 layer on AVX2 (Zen 3) ran gpt2-large's T=1024 prefill at 179 ms against f32's 140 with the
  // per-broadcast widening (bench/peers, 2 threads). f32 K/V are read where they lie.
  static constexpr bool kWidenTiles = !std::is_same_v<KvT, float>;
  using TileElem = std::conditional_t<kWidenTiles, float, KvT>;  // what the inner loops read
  // Scratch of scores and accumulate_pv beyond the tile driver's own: one widened key tile (kWidenTiles).
  static int64_t pv_scratch_floats(int64_t D) { return kWidenTiles ? tiles::kKeyTile * D : 0; }
  // The key tile's rows [0, n) (row stride ld, D elements each, n <= tiles::kKeyTile) as the inner loops read them,
  // with their row stride: where they lie, or widened (exactly) into w with stride D.
  static std::pair<const TileElem*, int64_t> tile_rows(const KvT* x, int64_t ld, int64_t n, int64_t D, float* w) {
    if constexpr (kWidenTiles) {
      for (int64_t j = 0; j < n; ++j) {
        int64_t d = 0;
        for (; d + W <= D; d += W) V::store(w + j * D + d, V::load(x + j * ld + d));
        for (; d < D; ++d) w[j * D + d] = widen(x[j * ld + d]);
      }
      return {w, D};
    } else {
      return {x, ld};
    }
  }

  // out[i][d] = acc[d][i] * inv[i] for the nq queries, in the compute type: the tile's result, transposed.
  // f32 outputs in W x W blocks through registers, the rest one element at a time (the same products).
  // With `stream` (the driver's choice: a context past tiles::kStreamOutputMinBytes), where every block row is whole
  // 64-byte lines (AVX-512, out and ldo aligned to the vector: the engine's context rows at D a multiple of 16),
  // the blocks are streamed (Vec::stream): the context (T, E) is written once here and read next by the output
  // projection, and each of its lines missed in every cache level and was first read for ownership.
  // Core/gpt2-small/T:1024/threads:1, a scratch harness alternating the two kernels over 10 rounds: 0.943-0.950 of
  // the time, and 0.89 at T = 4096 on 2 threads, whose context is 12 MiB.
  static void store_output(float* acc, const float* inv, int64_t nq, int64_t D, QT* out, int64_t ldo, bool stream) {
    int64_t i0 = 0, d_end = 0;  // blocks cover queries [0, i0) x head dimensions [0, d_end)
    if constexpr (kBlocked) {
      d_end = D / W * W;
      stream = stream && V::kStreamsLines && reinterpret_cast<uintptr_t>(out) % sizeof(B) == 0 &&
               (ldo * static_cast<int64_t>(sizeof(float))) % static_cast<int64_t>(sizeof(B)) == 0;
      for (; i0 + W <= nq; i0 += W) {
        const B iv = V::load(inv + i0);
        for (int64_t d0 = 0; d0 < d_end; d0 += W) {
          B r[W];
          for (int d = 0; d < W; ++d) r[d] = V::load(acc + (d0 + d) * BQ + i0) * iv;
          V::transpose(r);
          if (stream) {
            for (int i = 0; i < W; ++i) V::stream(out + (i0 + i) * ldo + d0, r[i]);
          } else {
            for (int i = 0; i < W; ++i) V::store(out + (i0 + i) * ldo + d0, r[i]);
          }
        }
      }
      if (stream) V::stream_fence();
    }
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t d = i < i0 ? d_end : 0; d < D; ++d) out[i * ldo + d] = narrow<QT>(acc[d * BQ + i] * inv[i]);
    }
  }

  // s[j][lane] = K_j . qt_lane for RR key rows (in the units qt was scaled to); also folds the rows into the
  // running column max mx. K rows are broadcast, queries are vectors.
  // The sum over D runs in chunks of tiles::kScoreChunk, each in fresh registers, added to the partial score
  // spilled to s: with one accumulator over D = 256 this dot product was the largest error of the whole layer
  // where scores are large (score error 1.1-1.3e-4 -> 4-6e-5; "Accuracy" in attention.hpp has the figures).
  // Row-scaled K (int8): each key's score is multiplied by its scale kscale[r] before it is stored and maxed.
  // Vectors v < F are masked for all RR keys (Visible): not computed, their scores set to -inf.
  template <int RR, int F = 0, class E>
  static void score_rows(const E* k, int64_t ldk, const float* kscale, const float* qt, int64_t D, float* s,
                         B* mx) {
    B acc[RR][QV] = {};  // vectors v < F are never read; initialised so no compiler has to prove it
    for (int64_t d0 = 0;;) {
      const int64_t d1 = std::min<int64_t>(D, d0 + tiles::kScoreChunk);
      for (int r = 0; r < RR; ++r)
        for (int v = F; v < QV; ++v) acc[r][v] = V::set1(0.0f);
      for (int64_t d = d0; d < d1; ++d) {
        B q[QV];
        for (int v = F; v < QV; ++v) q[v] = V::load(qt + d * BQ + v * W);
        for (int r = 0; r < RR; ++r) {
          const B kb = V::set1(widen(k[r * ldk + d]));
          for (int v = F; v < QV; ++v) acc[r][v] = V::fma(kb, q[v], acc[r][v]);
        }
      }
      if (d0 > 0) {  // add the earlier chunks' sum
        for (int r = 0; r < RR; ++r)
          for (int v = F; v < QV; ++v) acc[r][v] = acc[r][v] + V::load(s + r * BQ + v * W);
      }
      if (d1 == D) break;
      for (int r = 0; r < RR; ++r)
        for (int v = F; v < QV; ++v) V::store(s + r * BQ + v * W, acc[r][v]);
      d0 = d1;
    }
    if constexpr (kRowScaled<KvT>) {
      for (int r = 0; r < RR; ++r)
        for (int v = F; v < QV; ++v) acc[r][v] = acc[r][v] * V::set1(kscale[r]);
    }
    for (int r = 0; r < RR; ++r) {
      for (int v = 0; v < F; ++v) V::store(s + r * BQ + v * W, V::set1(-INFINITY));
      for (int v = F; v < QV; ++v) {
        V::store(s + r * BQ + v * W, acc[r][v]);
        mx[v] = V::max(mx[v], acc[r][v]);
      }
    }
  }

  // acc[d][lane] = alpha[lane] * acc[d][lane] + sum_j V[j][d] * p[j][lane] for RR consecutive d; row-scaled V
  // (int8) multiplies p[j] by the value's scale vscale[j]. Keys go in the spans of `span` (QV + 1 bounds, see
  // Visible): keys [span[f], span[f + 1]) add to vectors f.. only, the others' p being 0.
  template <int RR, class E>
  static void pv_rows(const E* vcol, int64_t ldv, const float* vscale, const float* p, const int64_t* span,
                      const float* alpha, float* acc) {
    B c[RR][QV];
    for (int v = 0; v < QV; ++v) {
      const B al = V::load(alpha + v * W);
      for (int r = 0; r < RR; ++r) c[r][v] = V::load(acc + r * BQ + v * W) * al;
    }
    // Keys [span[F], span[F + 1]) into vectors F..QV-1.
    for_each_first<QV>([&]<int F>(std::integral_constant<int, F>) {
      for (int64_t j = span[F]; j < span[F + 1]; ++j) {
        B pj[QV];
        for (int v = F; v < QV; ++v) pj[v] = V::load(p + j * BQ + v * W);
        if constexpr (kRowScaled<KvT>) {
          for (int v = F; v < QV; ++v) pj[v] = pj[v] * V::set1(vscale[j]);
        }
        for (int r = 0; r < RR; ++r) {
          const B vb = V::set1(widen(vcol[j * ldv + r]));
          for (int v = F; v < QV; ++v) c[r][v] = V::fma(vb, pj[v], c[r][v]);
        }
      }
    });
    for (int r = 0; r < RR; ++r)
      for (int v = 0; v < QV; ++v) V::store(acc + r * BQ + v * W, c[r][v]);
  }

  // Scales from row j on (null, never offset, for types without scales).
  static const float* scales_from(const float* scales, int64_t j) {
    if constexpr (kRowScaled<KvT>) return scales + j;
    return nullptr;
  }

  // The whole score tile s (nk, BQ) = K (nk rows, stride ldk) . qt, register block by register block; kscale: the
  // keys' scales (row-scaled K only; null otherwise). qscale was applied by pack_queries. On a diagonal tile a
  // block of keys leaves out the vectors masked for its first key (vis), whose scores read -inf. work: the
  // widened tile (pv_scratch_floats).
  static void scores(const KvT* k_in, int64_t ldk_in, const float* kscale, int64_t nk, const float* qt, int64_t D,
                     float /*qscale*/, float* s, B* mx, const Visible& vis, float* work) {
    const auto [k, ldk] = tile_rows(k_in, ldk_in, nk, D, work);
    const auto block = [&]<int RR>(int64_t j, std::integral_constant<int, RR>) {
      with_first<QV>(vis.first(j, W, QV), [&]<int F>(std::integral_constant<int, F>) {
        score_rows<RR, F>(k + j * ldk, ldk, scales_from(kscale, j), qt, D, s + j * BQ, mx);
      });
    };
    int64_t j = 0;
    for (; j + R <= nk; j += R) block(j, std::integral_constant<int, R>{});
    if (j < nk) with_rows<R - 1>(nk - j, [&](auto rr) { block(j, rr); });
  }

  // acc (D, BQ) = alpha * acc + V^T (D x nk, V rows of stride ldv) . p (nk, BQ), R head dimensions at a time.
  // vscale: the values' scales (row-scaled V only; null otherwise). vis: which vectors each key reaches.
  static void accumulate_pv(const KvT* v_in, int64_t ldv_in, const float* vscale, int64_t nk, const float* p,
                            const float* alpha, int64_t D, float* acc, float* work, const Visible& vis) {
    const auto [v, ldv] = tile_rows(v_in, ldv_in, nk, D, work);
    int64_t span[QV + 1];
    for (int f = 0; f < QV; ++f) span[f] = vis.span(f, nk, W);
    span[QV] = nk;
    int64_t d = 0;
    for (; d + R <= D; d += R) pv_rows<R>(v + d, ldv, vscale, p, span, alpha, acc + d * BQ);
    if (d < D) {
      with_rows<R - 1>(D - d, [&](auto rr) {
        pv_rows<decltype(rr)::value>(v + d, ldv, vscale, p, span, alpha, acc + d * BQ);
      });
    }
  }
};

// The micro-kernels of bf16 compute (queries and K/V stored bf16) on a bf16 dot product (kernels/bf16_dot.hpp:
// vdpbf16ps, or its one-lane twin): each instruction multiplies pairs of bf16 and adds both products to an f32
// accumulator, twice the multiply-adds of an f32 FMA. The same register blocking as MicroF32, with pairs:
//   scores: qt holds the query tile as pairs over D, qt (ceil(D/2), BQ); a key row's pair (k[2e], k[2e+1]) is
//     broadcast as one 32-bit value. The queries are packed unscaled (already bf16: exact), and the f32 score is
//     multiplied by qscale after the dot product, so no second rounding of q * scale enters.
//   P.V: P is rounded to bf16 in pairs over keys, p2 (ceil(nk/2), BQ); V's rows are interleaved in pairs,
//     vp (ceil(nk/2), D): vp[e][d] = (V[2e][d], V[2e+1][d]), so each d's pair is one broadcast. The rounding of P
//     is the only one besides the stored Q, K, V; the running max, sum and the accumulator stay f32.
// An odd D or nk pairs its last element with a zero, never reading past a row or a tile.
template <class Arch, int QV, int R>
struct MicroBf16Dot {
  using Dot = Bf16Dot<Arch>;
  using V = Vec<Arch>;
  using B = typename V::B;
  using P = typename Dot::P;
  using Elem = bf16;
  using Query = bf16;
  static constexpr int W = V::W;
  static constexpr int BQ = QV * W;
  static_assert(Dot::W == W, "the dot product's lanes are the vector's");

  static int64_t pairs(int64_t n) { return (n + 1) / 2; }
  static int64_t packed_query_floats(int64_t D) { return pairs(D) * BQ; }  // one 32-bit pair per float
  static void pack_queries(const bf16* q, int64_t ldq, int64_t nq, int64_t D, float /*qscale*/, float* qt_raw) {
    uint32_t* qt = reinterpret_cast<uint32_t*>(qt_raw);
    for (int64_t e = 0; e < pairs(D); ++e) {
      const bool hi = 2 * e + 1 < D;
      for (int64_t i = 0; i < nq; ++i) qt[e * BQ + i] = bf16_pair(q + i * ldq + 2 * e, hi);
      for (int64_t i = nq; i < BQ; ++i) qt[e * BQ + i] = 0;
    }
  }
  // p2 (ceil(BK/2), BQ) | vp (ceil(BK/2), D), in pairs.
  static int64_t pv_scratch_floats(int64_t D) { return pairs(tiles::kKeyTile) * (BQ + D); }

  // As MicroF32's, with the scaling and the rounding to bf16 done a vector at a time, in place in acc (row d's
  // bf16 values in the first half of its bytes), so only the transposed 16-bit copy is per element (the scalar
  // rounding loop was a tenth of the tile's time).
  static void store_output(float* acc, const float* inv, int64_t nq, int64_t D, bf16* out, int64_t ldo,
                           bool /*stream*/) {
    for (int64_t d = 0; d < D; ++d) {
      float* row = acc + d * BQ;
      for (int v = 0; v < QV; ++v) V::store(row + v * W, V::load(row + v * W) * V::load(inv + v * W));
      for (int v = 0; v < QV; ++v) Dot::narrow(row + v * W, reinterpret_cast<bf16*>(row) + v * W);
    }
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t d = 0; d < D; ++d) {
        std::memcpy(out + i * ldo + d, reinterpret_cast<const bf16*>(acc + d * BQ) + i, sizeof(bf16));
      }
    }
  }

  // Vectors v < F are masked for all RR keys (Visible): not computed, their scores set to -inf.
  template <int RR, int F = 0>
  static void score_rows(const bf16* k, int64_t ldk, const uint32_t* qt, int64_t D, float qscale, float* s, B* mx) {
    const int64_t full = D / 2, chunk = tiles::kScoreChunk / 2;
    B acc[RR][QV] = {};  // vectors v < F are never read; initialised so no compiler has to prove it
    for (int64_t e0 = 0;;) {
      const int64_t e1 = std::min<int64_t>(pairs(D), e0 + chunk);
      for (int r = 0; r < RR; ++r)
        for (int v = F; v < QV; ++v) acc[r][v] = V::set1(0.0f);
      for (int64_t e = e0; e < e1; ++e) {
        P q[QV];
        for (int v = F; v < QV; ++v) q[v] = Dot::load(qt + e * BQ + v * W);
        const bool hi = e < full;  // false only for the odd tail
        for (int r = 0; r < RR; ++r) {
          uint32_t pair;
          if (hi) {
            std::memcpy(&pair, k + r * ldk + 2 * e, sizeof pair);
          } else {
            pair = bf16_pair(k + r * ldk + 2 * e, false);
          }
          const P kb = Dot::broadcast(pair);
          for (int v = F; v < QV; ++v) acc[r][v] = Dot::dot2(acc[r][v], kb, q[v]);
        }
      }
      if (e0 > 0) {
        for (int r = 0; r < RR; ++r)
          for (int v = F; v < QV; ++v) acc[r][v] = acc[r][v] + V::load(s + r * BQ + v * W);
      }
      if (e1 == pairs(D)) break;
      for (int r = 0; r < RR; ++r)
        for (int v = F; v < QV; ++v) V::store(s + r * BQ + v * W, acc[r][v]);
      e0 = e1;
    }
    const B qs = V::set1(qscale);
    for (int r = 0; r < RR; ++r) {
      for (int v = 0; v < F; ++v) V::store(s + r * BQ + v * W, V::set1(-INFINITY));
      for (int v = F; v < QV; ++v) {
        const B x = acc[r][v] * qs;
        V::store(s + r * BQ + v * W, x);
        mx[v] = V::max(mx[v], x);
      }
    }
  }

  // As MicroF32's: on a diagonal tile a block of keys leaves out the vectors masked for its first key.
  static void scores(const bf16* k, int64_t ldk, const float* /*kscale*/, int64_t nk, const float* qt_raw, int64_t D,
                     float qscale, float* s, B* mx, const Visible& vis, float* /*work*/) {
    const uint32_t* qt = reinterpret_cast<const uint32_t*>(qt_raw);
    const auto block = [&]<int RR>(int64_t j, std::integral_constant<int, RR>) {
      with_first<QV>(vis.first(j, W, QV), [&]<int F>(std::integral_constant<int, F>) {
        score_rows<RR, F>(k + j * ldk, ldk, qt, D, qscale, s + j * BQ, mx);
      });
    };
    int64_t j = 0;
    for (; j + R <= nk; j += R) block(j, std::integral_constant<int, R>{});
    if (j < nk) with_rows<R - 1>(nk - j, [&](auto rr) { block(j, rr); });
  }

  // acc[d][lane] = alpha[lane] * acc[d][lane] + sum_e vp[e][d] . p2[e][lane] for RR consecutive d, the key pairs
  // in spans as MicroF32::pv_rows's keys: pairs [span[f], span[f + 1]) add to vectors f.. only.
  template <int RR>
  static void pv_rows(const uint32_t* vp, int64_t D, const uint32_t* p2, const int64_t* span, const float* alpha,
                      float* acc) {
    B c[RR][QV];
    for (int v = 0; v < QV; ++v) {
      const B al = V::load(alpha + v * W);
      for (int r = 0; r < RR; ++r) c[r][v] = V::load(acc + r * BQ + v * W) * al;
    }
    for_each_first<QV>([&]<int F>(std::integral_constant<int, F>) {
      for (int64_t e = span[F]; e < span[F + 1]; ++e) {
        P pe[QV];
        for (int v = F; v < QV; ++v) pe[v] = Dot::load(p2 + e * BQ + v * W);
        for (int r = 0; r < RR; ++r) {
          const P vb = Dot::broadcast(vp[e * D + r]);
          for (int v = F; v < QV; ++v) c[r][v] = Dot::dot2(c[r][v], vb, pe[v]);
        }
      }
    });
    for (int r = 0; r < RR; ++r)
      for (int v = 0; v < QV; ++v) V::store(acc + r * BQ + v * W, c[r][v]);
  }

  static void accumulate_pv(const bf16* v, int64_t ldv, const float* /*vscale*/, int64_t nk, const float* p,
                            const float* alpha, int64_t D, float* acc, float* work, const Visible& vis) {
    const int64_t np = pairs(nk);
    // Pair e holds keys 2e and 2e + 1 and feeds every vector its first key does: the pair spans start at the
    // first pair whose first key starts a key span (rounded up).
    int64_t span[QV + 1];
    for (int f = 0; f < QV; ++f) span[f] = (vis.span(f, nk, W) + 1) / 2;
    span[QV] = np;
    uint32_t* p2 = reinterpret_cast<uint32_t*>(work);
    uint32_t* vp = p2 + pairs(tiles::kKeyTile) * BQ;
    // P in pairs over keys; an odd last key pairs with zeros (the row past it in s is not this tile's).
    alignas(64) static constexpr float kZeros[BQ] = {};
    for (int64_t e = 0; e < np; ++e) {
      const float* hi = 2 * e + 1 < nk ? p + (2 * e + 1) * BQ : kZeros;
      for (int q = 0; q < QV; ++q) Dot::pack(p + 2 * e * BQ + q * W, hi + q * W, p2 + e * BQ + q * W);
    }
    for (int64_t e = 0; e < np; ++e) {
      Dot::interleave(v + 2 * e * ldv, 2 * e + 1 < nk ? v + (2 * e + 1) * ldv : nullptr, D, vp + e * D);
    }
    int64_t d = 0;
    for (; d + R <= D; d += R) pv_rows<R>(vp + d, D, p2, span, alpha, acc + d * BQ);
    if (d < D) {
      with_rows<R - 1>(D - d, [&](auto rr) { pv_rows<decltype(rr)::value>(vp + d, D, p2, span, alpha, acc + d * BQ); });
    }
  }
};

// The tile driver over a micro-kernel M (M::BQ queries per tile, M::Elem the K/V element type, M::Query the
// element type of the queries and of the output: the compute type).
template <class Arch, class M>
struct TiledAttention {
  using V = Vec<Arch>;
  using B = typename V::B;
  using KvT = typename M::Elem;
  using QT = typename M::Query;
  static constexpr int W = V::W;
  static constexpr int QV = M::BQ / W;
  static constexpr int BQ = M::BQ;
  static constexpr int BK = tiles::kKeyTile;

  // A call takes its query tiles in groups of up to kGroup (tiles::kQueryTileGroup): for each key tile, every tile
  // of the group in turn, so a key tile read from L3 or memory serves the whole group from L1/L2. Each tile keeps
  // its own state (packed queries, accumulators, running max and sum) and sees its keys in the same order as alone,
  // so the results do not depend on the grouping.
  static constexpr int kGroup = tiles::kQueryTileGroup;

  // One query tile's state: qt (the micro-kernel's packed queries) | acc (D, BQ) | m (BQ) | l (BQ) | alpha (BQ).
  static int64_t state_floats(int64_t D) { return M::packed_query_floats(D) + (D + 3) * BQ; }
  // Scratch: s (BK, BQ) | kGroup tile states | the micro-kernel's P.V work area.
  static size_t scratch_floats(int64_t D) {
    return static_cast<size_t>(BK * BQ + kGroup * state_floats(D) + M::pv_scratch_floats(D));
  }

  // Query tiles a call should be given at once for K/V of Tk rows of D elements: a group where one head's K and V
  // pass tiles::kCorePrefetchMinBytes (no longer kept in L2 from one query tile to the next), one tile otherwise,
  // where smaller work items balance threads better.
  static int64_t tiles_per_call(int64_t Tk, int64_t D) { return past_l2(Tk, D) ? kGroup : 1; }
  // Whether the K and V rows of `keys` keys (D elements each) pass tiles::kCorePrefetchMinBytes: the length past
  // which the core groups query tiles (tiles_per_call) and prefetches each next key tile (group).
  static bool past_l2(int64_t keys, int64_t D) {
    return 2 * keys * D * static_cast<int64_t>(sizeof(KvT)) > tiles::kCorePrefetchMinBytes;
  }

  // The K/V source and the units are compile-time choices, made here once per call: paged K/V keeps its own
  // instantiation, and so does an additive mask (natural units), so that every other call keeps the log2-unit
  // instruction stream of the contiguous path untouched.
  static void run(const AttentionArgs& a, int64_t q_begin, int64_t q_end, float* scratch) {
    const bool natural = a.mask.data && a.mask.mode == MaskMode::additive;
    if constexpr (kRowScaled<KvT>) {  // quantised K/V exist only in cache blocks
      with_units<PagedKv<KvT>>(natural, a, q_begin, q_end, scratch);
    } else if (a.kv.blocks) {
      with_units<PagedKv<KvT>>(natural, a, q_begin, q_end, scratch);
    } else {
      with_units<ContiguousKv<KvT>>(natural, a, q_begin, q_end, scratch);
    }
  }

  template <class Src>
  static void with_units(bool natural, const AttentionArgs& a, int64_t q_begin, int64_t q_end, float* scratch) {
    const Src src(a.kv);
    for (int64_t g0 = q_begin; g0 < q_end; g0 += kGroup * BQ) {
      const int64_t g1 = std::min<int64_t>(g0 + kGroup * BQ, q_end);
      if (natural) {
        group<Units::natural>(a, src, g0, g1, scratch);
      } else {
        group<Units::log2>(a, src, g0, g1, scratch);
      }
    }
  }

  static float mask_value(const MaskRef& mk, int64_t i, int64_t j) {
    const int64_t at = i * mk.stride_i + j * mk.stride_j;
    return mk.dtype == MaskDType::u8 ? static_cast<float>(static_cast<const uint8_t*>(mk.data)[at])
                                     : static_cast<const float*>(mk.data)[at];
  }

  // One query tile of a group: queries [i0, i1), which see keys [0, kend), and its state in the scratch.
  struct Tile {
    int64_t i0 = 0, i1 = 0, kend = 0;
    float *qt = nullptr, *acc = nullptr, *m = nullptr, *l = nullptr, *alpha = nullptr;
  };

  // Queries [g0, g1), at most kGroup tiles, over the key tiles in order.
  template <Units units, class Src>
  static void group(const AttentionArgs& a, const Src& src, int64_t g0, int64_t g1, float* scratch) {
    constexpr bool natural = units == Units::natural;
    const int64_t D = a.D;
    float* s = scratch;
    float* states = s + BK * BQ;
    float* pv_work = states + kGroup * state_floats(D);

    // Scores come out as log2(e) * scale * q.k, so the softmax runs on exp2 (natural units: scale * q.k, as torch
    // computes it); the micro-kernel applies qscale when it packs the queries or after each dot product.
    const float qscale = natural ? a.scale : a.scale * kLog2e;
    Tile t[kGroup];
    int n = 0;
    int64_t kmax = 0;
    for (int64_t i0 = g0; i0 < g1; i0 += BQ, ++n) {
      Tile& x = t[n];
      x.i0 = i0;
      x.i1 = std::min<int64_t>(i0 + BQ, g1);
      // The last query of the tile sees keys up to i1 - 1 + offset; nothing beyond is touched.
      x.kend = a.causal ? std::clamp<int64_t>(x.i1 + a.causal_offset, 0, a.Tk) : a.Tk;
      x.qt = states + n * state_floats(D);
      x.acc = x.qt + M::packed_query_floats(D);
      x.m = x.acc + D * BQ;
      x.l = x.m + BQ;
      x.alpha = x.l + BQ;
      M::pack_queries(static_cast<const QT*>(a.q) + i0 * a.ldq, a.ldq, x.i1 - i0, D, qscale, x.qt);
      std::fill(x.acc, x.acc + D * BQ, 0.0f);
      std::fill(x.m, x.m + BQ, -INFINITY);
      std::fill(x.l, x.l + BQ, 0.0f);
      kmax = std::max(kmax, x.kend);
    }

    const bool fetch_next = past_l2(kmax, D);
    int64_t nk = 0;
    for (int64_t j0 = 0; j0 < kmax; j0 += nk) {
      // A tile of the group whose queries see fewer keys (kend) takes this key tile's first keys only.
      nk = key_tile(src, j0, kmax);

      // At long context (tiles::kCorePrefetchMinBytes) the next key tile's K and V rows are asked for now, into L2,
      // by the first tile that reads this one: a tile's K and V then come from the last-level cache or memory, and
      // this tile's arithmetic hides that.
      const int64_t j1 = j0 + nk;
      const int64_t nk1 = fetch_next && j1 < kmax ? key_tile(src, j1, kmax) : 0;
      bool first = true;
      for (int g = 0; g < n; ++g) {
        if (j0 >= t[g].kend) continue;
        step<units>(a, src, t[g], qscale, j0, std::min(nk, t[g].kend - j0), first ? j1 : 0, first ? nk1 : 0, s,
                    pv_work);
        first = false;
      }
    }

    // The rows of the output this call's slice spans (T rows of ldo): streamed past the caches when larger than
    // they hold (tiles::kStreamOutputMinBytes).
    const bool stream_out = a.T * a.ldo * static_cast<int64_t>(sizeof(QT)) > tiles::kStreamOutputMinBytes;
    for (int g = 0; g < n; ++g) {
      // out_i = acc_i / l_i; a query that saw no key (l == 0) gets zeros, never NaN. 1 / l goes in alpha (free now).
      const Tile& x = t[g];
      const int64_t nq = x.i1 - x.i0;
      const bool overflowed = !all_finite(x.acc, D, nq);  // before store_output, which may narrow acc in place
      for (int64_t i = 0; i < BQ; ++i) x.alpha[i] = i < nq && x.l[i] > 0.0f ? 1.0f / x.l[i] : 0.0f;
      M::store_output(x.acc, x.alpha, nq, D, static_cast<QT*>(a.out) + x.i0 * a.ldo, a.ldo, stream_out);
      if (overflowed) rescue<units>(a, src, x, qscale, s, pv_work);
    }
  }

  // Keys in the key tile from j0 (< end): BK, or fewer at `end` and where the source's run ends (a block boundary).
  template <class Src>
  static int64_t key_tile(const Src& src, int64_t j0, int64_t end) {
    return std::min<int64_t>(BK, std::min(end, src.run_end(j0)) - j0);
  }

  // Whether queries [0, nq) of acc (D, BQ) are all finite: x - x is 0 for a finite x and NaN otherwise.
  static bool all_finite(const float* acc, int64_t D, int64_t nq) {
    B z[QV];
    for (int v = 0; v < QV; ++v) z[v] = V::set1(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      for (int v = 0; v < QV; ++v) {
        const B x = V::load(acc + d * BQ + v * W);
        z[v] = z[v] + (x - x);
      }
    }
    alignas(64) float lanes[BQ];
    for (int v = 0; v < QV; ++v) V::store(lanes + v * W, z[v]);
    for (int64_t i = 0; i < nq; ++i) {
      if (lanes[i] != 0.0f) return false;
    }
    return true;
  }

  // Tile x again over all its keys with every exponent lowered by kRescueShift (attention.hpp, "Overflow"); the
  // outputs store_output left non-finite take this run's acc / l.
  template <Units units, class Src>
  static void rescue(const AttentionArgs& a, const Src& src, const Tile& x, float qscale, float* s, float* pv_work) {
    const int64_t D = a.D, nq = x.i1 - x.i0;
    std::fill(x.acc, x.acc + D * BQ, 0.0f);
    std::fill(x.m, x.m + BQ, -INFINITY);
    std::fill(x.l, x.l + BQ, 0.0f);
    int64_t nk = 0;
    for (int64_t j0 = 0; j0 < x.kend; j0 += nk) {
      nk = key_tile(src, j0, x.kend);
      step<units, true>(a, src, x, qscale, j0, nk, 0, 0, s, pv_work);
    }
    QT* out = static_cast<QT*>(a.out) + x.i0 * a.ldo;
    for (int64_t i = 0; i < nq; ++i) {
      const float inv = x.l[i] > 0.0f ? 1.0f / x.l[i] : 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        QT& o = out[i * a.ldo + d];
        if (!std::isfinite(widen(o))) o = narrow<QT>(x.acc[d * BQ + i] * inv);
      }
    }
  }

  // Query tile `tile` over keys [j0, j0 + nk), its queries packed with qscale (group()): scores, masks, the online
  // softmax's update and P.V. nk1 > 0: prefetch the nk1 keys from j1 on (the next key tile) into L2 once the scores
  // are done. shifted: the exponents are lowered by kRescueShift (rescue()).
  template <Units units, bool shifted = false, class Src>
  static void step(const AttentionArgs& a, const Src& src, const Tile& tile, float qscale, int64_t j0, int64_t nk,
                   int64_t j1, int64_t nk1, float* s, float* pv_work) {
    constexpr bool natural = units == Units::natural;
    const int64_t D = a.D, i0 = tile.i0, nq = tile.i1 - tile.i0;
    float *qt = tile.qt, *acc = tile.acc, *m = tile.m, *l = tile.l, *alpha = tile.alpha;
    const int64_t ldk = src.key_stride(), ldv = src.value_stride();
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KvT));
    const KvT* kt = src.keys(j0);
    const KvT* vt = src.values(j0);
    const KvT* kn = nk1 > 0 ? src.keys(j1) : nullptr;
    const KvT* vn = nk1 > 0 ? src.values(j1) : nullptr;

    // A tile crossing the diagonal (some key past the first query's horizon) is causally masked; its keys'
    // visible query vectors let the micro-kernel leave out the products that are masked anyway.
    const bool diagonal = a.causal && j0 + nk - 1 > i0 + a.causal_offset;
    const Visible vis = diagonal ? Visible{j0 - i0 - a.causal_offset, true} : Visible::all();
    B mx[QV];
    for (int v = 0; v < QV; ++v) mx[v] = V::load(m + v * W);
    M::scores(kt, ldk, src.key_scales(j0), nk, qt, D, qscale, s, mx, vis, pv_work);
    for (int64_t j = 0; j < nk1; ++j) {
      for (int64_t b = 0; b < row_bytes; b += 64) {
        prefetch_l2(kn + j * ldk, static_cast<size_t>(b));
        prefetch_l2(vn + j * ldv, static_cast<size_t>(b));
      }
    }
    bool masked = false;  // any mask changes scores after mx was taken: recompute it then

    if (diagonal) {
      // Query i0 + v W + k sees key j0 + j iff v W + k >= j + vis.c: vector v hides its first j + vis.c - v W lanes.
      masked = true;
      for (int64_t j = 0; j < nk; ++j) {
        for (int v = 0; v < QV; ++v) {
          const int64_t hidden = j + vis.c - int64_t{v} * W;
          if (hidden <= 0) break;
          float* sv = s + j * BQ + v * W;
          V::store(sv, hidden >= W ? V::set1(-INFINITY) : V::mask_lanes_below(V::load(sv), hidden));
        }
      }
    }
    if (a.key_padding.data) {
      masked = true;
      for (int64_t j = 0; j < nk; ++j) {
        if (mask_value(a.key_padding, 0, j0 + j) != 0.0f) std::fill(s + j * BQ, s + (j + 1) * BQ, -INFINITY);
      }
    }
    if (a.mask.data) {
      masked = true;
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t j = 0; j < nk; ++j) {
          const float x = mask_value(a.mask, i0 + i, j0 + j);
          float& sc = s[j * BQ + i];
          switch (a.mask.mode) {
            case MaskMode::additive: sc += x; break;  // only in natural units: exactly torch's s + x
            case MaskMode::keep: if (x == 0.0f) sc = -INFINITY; break;
            case MaskMode::block: if (x != 0.0f) sc = -INFINITY; break;
          }
        }
      }
    }

    // Online softmax: new running max, rescale factor, exponentials in place, running sum.
    for (int v = 0; v < QV; ++v) {
      const B m_old = V::load(m + v * W);
      B m_new = mx[v];
      if (masked) {
        m_new = m_old;
        for (int64_t j = 0; j < nk; ++j) m_new = V::max(m_new, V::load(s + j * BQ + v * W));
      }
      const B m_safe = V::finite_or_zero(m_new);
      B sum = V::set1(0.0f);
      for (int64_t j = 0; j < nk; ++j) {
        B x = V::load(s + j * BQ + v * W) - m_safe;
        if constexpr (natural) x = x * V::set1(kLog2e);  // after the subtraction: cannot overflow upward
        if constexpr (shifted) x = x - V::set1(kRescueShift);
        const B p = V::exp2(x);
        V::store(s + j * BQ + v * W, p);
        sum = sum + p;
      }
      B dm = m_old - m_safe;
      if constexpr (natural) dm = dm * V::set1(kLog2e);
      const B al = V::exp2(dm);
      V::store(alpha + v * W, al);
      V::store(m + v * W, m_new);
      V::store(l + v * W, V::fma(V::load(l + v * W), al, sum));
    }

    if (a.dropout_p > 0.0f) {
      const float keep_scale = 1.0f / (1.0f - a.dropout_p);
      for (int64_t j = 0; j < nk; ++j) {
        for (int64_t i = 0; i < nq; ++i) {
          const uint64_t n = a.dropout_base + static_cast<uint64_t>((i0 + i) * a.Tk + (j0 + j));
          s[j * BQ + i] *= dropout_uniform(a.dropout_seed, n) >= a.dropout_p ? keep_scale : 0.0f;
        }
      }
    }

    M::accumulate_pv(vt, ldv, src.value_scales(j0), nk, s, alpha, D, acc, pv_work, vis);
  }
};

// The kernel over micro-kernel M for instruction set Arch (compiled at level Level), reading queries of type QT and
// K/V of type KvT.
template <Isa Level, class Arch, class M, class QT, class KvT>
const AttentionKernel& make_attention_kernel_with() {
  using K = TiledAttention<Arch, M>;
  static const AttentionKernel kernel{Level,    dtype_of<QT>(), dtype_of<KvT>(),       {K::BQ, K::BK},
                                      &K::scratch_floats, &K::tiles_per_call, &K::run};
  return kernel;
}

// The kernel of f32 arithmetic on queries of type QT (the compute type) and K/V stored as KvT, with register
// blocking Bl, for instruction set Arch.
template <Isa Level, class Arch, tiles::Blocking Bl, class KvT, class QT = float>
const AttentionKernel& make_attention_kernel() {
  return make_attention_kernel_with<Level, Arch, MicroF32<Arch, Bl.query_vectors, Bl.row_block, KvT, QT>, QT, KvT>();
}

// The kernel of bf16 compute on the bf16 dot product (bf16 queries and K/V), with register blocking Bl.
template <Isa Level, class Arch, tiles::Blocking Bl>
const AttentionKernel& make_attention_kernel_bf16dot() {
  return make_attention_kernel_with<Level, Arch, MicroBf16Dot<Arch, Bl.query_vectors, Bl.row_block>, bf16, bf16>();
}

}  // namespace
}  // namespace gpt2attn::kernels
