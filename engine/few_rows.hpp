// engine/few_rows.hpp: the engine's side of the few-row projection kernel (kernels/linear.hpp): its panel-packed
// weights, their packing from views or quantized codes, and the split of a projection's panels into work items for the
// team. Decode's and a ragged step's projections (serving.cpp) and the public Linear (linear_layer.cpp) run on it.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/buffer.hpp"
#include "gpt2attn/dtype.hpp"
#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn::detail {

// A panel-packed matrix (kernels/linear.hpp): the codes or values, and a quantized format's scales.
struct PackedLinear {
  Buffer packed;
  std::vector<float> scales;
};

// One matrix of those a packed projection stacks (W_q, W_k, W_v for decode's fused QKV; W_o alone): its view as given
// (WeightFormat::compute) or its codes, and its rows.
struct StackedPart {
  const TensorView* view;
  const QuantizedMatrix* codes;
  int64_t rows;
};

// The panel-packed copy of the (N, K) matrix stacking `parts`, in weight format f (the compute type t, int8 or int4):
// one panel of rows gathered at a time, so no (N, K) copy is ever made. The quantized formats' codes are the caller's
// (QuantizedWeights), rearranged; their scales go to *scales. `what` names the allocation in an out-of-memory error.
Buffer pack_linear(const std::vector<StackedPart>& parts, int64_t K, WeightFormat f, DType t, std::vector<float>* scales,
                   const char* what);

// A projection's panels as work items: contiguous runs of whole panel groups (the kernel's unit), about
// kLinearItemsPerThread per thread and at most kLinearMaxItemGroups groups each, for a dynamic schedule. Dynamic: a
// worker woken from sleep joins the step 0.05-0.13 ms after the first thread (measured after the bench's cache flush,
// when it still ran on one thread), and a thread that finds no item left does not hold the step up at the barrier
// (gpt2-small B=16, 2 threads: 0.70 ms static, 0.62 dynamic, with four runs a thread). Runs rather than single
// groups: the kernel prefetches each group's successor, which a run keeps on the same thread (tiles.hpp,
// kLinearItemsPerThread).
struct PanelItems {
  int64_t panels = 0, per_item = 0;  // per_item: a multiple of the kernel's panel group
  int64_t count() const { return (panels + per_item - 1) / per_item; }
  int64_t begin(int64_t item) const { return item * per_item; }
  int64_t end(int64_t item) const { return panels < (item + 1) * per_item ? panels : (item + 1) * per_item; }
};
PanelItems panel_items(const kernels::LinearKernel& lin, int64_t N, int threads);

// Whether item `it`'s columns of y (M rows of N columns, row stride ldy), the panels it computed, hold a non-finite
// value.
bool columns_overflowed(const float* y, int64_t ldy, int64_t M, int64_t N, const PanelItems& items, int64_t it);

// The few-row kernel's arguments for y (M, N) = x (M, K) W^T + b, W a panel-packed matrix; on_thread gives them the
// calling thread's scratch (the quantized formats' kernels quantize x's rows into it).
kernels::LinearArgs few_row_args(const float* x, int64_t ldx, const PackedLinear& w, const std::vector<float>& bias,
                                 float* y, int64_t ldy, int64_t M, int64_t N, int64_t K);
inline kernels::LinearArgs on_thread(kernels::LinearArgs a, float* scratch) {
  a.scratch = scratch;
  return a;
}

}  // namespace gpt2attn::detail
