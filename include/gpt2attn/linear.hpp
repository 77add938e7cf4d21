// gpt2attn/linear.hpp: y = x W^T + b, a projection beside attention (a GPT-2's MLP, c_fc and c_proj, and its LM head),
// on the same two paths as the attention layer's projections: our few-row kernel for a few rows (a decode step: it
// streams the weights once, at the memory bound, and allocates nothing), oneDNN's GEMM for many (a prompt). Every
// weight format of EngineOptions::weights, in f32 or bf16 compute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/options.hpp"
#include "gpt2attn/tensor.hpp"

namespace gpt2attn {

// Which copies of the weights a Linear keeps.
enum class LinearPaths : uint8_t {
  // Both: the few-row kernel's panels for calls of up to Linear::kFewRows rows, oneDNN's blocked copy for more.
  both,
  // The panels alone, for every call (more rows are taken in blocks): half the memory, for a matrix that mostly sees
  // few rows and is large (a GPT-2's LM head: 154 MB in f32 at gpt2-small, whose logits a generating server needs for
  // one token a sequence).
  few_rows,
};

// Immutable after construction: forward() may run on several threads at once, each with its own Workspace.
class GPT2ATTN_API Linear {
 public:
  // forward() of at most this many rows runs on the few-row kernel (the attention layer's step takes the same cut).
  static constexpr int64_t kFewRows = 64;

  // weight: (N, K) in torch layout (outputs, inputs), f32, bf16 or f16, any strides (a Hugging Face Conv1D weight is
  // the transposed view); bias: (N) f32, bf16 or f16, or an empty view. Both are copied (converted to the compute
  // type, or quantized once: EngineOptions::weights, the rule of gpt2attn/dtype.hpp); the views may go afterwards.
  // invalid_argument naming the problem: a rank, shape or dtype, a NaN or infinite element (its index), an option.
  Linear(const TensorView& weight, const TensorView& bias, const EngineOptions& options = {},
         LinearPaths paths = LinearPaths::both);
  ~Linear();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;

  // y (M, N) = x (M, K) W^T + b, both f32, row strides ldx >= K and ldy >= N (0: K and N); y must not overlap x.
  // M >= 1. RunOptions: threads and check_finite (a NaN or infinite x is refused naming its index, an output that
  // overflows naming it; y is then unspecified); training and its dropout do not apply. With ws == null, calls on one
  // object are serialised.
  void forward(const float* x, int64_t M, float* y, const RunOptions& run = {}, Workspace* ws = nullptr);
  void forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, const RunOptions& run = {},
               Workspace* ws = nullptr);

  // Grows `ws` (the object's own when null) for calls of up to max_rows rows at `threads` (0 = default) and creates
  // the GEMM primitives of max_rows rows, kept for good: afterwards such calls allocate nothing of their own (oneDNN
  // 2.6 still builds a small argument map per GEMM execution; calls of up to kFewRows rows use no oneDNN at all).
  void reserve(int64_t max_rows, int threads = 0, Workspace* ws = nullptr);
  size_t workspace_bytes(int64_t max_rows, int threads = 0) const;

  int64_t in_features() const;   // K
  int64_t out_features() const;  // N
  DType compute() const;
  WeightFormat weights() const;
  LinearPaths paths() const;
  Isa isa() const;
  int default_threads() const;
  size_t weight_bytes() const;  // the bytes its copies of the weights hold
  std::string implementation() const;  // e.g. "few-row-linear/avx512_bf16 int8 (M <= 64) + onednn-matmul/gemm:jit"

  struct GPT2ATTN_LOCAL Impl;  // engine-internal (engine/linear_layer.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpt2attn
