// tests/attn_case.hpp: one named attention case with every axis a test may vary (shape, self/cross, causal, mask,
// key padding, compute and K/V dtypes, threads, seed) and a name() that prints them all, for failure messages.
// It builds no tensors and runs nothing: each test turns a case into inputs its own way.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/dtype.hpp"

namespace gpt2attn::test {

// The attn_mask of a case: its MaskKind and element type together, as the sweep draws them.
enum class MaskVariant : uint8_t { none, keep_u8, keep_f32, block_u8, block_f32, additive_f32 };
inline constexpr MaskVariant kMaskVariants[] = {MaskVariant::keep_u8, MaskVariant::keep_f32, MaskVariant::block_u8,
                                                MaskVariant::block_f32, MaskVariant::additive_f32};  // all but none

inline const char* to_string(MaskVariant m) {
  switch (m) {
    case MaskVariant::none: return "none";
    case MaskVariant::keep_u8: return "keep/u8";
    case MaskVariant::keep_f32: return "keep/f32";
    case MaskVariant::block_u8: return "block/u8";
    case MaskVariant::block_f32: return "block/f32";
    case MaskVariant::additive_f32: return "additive/f32";
  }
  return "?";
}
inline MaskKind mask_kind(MaskVariant m) {
  switch (m) {
    case MaskVariant::block_u8:
    case MaskVariant::block_f32: return MaskKind::block;
    case MaskVariant::additive_f32: return MaskKind::additive;
    default: return MaskKind::keep;
  }
}
inline DType mask_dtype(MaskVariant m) {
  return m == MaskVariant::keep_u8 || m == MaskVariant::block_u8 ? DType::u8 : DType::f32;
}

// key_padding (B, Tk), nonzero = padding.
enum class KeyPadding : uint8_t { none, u8, f32 };
inline const char* to_string(KeyPadding p) {
  return p == KeyPadding::none ? "none" : p == KeyPadding::u8 ? "u8" : "f32";
}

struct AttnCase {
  int64_t B = 1, T = 1, Tk = 1;  // batch, query length, key length (Tk == T for self-attention)
  int64_t H = 1, H_kv = 1;       // query heads, K/V heads (H_kv divides H: grouped-query, 1 = multi-query)
  int64_t D = 1;                 // head size
  bool self = true;              // self-attention (key = value = query) or cross-attention
  bool causal = false;
  MaskVariant mask = MaskVariant::none;
  KeyPadding padding = KeyPadding::none;
  DType compute = DType::f32;  // the kernels' arithmetic
  DType kv = DType::f32;       // K/V storage
  int threads = 1;
  uint64_t seed = 0;

  int64_t E() const { return H * D; }

  // "B=2 T=33 Tk=33 H=4 H_kv=4 D=16 self causal mask=keep/u8 pad=none compute=f32 kv=f32 threads=2 seed=17"
  std::string name() const {
    std::ostringstream s;
    s << "B=" << B << " T=" << T << " Tk=" << Tk << " H=" << H << " H_kv=" << H_kv << " D=" << D
      << (self ? " self" : " cross") << (causal ? " causal" : " non-causal") << " mask=" << to_string(mask)
      << " pad=" << to_string(padding) << " compute=" << gpt2attn::to_string(compute)
      << " kv=" << gpt2attn::to_string(kv) << " threads=" << threads << " seed=" << seed;
    return s.str();
  }
};

// The K/V head count of case `index` for H query heads: H's divisors in turn, largest first (plain multi-head,
// then grouped, ..., multi-query), so a sweep meets every grouping of every head count it draws. It uses the
// index, not the random stream, so the other axes of a case stay what they were.
inline int64_t kv_heads_for(int64_t H, int index) {
  std::vector<int64_t> divisors;
  for (int64_t d = H; d >= 1; --d) {
    if (H % d == 0) divisors.push_back(d);
  }
  return divisors[static_cast<size_t>(index / 2) % divisors.size()];  // index / 2: index % 2 picks the threads
}

}  // namespace gpt2attn::test
