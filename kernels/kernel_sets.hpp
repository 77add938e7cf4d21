// kernels/kernel_sets.hpp: what one instruction-set level compiles: its rows of kernels/kernel_list.def, each a
// kernel set (prefill core, decode core, decode's projections) for one (compute dtype, K/V dtype), and the probes the
// tests pin that level's vector helpers with. Defined once per level, in kernels/kernel_sets_<level>.cpp; the engine
// concatenates the levels best first into its dispatch table (engine/dispatch.hpp) and names the rows.
#pragma once

#include <array>
#include <cstddef>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/attention.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/linear.hpp"
#include "kernels/row_ops.hpp"
#include "kernels/vec_probe.hpp"

namespace gpt2attn::kernels {

struct KernelRow {
  Isa isa;                          // the level whose flags compiled these kernels (the CPU must run it)
  DType compute;                    // Q, K, V, the weights and the products
  DType kv;                         // K/V as the cache stores them
  const char* why;                  // one line: what this row is for
  const AttentionKernel* prefill;   // tiled online-softmax core (forward, extend)
  const DecodeKernel* decode;       // one-query split-KV core (decode)
  const LinearKernel* few_row_linear;  // decode's projections
};

inline constexpr size_t kNumWeightFormats = static_cast<size_t>(WeightFormat::int4) + 1;

struct IsaKernels {
  const KernelRow* rows;  // this level's lines of kernel_list.def, in the list's order
  size_t count;
  // Decode's projections over quantized weights, indexed by WeightFormat (the second list of kernel_list.def); null
  // at WeightFormat::compute, whose kernels are the rows' few_row_linear.
  std::array<const LinearKernel*, kNumWeightFormats> quantized_linear;
  const IntDotKernel* int_dot;  // the int8 K/V score dot products, for the tests
  const VecProbe* vec;          // Vec<Arch>'s element-wise functions, for the tests
  const RowOpsKernel* row_ops;  // LayerNorm and GELU (gpt2attn/ops.hpp)
};

// Specialised in kernels/kernel_sets_<level>.cpp for each level CMake compiles (GPT2ATTN_ISA_LEVELS); the engine
// declares the specialisations it calls from the generated list of levels (engine/dispatch.cpp). Call it only where
// the CPU runs Level: building the rows runs code compiled with the level's flags.
template <Isa Level>
const IsaKernels& isa_kernels();

}  // namespace gpt2attn::kernels
