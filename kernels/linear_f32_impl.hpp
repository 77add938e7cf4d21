// kernels/linear_f32_impl.hpp: the few-row linear layer of linear_f32.hpp, written once over Vec<Arch>.
// Included only by the per-ISA instantiation files (internal linkage, like attention_f32_impl.hpp).
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernels/linear_f32.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

template <class Arch>
struct LinearF32 {
  using V = Vec<Arch>;
  using B = typename V::B;
  static constexpr int W = V::W;
  static constexpr int PV = static_cast<int>(kLinearPanel) / W;  // vectors per panel
  static constexpr int RB = tiles::linear_row_block(W);  // rows per block (reasons in tiles.hpp)

  // y[m0 .. m0+RR) over this panel's outputs, for k in [k0, k1): starts from 0 (k0 == 0) or the partial sums in
  // y, and adds the bias after the last k.
  template <int RR>
  static void rows(const LinearArgs& a, const float* panel, int64_t n0, int64_t m0, int64_t k0, int64_t k1) {
    const int64_t width = std::min<int64_t>(kLinearPanel, a.N - n0);  // the last panel may be partial
    B acc[RR][PV];
    for (int r = 0; r < RR; ++r) {
      float in[kLinearPanel] = {};
      if (k0 > 0) std::copy_n(a.y + (m0 + r) * a.ldy + n0, width, in);
      for (int v = 0; v < PV; ++v) acc[r][v] = V::load(in + v * W);
    }
    const float* x = a.x + m0 * a.ldx;
    for (int64_t k = k0; k < k1; ++k) {
      B w[PV];
      for (int v = 0; v < PV; ++v) w[v] = V::load(panel + k * kLinearPanel + v * W);
      for (int r = 0; r < RR; ++r) {
        const B xb = V::set1(x[r * a.ldx + k]);
        for (int v = 0; v < PV; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
      }
    }
    const bool last = k1 == a.K;
    for (int r = 0; r < RR; ++r) {
      float out[kLinearPanel];
      for (int v = 0; v < PV; ++v) V::store(out + v * W, acc[r][v]);
      float* y = a.y + (m0 + r) * a.ldy + n0;
      for (int64_t c = 0; c < width; ++c) y[c] = out[c] + (last && a.bias ? a.bias[n0 + c] : 0.0f);
    }
  }

  // Calls rows<rem> for 1 <= rem <= RR: a ragged row block keeps full register blocking.
  template <int RR>
  static void ragged(const LinearArgs& a, const float* panel, int64_t n0, int64_t m0, int64_t rem, int64_t k0,
                     int64_t k1) {
    if constexpr (RR >= 1) {
      if (rem == RR) {
        rows<RR>(a, panel, n0, m0, k0, k1);
      } else {
        ragged<RR - 1>(a, panel, n0, m0, rem, k0, k1);
      }
    }
  }

  // Per panel, K in chunks small enough to stay in L1 while every row block streams them: the panel comes
  // from memory once however many row blocks there are (a whole panel at K = 12288 is 768 KiB).
  static void run(const LinearArgs& a, int64_t panel_begin, int64_t panel_end) {
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      const float* panel = a.w_packed + p * a.K * kLinearPanel;
      const int64_t n0 = p * kLinearPanel;
      for (int64_t k0 = 0; k0 < a.K; k0 += tiles::kLinearKChunk) {
        const int64_t k1 = std::min<int64_t>(a.K, k0 + tiles::kLinearKChunk);
        int64_t m0 = 0;
        for (; m0 + RB <= a.M; m0 += RB) rows<RB>(a, panel, n0, m0, k0, k1);
        if (m0 < a.M) ragged<RB - 1>(a, panel, n0, m0, a.M - m0, k0, k1);
      }
    }
  }
};

template <class Arch>
const LinearKernel& make_linear_kernel(const char* isa) {
  static const LinearKernel kernel{isa, &LinearF32<Arch>::run};
  return kernel;
}

}  // namespace
}  // namespace gpt2attn::kernels
