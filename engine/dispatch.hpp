// engine/dispatch.hpp: the one place that chooses kernels. An ordered table of kernel sets, keyed by
// (instruction set, compute dtype, K/V storage dtype), best first and scalar last (oneDNN's impl_list idea);
// each row says why it exists. A layer looks its row up once, at construction, and reports its name.
// Adding a dtype or a K/V format adds rows here and kernel instantiations in kernels/, nothing else.
#pragma once

#include <vector>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/attention.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn::detail {

struct KernelSet {
  const char* name;  // reported by implementation(), e.g. "f32/avx512"
  Isa isa;           // the level its kernels are compiled for (the CPU must run it)
  DType compute;     // Q, K, V and the products
  DType kv;          // K/V as the cache stores them
  const char* why;   // one line: what this row is for
  const kernels::AttentionKernel* prefill;      // tiled online-softmax core (forward, extend)
  const kernels::DecodeKernel* decode;          // one-query split-KV core (decode)
  const kernels::LinearKernel* few_row_linear;  // decode's projections
};

// Every row, best first.
const std::vector<KernelSet>& kernel_table();

// Resolves `requested` (best -> the strongest supported; GPT2ATTN_ISA overrides best). Asking for a level this
// CPU lacks is an invalid_argument error naming it.
Isa resolve_isa(Isa requested);

// The first row at or below level `resolved` (in the table's order) that computes in `compute`, reads `kv` and
// whose level this CPU runs. Throws invalid_argument naming the combination when none does.
const KernelSet& kernels_for(Isa resolved, DType compute, DType kv);

// The f32-compute row's kernels at level `resolved` for K/V stored as `kv`, for the tests and benchmarks that drive
// one kernel directly.
inline const kernels::AttentionKernel& attention_kernel(Isa resolved, DType kv = DType::f32) {
  return *kernels_for(resolved, DType::f32, kv).prefill;
}
inline const kernels::DecodeKernel& decode_kernel(Isa resolved, DType kv = DType::f32) {
  return *kernels_for(resolved, DType::f32, kv).decode;
}
inline const kernels::LinearKernel& linear_kernel(Isa resolved) {
  return *kernels_for(resolved, DType::f32, DType::f32).few_row_linear;
}

}  // namespace gpt2attn::detail
