// kernels/kv_layout.hpp: the one description of a KV-cache block, shared by the pool that allocates blocks
// (engine/kv_cache.cpp), the one writer that stores K/V rows into them and the reader that copies them out
// (KvCache::Impl::store_row / load_row), and the kernels that read them in place (kernels/kv_source.hpp,
// kernels/decode_attention_impl.hpp). Pure arithmetic on sizes: no allocation, no element conversion.
//
// A block holds block_tokens consecutive tokens of one sequence, for every K/V head, in bytes:
//   K [heads][block_tokens][D] | V [heads][block_tokens][D]
// elements of type `dtype`; one head's keys inside a block are one contiguous (block_tokens, D) tile, each token's
// D values contiguous, so the kernels read a run of keys as a plain (n, D) matrix with row stride D. A block's
// address never changes, so block tables hold plain pointers. Per-token scales of quantised storage (int8 K/V) are
// a third region, after V, once such a format exists; f32 (and bf16) blocks carry none.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpt2attn/dtype.hpp"

namespace gpt2attn::kernels {

enum class KvPart : uint8_t { key, value };

struct KvLayout {
  DType dtype = DType::f32;  // element type of the stored K and V rows
  int64_t heads = 0;         // H_kv: K/V heads stored (query heads map onto them, see AttnShape::kv_head)
  int64_t block_tokens = 0;  // tokens per block
  int64_t D = 0;             // head size

  // Sizes in bytes. A block is 2 * heads tiles; the pool computes that size once, with checked arithmetic
  // (KvCache::Impl::block_bytes), and every offset below is smaller, so none of these can overflow afterwards.
  int64_t row_bytes() const { return D * static_cast<int64_t>(size_of(dtype)); }
  int64_t tile_bytes() const { return block_tokens * row_bytes(); }  // one head's K (or V) tile

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
};

}  // namespace gpt2attn::kernels
