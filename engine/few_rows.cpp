// engine/few_rows.cpp: packing for the few-row projection kernel, and the split of its panels across the team.
#include "engine/few_rows.hpp"

#include <algorithm>

#include "engine/convert.hpp"
#include "engine/quantized.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn::detail {

Buffer pack_linear(const std::vector<StackedPart>& parts, int64_t K, WeightFormat f, DType t,
                           std::vector<float>* scales, const char* what) {
  int64_t N = 0;
  for (const StackedPart& part : parts) N += part.rows;
  const int64_t P = kernels::kLinearPanel, per_k = kernels::linear_bytes_per_k(f, t);
  const int64_t G = f == WeightFormat::compute ? 0 : quant_groups(f, K);
  Buffer out = allocate_buffer(static_cast<size_t>(kernels::linear_packed_bytes(N, K, f, t)), what);
  scales->assign(static_cast<size_t>(kernels::linear_scales(N, K, f)), 0.0f);
  const int64_t panel_scales = scales->size() / std::max<int64_t>(1, kernels::linear_panels(N));
  // The panel's rows: values of t, or codes and their scales.
  std::vector<std::byte> values(static_cast<size_t>(P * K) * (f == WeightFormat::compute ? size_of(t) : 0));
  std::vector<int8_t> codes(static_cast<size_t>(f == WeightFormat::compute ? 0 : P * K));
  std::vector<float> row_scales(static_cast<size_t>(P * G));
  for (int64_t p = 0; p < kernels::linear_panels(N); ++p) {
    const int64_t n0 = p * P, n = std::min(P, N - n0);
    for (int64_t r = n0, part = 0, base = 0; r < n0 + n; ++part) {  // rows [r, ...) from parts[part]
      const StackedPart& src = parts[static_cast<size_t>(part)];
      if (r >= base + src.rows) {
        base += src.rows;
        continue;
      }
      const int64_t first = r - base, take = std::min(n0 + n - r, src.rows - first), i = r - n0;
      if (f == WeightFormat::compute) {
        copy_rows(*src.view, first, take, t, values.data() + i * K * static_cast<int64_t>(size_of(t)));
      } else {
        std::copy_n(src.codes->codes.data() + first * K, take * K, codes.data() + i * K);
        std::copy_n(src.codes->scales.data() + first * G, take * G, row_scales.data() + i * G);
      }
      r += take, base += src.rows;
    }
    std::byte* dst = out.get() + p * kernels::linear_padded_k(f, K) * per_k;
    float* s = scales->data() + p * panel_scales;
    switch (f) {
      case WeightFormat::int8:
        kernels::pack_linear_panel_int8(codes.data(), row_scales.data(), n, K, reinterpret_cast<int8_t*>(dst), s);
        break;
      case WeightFormat::int4:
        kernels::pack_linear_panel_int4(codes.data(), row_scales.data(), n, K,
                                        reinterpret_cast<kernels::int4x2*>(dst), s);
        break;
      case WeightFormat::compute:
        if (t == DType::bf16) {
          kernels::pack_linear_weights(reinterpret_cast<const kernels::bf16*>(values.data()), n, K,
                                       reinterpret_cast<kernels::bf16*>(dst));
        } else {
          kernels::pack_linear_weights(reinterpret_cast<const float*>(values.data()), n, K,
                                       reinterpret_cast<float*>(dst));
        }
        break;
    }
  }
  return out;
}

PanelItems panel_items(const kernels::LinearKernel& lin, int64_t N, int threads) {
  const int64_t panels = kernels::linear_panels(N), groups = ceil_div(panels, lin.panel_group);
  // A multiple of the team's runs, so that every thread has as many groups to do.
  const int64_t runs = int64_t{threads} * kernels::tiles::kLinearItemsPerThread;
  const int64_t items = runs * ceil_div(groups, runs * kernels::tiles::kLinearMaxItemGroups);
  return {panels, ceil_div(groups, items) * lin.panel_group};
}

bool columns_overflowed(const float* y, int64_t ldy, int64_t M, int64_t N, const PanelItems& items, int64_t it) {
  const int64_t c0 = items.begin(it) * kernels::kLinearPanel;
  const int64_t c1 = std::min(N, items.end(it) * kernels::kLinearPanel);
  for (int64_t i = 0; i < M; ++i) {
    if (any_nonfinite<DType::f32>(y + i * ldy, c0, c1 - c0, 1)) return true;
  }
  return false;
}

kernels::LinearArgs few_row_args(const float* x, int64_t ldx, const PackedLinear& w, const std::vector<float>& bias,
                                 float* y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
  kernels::LinearArgs a;
  a.x = x, a.ldx = ldx, a.w_packed = w.packed.get();
  a.scales = w.scales.empty() ? nullptr : w.scales.data();
  a.bias = bias.empty() ? nullptr : bias.data();
  a.y = y, a.ldy = ldy, a.M = M, a.N = N, a.K = K;
  return a;
}

}  // namespace gpt2attn::detail
