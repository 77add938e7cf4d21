// engine/dispatch.hpp: the one place that chooses kernels. An ordered table of kernel sets, keyed by
// (instruction set, compute dtype, K/V storage dtype), best first and scalar last (oneDNN's impl_list idea): the
// rows of kernels/kernel_list.def, each level's compiled with its flags (kernels/kernel_sets_<level>.cpp) and
// concatenated here in the order CMake lists the levels. A layer looks its row up once, at construction, and reports
// its name. Adding a dtype or a K/V format adds lines to kernel_list.def, nothing here.
#pragma once

#include <string>
#include <vector>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/kernel_sets.hpp"

namespace gpt2attn::detail {

struct KernelSet : kernels::KernelRow {
  std::string name;  // reported by implementation(): "<compute>/<isa>", or "<compute>-kv<kv>/<isa>" when they differ
};

// Every row this CPU runs, best first: a level it lacks is left out whole (its kernels cannot run, and even building
// its rows would run code compiled with its flags).
const std::vector<KernelSet>& kernel_table();

// What level `isa` (a compiled level this CPU runs) compiled: its rows and the probes of its vector helpers, for the
// tests. Throws invalid_argument for a level this CPU lacks or the library does not hold.
const kernels::IsaKernels& isa_kernels(Isa isa);

// The K/V storage formats: every K/V type of the kernel list (each has a scalar row, so every CPU runs it), and
// their names in DType's order ("f32, bf16, i8, fp8"), for error messages.
bool is_kv_format(DType t);
std::string kv_format_names();

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
// Decode's few-row projection kernel at level `resolved` for weights in `format` (compute: the compute type's).
inline const kernels::LinearKernel& linear_kernel(Isa resolved, WeightFormat format, DType compute) {
  if (format == WeightFormat::compute) return *kernels_for(resolved, compute, compute).few_row_linear;
  return *isa_kernels(resolved).quantized_linear[static_cast<size_t>(format)];
}

}  // namespace gpt2attn::detail
