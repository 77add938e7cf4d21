// kernels/linear_impl.hpp: the few-row linear layer of linear.hpp, written once over Vec<Arch> and the packed
// weight type WT (f32, bf16, int8_t or int4x2, each widened to f32 as it is loaded: PackedWeights).
// Included only by kernels/kernel_sets_impl.hpp, in each level's file (internal linkage, like attention_impl.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/element.hpp"
#include "kernels/linear.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

// How the kernel reads one packed weight format WT (kernels/linear.hpp): bytes per panel per k, the vector of lanes
// [v W, v W + W) of the 16 at a k's bytes, and where the scales apply.
template <class WT>
struct PackedWeights {
  static constexpr WeightFormat kFormat = std::is_same_v<WT, int8_t> ? WeightFormat::int8 : WeightFormat::compute;
  static constexpr int64_t kBytesPerK = kLinearPanel * static_cast<int64_t>(sizeof(WT));
  static constexpr bool kRowScales = std::is_same_v<WT, int8_t>;  // one per output, on the finished sum
  static constexpr bool kGroupScales = false;                     // one per output and group, on the weights
  template <class V>
  static typename V::B load(const std::byte* p, int v) {
    return V::load(reinterpret_cast<const WT*>(p) + v * V::W);
  }
};
template <>
struct PackedWeights<int4x2> {
  static constexpr WeightFormat kFormat = WeightFormat::int4;
  static constexpr int64_t kBytesPerK = kLinearPanel / 2;
  static constexpr bool kRowScales = false;
  static constexpr bool kGroupScales = true;
  template <class V>
  static typename V::B load(const std::byte* p, int v) {
    return V::load_int4(reinterpret_cast<const uint8_t*>(p), v);
  }
};

template <class Arch, class WT>
struct Linear {
  using V = Vec<Arch>;
  using B = typename V::B;
  using P = PackedWeights<WT>;
  static constexpr int W = V::W;
  static constexpr int PV = static_cast<int>(kLinearPanel) / W;  // vectors per panel
  static constexpr int RB = tiles::linear_row_block(W);          // rows per block (reasons in tiles.hpp)
  static constexpr int PG = tiles::linear_panel_group(W);        // panels per block (reasons in tiles.hpp)
  static constexpr int64_t kBytesPerK = P::kBytesPerK;           // of one panel: a line (f32) down to 8 bytes (int4)

  // The next chunk run() streams (this group's next K chunk, or the next group's first) is prefetched into L2
  // while the row blocks compute on this one: row block i of nb asks for the i-th nb-th of each panel's bytes, at
  // `step` bytes per k (kBytesPerK / nb), so the fetch keeps pace with the arithmetic for any M.
  struct Prefetch {
    uintptr_t start;  // this block's first line of the next chunk in the first panel (an address only: past W's
                      // end after the last group)
    int64_t step;     // bytes per k
  };

  // y[m0 .. m0+RR) x the outputs of panels [p0, p0+PP), for k in [k0, k1): starts from 0 when k0 == 0, else from the
  // partial sums in y, and when k1 == K applies the row scales (int8) and adds the bias. Per k: PP*PV weight loads
  // (widened) + RR broadcasts for RR*PP*PV FMAs, and PP prefetches; int4 multiplies each widened weight vector by its
  // group's scales, loaded once per group. Every loop over j, v, r and i is unrolled by pragma so acc[][] lives in
  // registers: with bf16 weights GCC 12's own heuristic stops unrolling (the widening load is a longer body), keeps
  // acc in memory and the kernel ran at a third of the f32 one's speed (measured: 23 vs 70 GB/s at N=2304, K=768,
  // M=1).
  template <int RR, int PP>
  static void block(const LinearArgs& a, int64_t p0, int64_t m0, int64_t k0, int64_t k1, Prefetch pf) {
    constexpr int NV = PP * PV;                         // accumulator vectors per row
    const int64_t pstride = a.K * kBytesPerK;           // bytes per panel
    B acc[RR][NV];
    #pragma GCC unroll 32
    for (int j = 0; j < PP; ++j) {
      const int64_t n0 = (p0 + j) * kLinearPanel, width = std::min<int64_t>(kLinearPanel, a.N - n0);
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        const float* src = k0 > 0 ? a.y + (m0 + r) * a.ldy + n0 : nullptr;
        float in[kLinearPanel] = {};  // the last panel may be partial: its outputs past N start from 0
        if (src && width < kLinearPanel) {
          std::copy_n(src, width, in);
          src = in;
        }
        #pragma GCC unroll 32
        for (int v = 0; v < PV; ++v) acc[r][j * PV + v] = src ? V::load(src + v * W) : V::set1(0.0f);
      }
    }
    const std::byte* w = static_cast<const std::byte*>(a.w_packed) + p0 * pstride;
    const float* x = a.x + m0 * a.ldx;
    const int64_t groups = weight_groups(a.K);
    // [k0, k1) in runs that share one set of scales: int4's groups, else the whole range.
    for (int64_t ks = k0; ks < k1;) {
      const int64_t ke = P::kGroupScales ? std::min(k1, (ks / kWeightGroup + 1) * kWeightGroup) : k1;
      [[maybe_unused]] B sv[NV];
      if constexpr (P::kGroupScales) {
        #pragma GCC unroll 32
        for (int j = 0; j < PP; ++j) {
          const float* s = a.scales + ((p0 + j) * groups + ks / kWeightGroup) * kLinearPanel;
          #pragma GCC unroll 32
          for (int v = 0; v < PV; ++v) sv[j * PV + v] = V::load(s + v * W);
        }
      }
      for (int64_t k = ks; k < ke; ++k) {
        B wv[NV];
        #pragma GCC unroll 32
        for (int j = 0; j < PP; ++j) {
          const uintptr_t ahead = pf.start + j * pstride + (k - k0) * pf.step;
          __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, 2);  // into L2: L1 holds the chunk being re-read
          #pragma GCC unroll 32
          for (int v = 0; v < PV; ++v) {
            wv[j * PV + v] = P::template load<V>(w + j * pstride + k * kBytesPerK, v);
            if constexpr (P::kGroupScales) wv[j * PV + v] = wv[j * PV + v] * sv[j * PV + v];
          }
        }
        #pragma GCC unroll 32
        for (int r = 0; r < RR; ++r) {
          const B xb = V::set1(x[r * a.ldx + k]);
          #pragma GCC unroll 32
          for (int i = 0; i < NV; ++i) acc[r][i] = V::fma(xb, wv[i], acc[r][i]);
        }
      }
      ks = ke;
    }
    const bool last = k1 == a.K;
    #pragma GCC unroll 32
    for (int j = 0; j < PP; ++j) {
      const int64_t n0 = (p0 + j) * kLinearPanel, width = std::min<int64_t>(kLinearPanel, a.N - n0);
      float bias[kLinearPanel] = {};  // the last panel may be partial
      if (last && a.bias) std::copy_n(a.bias + n0, width, bias);
      #pragma GCC unroll 32
      for (int r = 0; r < RR; ++r) {
        float* y = a.y + (m0 + r) * a.ldy + n0;
        float out[kLinearPanel];
        #pragma GCC unroll 32
        for (int v = 0; v < PV; ++v) {
          B o = acc[r][j * PV + v];
          if (last) {
            const B b = V::load(bias + v * W);
            if constexpr (P::kRowScales) {
              o = V::fma(o, V::load(a.scales + (p0 + j) * kLinearPanel + v * W), b);
            } else {
              o = o + b;
            }
          }
          if (width == kLinearPanel) {
            V::store(y + v * W, o);
          } else {
            V::store(out + v * W, o);
          }
        }
        if (width < kLinearPanel) std::copy_n(out, width, y);
      }
    }
  }

  // block<RR, PP> for every 1 <= RR <= RB, 1 <= PP <= PG, at [(RR-1) * PG + PP-1]: ragged row blocks and panel
  // groups keep full register blocking.
  using BlockFn = void (*)(const LinearArgs&, int64_t, int64_t, int64_t, int64_t, Prefetch);
  template <int... I>
  static constexpr std::array<BlockFn, sizeof...(I)> blocks(std::integer_sequence<int, I...>) {
    return {&block<I / PG + 1, I % PG + 1>...};
  }
  static constexpr std::array<BlockFn, RB * PG> kBlocks = blocks(std::make_integer_sequence<int, RB * PG>{});

  // Per group of PG panels, K in equal chunks of at most kLinearKChunk, each streamed by every row block in turn
  // from L1/L2 while the next is prefetched: the weights come from memory once, overlapped with the arithmetic.
  static void run(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
    const int64_t chunks = (a.K + tiles::kLinearKChunk - 1) / tiles::kLinearKChunk;
    const int64_t kc = (a.K + chunks - 1) / chunks, blocks = (a.M + RB - 1) / RB;
    const uintptr_t w = reinterpret_cast<uintptr_t>(a.w_packed);
    for (int64_t p0 = panel_begin; p0 < panel_end; p0 += PG) {
      const int64_t pp = std::min<int64_t>(PG, panel_end - p0);
      for (int64_t k0 = 0; k0 < a.K; k0 += kc) {
        const int64_t k1 = std::min(a.K, k0 + kc);
        // The next chunk: this group's next, or after the last one the next group's first.
        const int64_t next_panel = k1 < a.K ? p0 : p0 + pp, next_k = k1 < a.K ? k1 : 0;
        const uintptr_t next = w + (next_panel * a.K + next_k) * kBytesPerK;
        for (int64_t i = 0; i < blocks; ++i) {
          const int64_t m0 = i * RB, rr = std::min<int64_t>(RB, a.M - m0);
          const int64_t first = i * kc / blocks, ks = (i + 1) * kc / blocks - first;  // this block's share of k
          const Prefetch pf{next + first * kBytesPerK, ks * kBytesPerK / (k1 - k0)};
          kBlocks[(rr - 1) * PG + (pp - 1)](a, p0, m0, k0, k1, pf);
        }
      }
    }
  }
};

template <Isa Level, class Arch, class WT>
const LinearKernel& make_linear_kernel() {
  constexpr WeightFormat f = PackedWeights<WT>::kFormat;
  constexpr DType compute = [] {
    if constexpr (f == WeightFormat::compute) return dtype_of<WT>();
    return DType::f32;
  }();
  static const LinearKernel kernel{Level, f, compute, Linear<Arch, WT>::PG, &Linear<Arch, WT>::run};
  return kernel;
}

}  // namespace
}  // namespace gpt2attn::kernels
