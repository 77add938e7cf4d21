// kernels/kv_layout.hpp: the one description of a KV-cache block, shared by the pool that allocates blocks
// (engine/kv_cache.cpp), the one writer that stores K/V rows into them and the reader that copies them out
// (KvCache::Impl::store_row / load_row), and the kernels that read them in place (kernels/kv_source.hpp,
// kernels/decode_attention_impl.hpp). Pure arithmetic on sizes: no allocation, no element conversion.
//
// A block holds block_tokens consecutive tokens of one sequence, for every K/V head, in bytes:
//   K [heads][block_tokens][D] | V [heads][block_tokens][D] | (int8, fp8) K scales [heads][block_tokens] f32,
//                                                                          V scales [heads][block_tokens] f32
// elements of type `dtype`; one head's keys inside a block are one contiguous (block_tokens, D) tile, each token's
// D values contiguous, so the kernels read a run of keys as a plain (n, D) matrix with row stride D, and a run's
// scales as a plain array. A quantised block carries its own scales, so it stays one self-contained unit that a
// fork's copy on write copies whole. A block's address never changes, so block tables hold plain pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gpt2attn/dtype.hpp"
#include "kernels/fp8.hpp"

namespace gpt2attn::kernels {

enum class KvPart : uint8_t { key, value };

// Whether stored rows of element type T carry a scale (value = widen(code) * scale: int8, fp8): the kernels multiply
// scores by the key's scale and probabilities by the value's, once per key rather than once per element.
template <class T>
inline constexpr bool kRowScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, fp8_e4m3>;

struct KvLayout {
  DType dtype = DType::f32;  // element type of the stored K and V rows
  int64_t heads = 0;         // H_kv: K/V heads stored (query heads map onto them, see AttnShape::kv_head)
  int64_t block_tokens = 0;  // tokens per block
  int64_t D = 0;             // head size

  // Sizes in bytes. The pool computes block_bytes() once, with checked arithmetic (KvCache::Impl), and every offset
  // below is smaller, so none of these can overflow afterwards.
  int64_t row_bytes() const { return D * static_cast<int64_t>(size_of(dtype)); }
  int64_t tile_bytes() const { return block_tokens * row_bytes(); }  // one head's K (or V) tile
  // int8 and fp8 rows carry one f32 scale per (token, head) for K and for V: value = widen(code) * scale.
  bool scaled() const { return dtype == DType::i8 || dtype == DType::fp8; }
  // The scales start 4-byte aligned after the tiles; a block's size is a multiple of 4 (fp8 tiles of odd sizes are
  // padded), so in a pool of blocks every block and its scales stay aligned.
  int64_t scales_offset() const { return (2 * heads * tile_bytes() + 3) / 4 * 4; }
  int64_t block_bytes() const {
    return scaled() ? scales_offset() + 2 * heads * block_tokens * static_cast<int64_t>(sizeof(float))
                    : scales_offset();
  }

  // Byte offset of head h's K or V tile inside a block, and of token `slot` (0 <= slot < block_tokens) in it.
  int64_t tile_offset(KvPart part, int64_t h) const {
    return ((part == KvPart::value ? heads : 0) + h) * tile_bytes();
  }
  int64_t row_offset(KvPart part, int64_t h, int64_t slot) const { return tile_offset(part, h) + slot * row_bytes(); }

  // Head h's K or V row of token `slot` in `block`, as elements of type T (T must be the layout's dtype's type).
  template <class T>
  T* row(std::byte* block, KvPart part, int64_t h, int64_t slot) const {
    return reinterpret_cast<T*>(block + row_offset(part, h, slot));
  }
  template <class T>
  const T* row(const std::byte* block, KvPart part, int64_t h, int64_t slot) const {
    return reinterpret_cast<const T*>(block + row_offset(part, h, slot));
  }

  // Head h's K or V scales from token `slot` on (scaled() layouts only): scale[i] belongs to row slot + i.
  int64_t scale_offset(KvPart part, int64_t h, int64_t slot) const {
    return scales_offset() + (((part == KvPart::value ? heads : 0) + h) * block_tokens + slot) *
                                 static_cast<int64_t>(sizeof(float));
  }
  float* scales(std::byte* block, KvPart part, int64_t h, int64_t slot) const {
    return reinterpret_cast<float*>(block + scale_offset(part, h, slot));
  }
  const float* scales(const std::byte* block, KvPart part, int64_t h, int64_t slot) const {
    return reinterpret_cast<const float*>(block + scale_offset(part, h, slot));
  }
};

}  // namespace gpt2attn::kernels
