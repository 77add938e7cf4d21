// kernels/kernel_sets_impl.hpp: expands one level's lines of kernels/kernel_list.def into kernel sets. Included only by
// kernels/kernel_sets_<level>.cpp, each compiled with its level's flags; like the algorithms it instantiates, it has
// internal linkage, so code compiled for one level can never be linked into another's rows.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_impl.hpp"
#include "kernels/decode_attention_impl.hpp"
#include "kernels/element.hpp"
#include "kernels/int_dot.hpp"
#include "kernels/kernel_sets.hpp"
#include "kernels/linear_impl.hpp"
#include "kernels/row_ops_impl.hpp"
#include "kernels/vec_probe_impl.hpp"

namespace gpt2attn::kernels {
namespace {

// How a level compiles its rows: the vector architecture, the micro-kernels' register blocking (kernels/tiles.hpp),
// and whether bf16 compute over bf16 K/V runs the bf16 pair dot product (MicroBf16Dot: vdpbf16ps, or its one-lane
// twin on the scalar level, so the pair algorithm is checkable on any CPU) rather than widening to f32.
template <Isa Level, class Arch, tiles::Blocking Bl, bool Bf16Dot>
struct LevelTraits {
  static constexpr Isa kLevel = Level;
  using ArchT = Arch;
  static constexpr tiles::Blocking kBlocking = Bl;
  static constexpr bool kBf16Dot = Bf16Dot;
};

// One row: the prefill core, the decode core and decode's projections for compute type C over K/V stored as Kv. Decode
// reads an f32 query whatever C is; its projections read weights packed in C.
template <class L, class C, class Kv>
KernelRow make_kernel_set(const char* why) {
  static_assert(std::is_same_v<C, float> || std::is_same_v<C, bf16>, "the compute types are f32 and bf16");
  using Arch = typename L::ArchT;
  const AttentionKernel* prefill = nullptr;
  if constexpr (L::kBf16Dot && std::is_same_v<C, bf16> && std::is_same_v<Kv, bf16>) {
    prefill = &make_attention_kernel_bf16dot<L::kLevel, Arch, L::kBlocking>();
  } else {
    prefill = &make_attention_kernel<L::kLevel, Arch, L::kBlocking, Kv, C>();
  }
  return {L::kLevel,
          dtype_of<C>(),
          dtype_of<Kv>(),
          why,
          prefill,
          &make_decode_kernel<L::kLevel, Arch, Kv>(),
          &make_linear_kernel<L::kLevel, Arch, C>()};
}

// The lines of kernel_list.def whose level is L's, in the list's order. A line of another level is a discarded
// `if constexpr` branch: its kernels are never instantiated with this level's flags.
template <class L>
const IsaKernels& make_isa_kernels() {
  static constexpr size_t kCount = 0
#define GPT2ATTN_KERNEL_SET(level, Compute, Kv, why) +size_t{Isa::level == L::kLevel}
#define GPT2ATTN_WEIGHT_FORMAT(format, Packed, why)
#include "kernels/kernel_list.def"
#undef GPT2ATTN_WEIGHT_FORMAT
#undef GPT2ATTN_KERNEL_SET
      ;
  static_assert(kCount > 0, "a compiled level has at least one line in kernels/kernel_list.def");
  static const std::array<KernelRow, kCount> rows = [] {
    std::array<KernelRow, kCount> r{};
    size_t n = 0;
    [[maybe_unused]] auto add = [&]<Isa Line, class C, class Kv>(const char* why) {
      if constexpr (Line == L::kLevel) r[n++] = make_kernel_set<L, C, Kv>(why);
    };
#define GPT2ATTN_KERNEL_SET(level, Compute, Kv, why) add.template operator()<Isa::level, Compute, Kv>(why);
#define GPT2ATTN_WEIGHT_FORMAT(format, Packed, why)
#include "kernels/kernel_list.def"
#undef GPT2ATTN_WEIGHT_FORMAT
#undef GPT2ATTN_KERNEL_SET
    return r;
  }();
  std::array<const LinearKernel*, kNumWeightFormats> quantized{};
#define GPT2ATTN_KERNEL_SET(level, Compute, Kv, why)
#define GPT2ATTN_WEIGHT_FORMAT(format, Packed, why)                       \
  static_assert(QuantLinear<typename L::ArchT, Packed>::kFormat == WeightFormat::format); \
  quantized[static_cast<size_t>(WeightFormat::format)] = &make_linear_kernel<L::kLevel, typename L::ArchT, Packed>();
#include "kernels/kernel_list.def"
#undef GPT2ATTN_WEIGHT_FORMAT
#undef GPT2ATTN_KERNEL_SET
  static const IsaKernels kernels{rows.data(), rows.size(), quantized,
                                  &make_int_dot_kernel<L::kLevel, typename L::ArchT>(),
                                  &make_vec_probe<L::kLevel, typename L::ArchT>(),
                                  &make_row_ops<L::kLevel, typename L::ArchT>()};
  return kernels;
}

}  // namespace
}  // namespace gpt2attn::kernels
