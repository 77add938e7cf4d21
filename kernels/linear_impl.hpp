// kernels/linear_impl.hpp: the few-row linear layer of linear.hpp, written once over Vec<Arch>: one loop that streams
// the panels (stream_panels) under two micro-kernels, the compute types' (f32 or bf16 weights widened to f32 as they
// are loaded, FMAs) and the quantized formats' (int8 or int4 codes in integer dot products with x quantized to int16).
// Included only by kernels/kernel_sets_impl.hpp, in each level's file (internal linkage, like attention_impl.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/element.hpp"
#include "kernels/int_dot.hpp"
#include "kernels/linear.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

// The panels' loop, shared by both micro-kernels: per group of PG panels, K in equal chunks of at most kLinearKChunk
// (multiples of `align` inputs), each streamed by every row block of RB rows in turn from L1/L2 while the next is
// prefetched, so the weights come from memory once, overlapped with the arithmetic. Kp: the inputs a panel holds
// (linear_padded_k), bytes_per_k: a panel's bytes per input. block(rows, panels, p0, m0, k0, k1, prefetch) computes.
// The next chunk (this group's next K chunk, or the next group's first) is prefetched into L2 while the row blocks
// compute on this one: row block i of nb asks for the i-th nb-th of each panel's bytes, at `step` bytes per k
// (bytes_per_k / nb), so the fetch keeps pace with the arithmetic for any M.
struct Prefetch {
  uintptr_t start;  // this block's first line of the next chunk in the first panel (an address only: past W's end
                    // after the last group)
  int64_t step;     // bytes per k
};
template <int RB, int PG, class Block>
void stream_panels(const LinearArgs& a, int64_t Kp, int64_t bytes_per_k, int64_t align, int64_t panel_begin,
                   int64_t panel_end, Block&& block) {
  const int64_t chunks = (a.K + tiles::kLinearKChunk - 1) / tiles::kLinearKChunk;
  const int64_t kc = ((a.K + chunks - 1) / chunks + align - 1) / align * align, blocks = (a.M + RB - 1) / RB;
  const uintptr_t w = reinterpret_cast<uintptr_t>(a.w_packed);
  for (int64_t p0 = panel_begin; p0 < panel_end; p0 += PG) {
    const int64_t pp = std::min<int64_t>(PG, panel_end - p0);
    for (int64_t k0 = 0; k0 < a.K; k0 += kc) {
      const int64_t k1 = std::min(a.K, k0 + kc);
      // The next chunk: this group's next, or after the last one the next group's first.
      const int64_t next_panel = k1 < a.K ? p0 : p0 + pp, next_k = k1 < a.K ? k1 : 0;
      const uintptr_t next = w + (next_panel * Kp + next_k) * bytes_per_k;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t m0 = i * RB, rr = std::min<int64_t>(RB, a.M - m0);
        const int64_t first = i * kc / blocks, ks = (i + 1) * kc / blocks - first;  // this block's share of k
        const Prefetch pf{next + first * bytes_per_k, ks * bytes_per_k / (k1 - k0)};
        block(rr, pp, p0, m0, k0, k1, pf);
      }
    }
  }
}

// block<RR, PP> of kernel L for every 1 <= RR <= RB, 1 <= PP <= PG, at [(RR-1) * PG + PP-1]: ragged row blocks and
// panel groups keep full register blocking.
template <class L, int... I>
constexpr std::array<typename L::BlockFn, sizeof...(I)> block_table(std::integer_sequence<int, I...>) {
  return {&L::template block<I / L::PG + 1, I % L::PG + 1>...};
}

// Row m's sums for panel p that the previous K chunk left in y, or null for a chunk starting at k = 0: y itself, or
// for a partial last panel its columns below N copied into buf with 0 past them (store_panel is the way back).
[[gnu::always_inline]] inline const float* partial_sums(const LinearArgs& a, int64_t p, int64_t m, bool first_chunk,
                                                        float (&buf)[kLinearPanel]) {
  if (first_chunk) return nullptr;
  const int64_t n0 = p * kLinearPanel, width = std::min<int64_t>(kLinearPanel, a.N - n0);
  const float* src = a.y + m * a.ldy + n0;
  if (width == kLinearPanel) return src;
  std::fill_n(buf, kLinearPanel, 0.0f);
  std::copy_n(src, width, buf);
  return buf;
}

// Row m's outputs of panel p from its PV vectors o: with `last`, times `row_scales` (int8's, or null) plus the bias;
// stored into y, only the columns below N of a partial last panel.
template <class V, int PV>
[[gnu::always_inline]] inline void store_panel(const LinearArgs& a, int64_t p, int64_t m, const typename V::B* o,
                                               bool last, const float* row_scales) {
  constexpr int W = V::W;
  const int64_t n0 = p * kLinearPanel, width = std::min<int64_t>(kLinearPanel, a.N - n0);
  float bias[kLinearPanel] = {};  // the last panel may be partial
  if (last && a.bias) std::copy_n(a.bias + n0, width, bias);
  float* y = a.y + m * a.ldy + n0;
  float out[kLinearPanel];
  #pragma GCC unroll 32
  for (int v = 0; v < PV; ++v) {
    typename V::B r = o[v];
    if (last) {
      const typename V::B b = V::load(bias + v * W);
      r = row_scales ? V::fma(r, V::load(row_scales + v * W), b) : r + b;
    }
    if (width == kLinearPanel) {
      V::store(y + v * W, r);
    } else {
      V::store(out + v * W, r);
    }
  }
  if (width < kLinearPanel) std::copy_n(out, width, y);
}

// The compute types: WT float or bf16, widened to f32 as loaded.
template <class Arch, class WT>
struct Linear {
  using V = Vec<Arch>;
  using B = typename V::B;
  static constexpr int W = V::W;
  static constexpr int PV = static_cast<int>(kLinearPanel) / W;  // vectors per panel
  static constexpr int RB = tiles::linear_row_block(W);          // rows per block (reasons in tiles.hpp)
  static constexpr int PG = tiles::linear_panel_group(W);        // panels per block (reasons in tiles.hpp)
  static constexpr int64_t kBytesPerK = kLinearPanel * static_cast<int64_t>(sizeof(WT));  // of one panel
  static constexpr bool kPairs = std::is_same_v<WT, bf16>;  // bf16 panels hold input pairs (kernels/linear.hpp)

  // y[m0 .. m0+RR) x the outputs of panels [p0, p0+PP), for k in [k0, k1): starts from 0 when k0 == 0, else from the
  // partial sums in y, and when k1 == K adds the bias. Per k: PP*PV weight loads (widened) + RR broadcasts for
  // RR*PP*PV FMAs, and PP prefetches (bf16: per pair of inputs). Every loop over j, v, r and i is unrolled by pragma
  // so acc[][] lives in registers: with bf16 weights GCC 12's own heuristic stops unrolling (the widening load is a
  // longer body), keeps acc in memory and the kernel ran at a third of the f32 one's speed (measured: 23 vs 70 GB/s
  // at N=2304, K=768, M=1).
  template <int RR, int PP>
  static void block(const LinearArgs& a, int64_t p0, int64_t m0, int64_t k0, int64_t k1, Prefetch pf) {
    constexpr int NV = PP * PV;                         // accumulator vectors per row
    const int64_t pstride = a.K * kBytesPerK;           // bytes per panel
    B acc[RR][NV];
    #pragma GCC unroll 32
    for (int j = 0; j < PP; ++j) {
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        float in[kLinearPanel];
        const float* src = partial_sums(a, p0 + j, m0 + r, k0 == 0, in);
        #pragma GCC unroll 32
        for (int v = 0; v < PV; ++v) acc[r][j * PV + v] = src ? V::load(src + v * W) : V::set1(0.0f);
      }
    }
    const std::byte* w = static_cast<const std::byte*>(a.w_packed) + p0 * pstride;
    const float* x = a.x + m0 * a.ldx;
    // Input k's weights in `panels` (H: which of a bf16 pair, or -1 for an input stored alone) times every row's x[k].
    // Each input alone and each pair's first prefetch the next chunk's share (pf) into L2: L1 holds the chunk being
    // re-read.
    const auto input = [&](const std::byte* panels, int64_t k, auto H) {
      B wv[NV];
      #pragma GCC unroll 32
      for (int j = 0; j < PP; ++j) {
        if constexpr (decltype(H)::value != 1) {
          __builtin_prefetch(reinterpret_cast<const void*>(pf.start + j * pstride + (k - k0) * pf.step), 0, 2);
        }
        #pragma GCC unroll 32
        for (int v = 0; v < PV; ++v) {
          if constexpr (decltype(H)::value < 0) {
            wv[j * PV + v] = V::load(reinterpret_cast<const WT*>(panels + j * pstride + k * kBytesPerK) + v * W);
          } else {  // the pair starts at its first input's 32 bytes
            const WT* pair =
                reinterpret_cast<const WT*>(panels + j * pstride + (k - decltype(H)::value) * kBytesPerK);
            wv[j * PV + v] = V::template load_pair<decltype(H)::value>(pair + v * 2 * W);
          }
        }
      }
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        const B xb = V::set1(x[r * a.ldx + k]);
        #pragma GCC unroll 32
        for (int i = 0; i < NV; ++i) acc[r][i] = V::fma(xb, wv[i], acc[r][i]);
      }
    };
    // bf16 reads its pairs (k0 is even, stream_panels' alignment); an odd K's last input is read alone.
    int64_t k = k0;
    if constexpr (kPairs) {
      for (; k + 1 < k1; k += 2) {
        input(w, k, std::integral_constant<int, 0>{});
        // The pair's second inputs load their vectors again (L1) through a pointer the compiler cannot see is w:
        // kept from the first half's loads, 24 accumulators + 6 weight vectors spilled 6 accumulators a pair.
        const std::byte* again = w;
        asm("" : "+r"(again));
        input(again, k + 1, std::integral_constant<int, 1>{});
      }
    }
    for (; k < k1; ++k) input(w, k, std::integral_constant<int, -1>{});
    const bool last = k1 == a.K;
    #pragma GCC unroll 32
    for (int j = 0; j < PP; ++j) {
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) store_panel<V, PV>(a, p0 + j, m0 + r, acc[r] + j * PV, last, nullptr);
    }
  }

  using BlockFn = void (*)(const LinearArgs&, int64_t, int64_t, int64_t, int64_t, Prefetch);
  static constexpr std::array<BlockFn, RB * PG> kBlocks =
      block_table<Linear>(std::make_integer_sequence<int, RB * PG>{});

  static void run(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
    stream_panels<RB, PG>(a, a.K, kBytesPerK, kPairs ? 2 : 1, panel_begin, panel_end,
                          [&](int64_t rr, int64_t pp, int64_t p0, int64_t m0, int64_t k0, int64_t k1, Prefetch pf) {
                            kBlocks[(rr - 1) * PG + (pp - 1)](a, p0, m0, k0, k1, pf);
                          });
  }
};

// The quantized formats: WT int8_t or int4x2 codes (kernels/linear.hpp's layout), in exact int32 sums against x's rows
// quantized to int16 once per call (into LinearArgs::scratch); the sums become f32 with x's row scale, and int4's with
// its group's scales, every group of 32 inputs; int8's row scale multiplies the finished sum.
template <class Arch, class WT>
struct QuantLinear {
  using V = Vec<Arch>;
  using B = typename V::B;
  using IL = IntLanes<Arch>;
  using I = typename IL::I;
  static constexpr bool kInt4 = std::is_same_v<WT, int4x2>;
  static constexpr WeightFormat kFormat = kInt4 ? WeightFormat::int4 : WeightFormat::int8;
  static constexpr int W = V::W;
  static constexpr int PV = static_cast<int>(kLinearPanel) / W;
  static constexpr int RB = tiles::linear_row_block(W, kInt4);
  static constexpr int PG = tiles::linear_panel_group(W, kInt4);
  static constexpr int64_t kBytesPerK = kInt4 ? kLinearPanel / 2 : kLinearPanel;
  static constexpr int kStep = kInt4 ? 4 : 2;  // inputs per load: a quad of nibbles, a pair of bytes
  static constexpr int64_t kLaneBytes = 2 * W;  // a vector's bytes of a load's 32

  // x's rows as the block reads them: int16 codes (row stride ldq, zero past K), a scale per row, and for int4 the
  // sum of each group's codes (groups a row).
  struct Rows {
    const int16_t* q;
    int64_t ldq;
    const float* scale;
    const int32_t* sums;
    int64_t groups;
  };

  template <int RR, int PP>
  static void block(const LinearArgs& a, const Rows& xr, int64_t p0, int64_t m0, int64_t k0, int64_t k1, Prefetch pf) {
    constexpr int NV = PP * PV;
    const int64_t pstride = xr.ldq * kBytesPerK, groups = weight_groups(a.K);
    const auto* w = static_cast<const std::byte*>(a.w_packed) + p0 * pstride;
    B acc[RR][NV];  // f32: the sums so far, scaled (int4) or not yet (int8)
    #pragma GCC unroll 32
    for (int r = 0; r < RR; ++r) {
      #pragma GCC unroll 32
      for (int i = 0; i < NV; ++i) acc[r][i] = V::set1(0.0f);
    }
    // [k0, k1) in runs whose int32 sums share one scale: int4's groups, else the whole chunk.
    for (int64_t ks = k0; ks < k1;) {
      const int64_t ke = kInt4 ? std::min(k1, (ks / kWeightGroup + 1) * kWeightGroup) : k1;
      I sum[RR][NV];  // int4 starts at -8 x the group's sum of x: its nibbles hold code + 8
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        const I s0 = IL::set1(kInt4 ? -8 * xr.sums[(m0 + r) * xr.groups + ks / kWeightGroup] : 0);
        #pragma GCC unroll 32
        for (int i = 0; i < NV; ++i) sum[r][i] = s0;
      }
      for (int64_t k = ks; k < ke; k += kStep) {  // past K: zero codes and zero x
        typename IL::Wt lo[NV], hi[NV];
        #pragma GCC unroll 32
        for (int j = 0; j < PP; ++j) {
          const uintptr_t ahead = pf.start + j * pstride + (k - k0) * pf.step;
          __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, 2);
          #pragma GCC unroll 32
          for (int v = 0; v < PV; ++v) {
            const std::byte* p = w + j * pstride + k * kBytesPerK + v * kLaneBytes;
            if constexpr (kInt4) {
              IL::load_int4(reinterpret_cast<const uint8_t*>(p), lo[j * PV + v], hi[j * PV + v]);
            } else {
              lo[j * PV + v] = IL::load_int8(reinterpret_cast<const int8_t*>(p));
            }
          }
        }
        #pragma GCC unroll 32
        for (int r = 0; r < RR; ++r) {
          const int16_t* xq = xr.q + (m0 + r) * xr.ldq + k;
          const typename IL::X x0 = IL::pair(xq);
          if constexpr (kInt4) {
            const typename IL::X x1 = IL::pair(xq + 2);
            #pragma GCC unroll 32
            for (int i = 0; i < NV; ++i) sum[r][i] = IL::dot(IL::dot(sum[r][i], x0, lo[i]), x1, hi[i]);
          } else {
            #pragma GCC unroll 32
            for (int i = 0; i < NV; ++i) sum[r][i] = IL::dot(sum[r][i], x0, lo[i]);
          }
        }
      }
      if constexpr (kInt4) {
        B sv[NV];
        #pragma GCC unroll 32
        for (int j = 0; j < PP; ++j) {
          const float* s = a.scales + ((p0 + j) * groups + ks / kWeightGroup) * kLinearPanel;
          // The scales are a stream of their own beside the codes (a line per panel and group, a fifth of int4's
          // bytes): fetched a chunk ahead, as the codes are.
          const int64_t ahead = std::min(groups - 1, ks / kWeightGroup + tiles::kLinearKChunk / kWeightGroup);
          __builtin_prefetch(a.scales + ((p0 + j) * groups + ahead) * kLinearPanel, 0, 2);
          #pragma GCC unroll 32
          for (int v = 0; v < PV; ++v) sv[j * PV + v] = V::load(s + v * W);
        }
        #pragma GCC unroll 32
        for (int r = 0; r < RR; ++r) {
          #pragma GCC unroll 32
          for (int i = 0; i < NV; ++i) {
            acc[r][i] = V::fma(IL::to_float(sum[r][i]), sv[i], acc[r][i]);
          }
        }
      } else {
        #pragma GCC unroll 32
        for (int r = 0; r < RR; ++r) {
          #pragma GCC unroll 32
          for (int i = 0; i < NV; ++i) acc[r][i] = IL::to_float(sum[r][i]);
        }
      }
      ks = ke;
    }
    // y = the partial sums in y (k0 > 0) + this chunk's times x's row scale; at the end int8's row scales, the bias.
    const bool last = k1 == a.K;
    #pragma GCC unroll 32
    for (int j = 0; j < PP; ++j) {
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        const B sx = V::set1(xr.scale[m0 + r]);
        float in[kLinearPanel];
        const float* src = partial_sums(a, p0 + j, m0 + r, k0 == 0, in);
        B* o = acc[r] + j * PV;
        #pragma GCC unroll 32
        for (int v = 0; v < PV; ++v) o[v] = src ? V::fma(o[v], sx, V::load(src + v * W)) : o[v] * sx;
        store_panel<V, PV>(a, p0 + j, m0 + r, o, last, kInt4 ? nullptr : a.scales + (p0 + j) * kLinearPanel);
      }
    }
  }

  using BlockFn = void (*)(const LinearArgs&, const Rows&, int64_t, int64_t, int64_t, int64_t, Prefetch);
  static constexpr std::array<BlockFn, RB * PG> kBlocks =
      block_table<QuantLinear>(std::make_integer_sequence<int, RB * PG>{});

  // x's M rows quantized into the scratch (linear_scratch_bytes), then the panels streamed.
  static void run(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
    const int64_t ldq = linear_padded_k(kFormat, a.K);
    auto* q = static_cast<int16_t*>(a.scratch);
    auto* scale = reinterpret_cast<float*>(q + a.M * ldq);
    auto* sums = reinterpret_cast<int32_t*>(scale + a.M);
    const int64_t groups = kInt4 ? weight_groups(a.K) : 0;
    for (int64_t m = 0; m < a.M; ++m) {
      int16_t* row = q + m * ldq;
      scale[m] = quantize_query_i16<Arch>(a.x + m * a.ldx, 1.0f, a.K, row);
      std::fill(row + a.K, row + ldq, int16_t{0});
      for (int64_t g = 0; g < groups; ++g) {
        int32_t t = 0;
        for (int64_t k = g * kWeightGroup; k < std::min(a.K, (g + 1) * kWeightGroup); ++k) t += row[k];
        sums[m * groups + g] = t;
      }
    }
    const Rows xr{q, ldq, scale, sums, groups};
    stream_panels<RB, PG>(a, ldq, kBytesPerK, kWeightGroup, panel_begin, panel_end,
                          [&](int64_t rr, int64_t pp, int64_t p0, int64_t m0, int64_t k0, int64_t k1, Prefetch pf) {
                            kBlocks[(rr - 1) * PG + (pp - 1)](a, xr, p0, m0, k0, k1, pf);
                          });
  }
};

// DequantizeFn (kernels/linear.hpp), compiled at each level. A whole group is 16 bytes widened to int32 lanes, each
// nibble sign-extended by a shift up and an arithmetic shift down, converted, scaled and stored (rounded to bf16 by
// integer adds on the bits: code x scale is finite, the scales being validated, so to_bf16's NaN branch is not
// needed): GCC 12 at -O3 unrolled the plain loop into scalar code, which cost gpt2-medium's int4 prefill 70% (f32) and
// 20% (bf16) over the compute-type layers'. The row's shorter last group, and the scalar level, take the plain loop.
template <class T, bool kRound>
T int4_value(float v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return to_bf16_not_nan(v);
  } else if constexpr (kRound) {
    return widen(to_bf16_not_nan(v));
  } else {
    return v;
  }
}

template <class Arch, class T, bool kRound>
void int4_group(const uint8_t* c, float s, T* d) {
  constexpr int64_t half = kWeightGroup / 2;
#if !defined(GPT2ATTN_SCALAR_ONLY)
  if constexpr (!std::is_same_v<Arch, ScalarArch>) {
    constexpr bool k512 = std::is_same_v<Arch, xsimd::avx512f>;
    // Lanes [i0, i0 + L) of the low (shift 28) or high (24) nibbles, scaled, stored at d + o.
    const auto put = [&](auto codes, int shift, int64_t o) {
      if constexpr (k512) {
        const __m512 v = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(codes, _mm512_set1_epi32(shift)), 28)),
            _mm512_set1_ps(s));
        if constexpr (std::is_same_v<T, bf16> || kRound) {
          const __m512i u = _mm512_castps_si512(v);
          const __m512i r = _mm512_add_epi32(
              u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                _mm512_set1_epi32(1))));
          if constexpr (std::is_same_v<T, bf16>) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
          } else {
            _mm512_storeu_ps(d + o, _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(-65536))));
          }
        } else {
          _mm512_storeu_ps(d + o, v);
        }
      } else {
        const __m256 v = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(codes, _mm256_set1_epi32(shift)), 28)),
            _mm256_set1_ps(s));
        if constexpr (std::is_same_v<T, bf16> || kRound) {
          const __m256i u = _mm256_castps_si256(v);
          const __m256i r = _mm256_add_epi32(
              u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                _mm256_set1_epi32(1))));
          if constexpr (std::is_same_v<T, bf16>) {
            const __m256i h = _mm256_srli_epi32(r, 16);  // in [0, 65535]: packus keeps it
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + o),
                             _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
          } else {
            _mm256_storeu_ps(d + o, _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(-65536))));
          }
        } else {
          _mm256_storeu_ps(d + o, v);
        }
      }
    };
    if constexpr (k512) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      put(b, 28, 0);
      put(b, 24, half);
    } else {
      for (int64_t i0 = 0; i0 < half; i0 += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i0)));
        put(b, 28, i0);
        put(b, 24, half + i0);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    d[i] = int4_value<T, kRound>(static_cast<float>(static_cast<int8_t>(c[i] << 4) >> 4) * s);
    d[half + i] = int4_value<T, kRound>(static_cast<float>(static_cast<int8_t>(c[i]) >> 4) * s);
  }
}

template <class Arch, class T, bool kRound>
void dequantize_int4_rows(const uint8_t* codes, const float* scales, int64_t N, int64_t K, T* dst) {
  constexpr int64_t half = kWeightGroup / 2;
  const int64_t G = weight_groups(K);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = codes + (n * G + g) * half;
      const float s = scales[n * G + g];
      T* d = dst + n * K + g * kWeightGroup;
      if ((g + 1) * kWeightGroup <= K) {
        int4_group<Arch, T, kRound>(c, s, d);
      } else {  // the row's shorter last group
        for (int64_t i = 0; i < K - g * kWeightGroup; ++i) {
          const int q = i < half ? static_cast<int8_t>(c[i] << 4) >> 4 : static_cast<int8_t>(c[i - half]) >> 4;
          d[i] = int4_value<T, kRound>(static_cast<float>(q) * s);
        }
      }
    }
  }
}
template <class Arch>
void dequantize_int4(const uint8_t* codes, const float* scales, int64_t N, int64_t K, DType out, bool bf16_values,
                     void* dst) {
  if (out == DType::bf16) {
    dequantize_int4_rows<Arch, bf16, true>(codes, scales, N, K, static_cast<bf16*>(dst));
  } else if (bf16_values) {
    dequantize_int4_rows<Arch, float, true>(codes, scales, N, K, static_cast<float*>(dst));
  } else {
    dequantize_int4_rows<Arch, float, false>(codes, scales, N, K, static_cast<float*>(dst));
  }
}

template <Isa Level, class Arch, class WT>
const LinearKernel& make_linear_kernel() {
  if constexpr (std::is_same_v<WT, int8_t> || std::is_same_v<WT, int4x2>) {
    using L = QuantLinear<Arch, WT>;
    static const LinearKernel kernel{Level, L::kFormat, DType::f32, L::PG, &L::run,
                                     L::kInt4 ? &dequantize_int4<Arch> : nullptr};
    return kernel;
  } else {
    using L = Linear<Arch, WT>;
    static const LinearKernel kernel{Level, WeightFormat::compute, dtype_of<WT>(), L::PG, &L::run};
    return kernel;
  }
}

}  // namespace
}  // namespace gpt2attn::kernels
