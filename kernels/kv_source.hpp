// kernels/kv_source.hpp: where the tiled kernel reads one head's K and V rows from, as compile-time policies over
// the stored element type T: contiguous (B, H, Tk, D) arrays from the batch forward, or the KV cache's blocks
// (kernels/kv_layout.hpp). A kernel walks keys in runs that are one strided slab each; a source says where a run
// may start and end. Resolved once per call (AttentionKernel::run picks the instantiation), never per key: one
// body with run-time paging checks measured ~7% slower on the core than the contiguous path it replaced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/kv_layout.hpp"

namespace gpt2attn::kernels {

// The run-time description of one head's K/V that a call carries (AttentionArgs::kv); the kernel turns it into one
// of the policies below. Exactly one of `k` (contiguous) and `blocks` (paged) is set.
struct KvRef {
  // Contiguous: key j at k + j * ldk, value j at v + j * ldv (elements of the kernel's K/V type).
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t ldk = 0, ldv = 0;
  // Paged: key j of K/V head `head` in block blocks[j / layout.block_tokens] (see KvLayout).
  const std::byte* const* blocks = nullptr;
  KvLayout layout;
  int64_t head = 0;
};

template <class T>
struct ContiguousKv {
  const T* k;
  const T* v;
  int64_t ldk, ldv;

  explicit ContiguousKv(const KvRef& r)
      : k(static_cast<const T*>(r.k)), v(static_cast<const T*>(r.v)), ldk(r.ldk), ldv(r.ldv) {}
  int64_t run_end(int64_t) const { return std::numeric_limits<int64_t>::max(); }  // one run: no boundaries
  const T* keys(int64_t j) const { return k + j * ldk; }
  const T* values(int64_t j) const { return v + j * ldv; }
  // Contiguous K/V come from the batch forward in the compute type: never row-scaled.
  const float* key_scales(int64_t) const { return nullptr; }
  const float* value_scales(int64_t) const { return nullptr; }
  int64_t key_stride() const { return ldk; }
  int64_t value_stride() const { return ldv; }
};

template <class T>
struct PagedKv {
  const std::byte* const* blocks;
  KvLayout layout;
  int64_t head;

  explicit PagedKv(const KvRef& r) : blocks(r.blocks), layout(r.layout), head(r.head) {}
  // Runs end at block boundaries: every run is one contiguous (n, D) slab of a head's tile.
  int64_t run_end(int64_t j) const { return (j / layout.block_tokens + 1) * layout.block_tokens; }
  const T* keys(int64_t j) const { return at(KvPart::key, j); }
  const T* values(int64_t j) const { return at(KvPart::value, j); }
  // The scales of the rows from key j on (row-scaled types only; a run never leaves its block, so they are
  // contiguous for the whole run).
  const float* key_scales(int64_t j) const { return scales_at(KvPart::key, j); }
  const float* value_scales(int64_t j) const { return scales_at(KvPart::value, j); }
  int64_t key_stride() const { return layout.D; }
  int64_t value_stride() const { return layout.D; }

 private:
  const T* at(KvPart part, int64_t j) const {
    const int64_t bt = layout.block_tokens;
    return layout.row<T>(blocks[j / bt], part, head, j % bt);
  }
  const float* scales_at(KvPart part, int64_t j) const {
    if constexpr (!kRowScaled<T>) return nullptr;
    const int64_t bt = layout.block_tokens;
    return layout.scales(blocks[j / bt], part, head, j % bt);
  }
};

}  // namespace gpt2attn::kernels
