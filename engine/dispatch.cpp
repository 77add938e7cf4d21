// engine/dispatch.cpp: the ordered table of kernel sets (engine/dispatch.hpp) and the lookup into it.
#include "engine/dispatch.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gpt2attn/error.hpp"
#include "gpt2attn/kv_cache.hpp"

// The specialisations kernels/kernel_sets_<level>.cpp define, one per level CMake compiles.
namespace gpt2attn::kernels {
#define GPT2ATTN_ISA_LEVEL(level) \
  template <>                     \
  const IsaKernels& isa_kernels<Isa::level>();
#include "isa_list.inc"
#undef GPT2ATTN_ISA_LEVEL
}  // namespace gpt2attn::kernels

namespace gpt2attn::detail {

namespace {

std::string row_name(const kernels::KernelRow& row) {
  std::string name = to_string(row.compute);
  if (row.kv != row.compute) name += std::string("-kv") + to_string(row.kv);
  return name + "/" + to_string(row.isa);
}

}  // namespace

const std::vector<KernelSet>& kernel_table() {
  static const std::vector<KernelSet> table = [] {
    std::vector<KernelSet> rows;
    for (Isa isa : compiled_isas()) {
      if (!isa_supported(isa)) continue;  // its rows could never be chosen, and building them runs its code
      const kernels::IsaKernels& level = isa_kernels(isa);
      for (size_t i = 0; i < level.count; ++i) rows.push_back({level.rows[i], row_name(level.rows[i])});
    }
    return rows;
  }();
  return table;
}

const kernels::IsaKernels& isa_kernels(Isa isa) {
  // Even building a level's rows runs code compiled with its flags.
  if (isa != Isa::best && !isa_supported(isa)) {
    invalid(std::string("instruction set ") + to_string(isa) + " is not supported by this CPU");
  }
  switch (isa) {
#define GPT2ATTN_ISA_LEVEL(level) \
  case Isa::level:                \
    return kernels::isa_kernels<Isa::level>();
#include "isa_list.inc"
#undef GPT2ATTN_ISA_LEVEL
    default:
      break;
  }
  invalid(std::string("instruction set ") + to_string(isa) + " is not compiled into this library");
}

bool is_kv_format(DType t) {
  const auto& table = kernel_table();
  return std::any_of(table.begin(), table.end(), [&](const KernelSet& row) { return row.kv == t; });
}

std::string kv_format_names() {
  std::string names;
  for (DType t : kv_cache_dtypes()) names += (names.empty() ? "" : ", ") + std::string(to_string(t));
  return names;
}

}  // namespace gpt2attn::detail

namespace gpt2attn {

std::vector<DType> kv_cache_dtypes() {
  std::vector<DType> out;
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (detail::is_kv_format(static_cast<DType>(i))) out.push_back(static_cast<DType>(i));
  }
  return out;
}

}  // namespace gpt2attn

namespace gpt2attn::detail {

Isa resolve_isa(Isa requested) {
  if (requested == Isa::best) {
    const char* env = std::getenv("GPT2ATTN_ISA");
    requested = (env && *env) ? isa_from_string(env) : Isa::best;
  }
  if (requested == Isa::best) return best_supported_isa();
  if (!isa_supported(requested)) {
    invalid(std::string("instruction set ") + to_string(requested) + " is not supported by this CPU (best: " +
            to_string(best_supported_isa()) + ")");
  }
  return requested;
}

const KernelSet& kernels_for(Isa resolved, DType compute, DType kv) {
  // compiled_isas() is best first: a row is at or below `resolved` when its level comes at or after it.
  const std::vector<Isa> order = compiled_isas();
  auto rank = [&](Isa isa) {
    for (size_t i = 0; i < order.size(); ++i) {
      if (order[i] == isa) return i;
    }
    return order.size();
  };
  for (const KernelSet& row : kernel_table()) {
    if (rank(row.isa) >= rank(resolved) && row.compute == compute && row.kv == kv && isa_supported(row.isa)) {
      return row;
    }
  }
  invalid(std::string("no kernels for compute dtype ") + to_string(compute) + " with K/V dtype " + to_string(kv) +
          " at instruction set " + to_string(resolved) + " or below");
}

}  // namespace gpt2attn::detail
