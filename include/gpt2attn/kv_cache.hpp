// gpt2attn/kv_cache.hpp: the paged K/V cache an inference server keeps per attention layer: a pool of
// fixed-size blocks allocated once, and sequences that own block tables into it (vLLM's paged attention,
// on a CPU). The layer (CausalSelfAttention::extend / decode in attention.hpp) writes and reads it; this
// class only manages blocks and sequences and never computes attention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/dtype.hpp"
#include "gpt2attn/export.h"

namespace gpt2attn {

// A sequence's handle. Ids are never reused within one KvCache, so a released id stays invalid.
using SequenceId = int64_t;

// The storage types KvCacheOptions::dtype accepts, in DType order: every K/V format the kernels serve (f32, bf16,
// i8, fp8), so a program can offer them without restating the list.
GPT2ATTN_API std::vector<DType> kv_cache_dtypes();

struct KvCacheOptions {
  int64_t block_tokens = 0;     // tokens per block; 0 = min(64, context_length). 64 is the kernels' key tile
                                // (kernels/tiles.hpp), so a key tile never straddles two blocks
  int64_t capacity_tokens = 0;  // pool size in tokens, rounded up to whole blocks ...
  size_t capacity_bytes = 0;    // ... or in bytes, rounded down to whole blocks. Exactly one is set.
  DType dtype = DType::f32;     // how K and V are stored, each value converted once, when it is appended:
                                // f32; bf16 (half the bytes, rounded to nearest even); or i8 (about 0.27x the
                                // bytes at D = 64: symmetric int8 with one f32 scale per token, head and K or V,
                                // max|row| / 127). Attention still computes in f32.
};

// Block layout, the "KV-friendly layout" the kernels read with no copy (kernels/kv_layout.hpp):
//   K [H_kv][block_tokens][D], then V [H_kv][block_tokens][D], elements of options.dtype (H_kv = config.kv_heads()),
//   then for i8 and fp8 the scales: K [H_kv][block_tokens], V [H_kv][block_tokens] f32
// so one head's keys inside a block are one contiguous (block_tokens, D) tile, each token's D values
// contiguous, and a block carries its own scales. A block's address never changes, so block tables hold plain
// pointers.
//
// Thread safety: every method may be called from any thread. Block bookkeeping is guarded by one mutex, held
// for O(B + blocks) bookkeeping and, when a fork's shared block is first written, one block copy; never
// while attention runs. create() and fork() allocate the sequence's entry. Distinct sequences may be extended or
// decoded concurrently; one sequence must not be used by two calls at once (the layer checks and refuses).
//
// Forks share blocks: a fork's blocks are the parent's, reference counted; a full shared block is never
// written again, and the first append into a shared partially filled block copies it (copy on write). Until the
// call that copied it ends, the original also counts as shared, since a failure hands it back to that sequence:
// a concurrent append of its other holder copies it too rather than write into it.
class GPT2ATTN_API KvCache {
 public:
  // Allocates the whole pool now and touches every page of it (Error out_of_memory if that fails), so no step takes
  // a page fault; nothing is allocated later except each sequence's block table, which grows to at most
  // ceil(context_length / block_tokens) entries and is reserved at create(). The pool serves layers whose config has
  // the same d_model, num_heads and num_kv_heads.
  KvCache(const Config& config, const KvCacheOptions& options);
  ~KvCache();
  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;

  SequenceId create();                   // an empty sequence; it takes no block until tokens are appended
  SequenceId fork(SequenceId parent);    // a new sequence sharing the parent's tokens (and blocks)
  // A new sequence sharing the parent's first prefix_tokens tokens (0 <= prefix_tokens <= length(parent)): a shared
  // system prompt. Its whole blocks are shared; the partly used last one is shared too and copied on the child's
  // first append into it. invalid_argument for a prefix out of range.
  SequenceId fork(SequenceId parent, int64_t prefix_tokens);
  // Drops the last tokens of `seq`, keeping 0 <= new_length <= length(seq) (rejected draft tokens, a cancelled
  // chunk): the blocks past it go back to the pool unless another sequence holds them, and a partly used last block
  // still shared with a fork is copied on the next append, so no other sequence's tokens ever change.
  // invalid_argument for a length out of range or a sequence in use by a running call.
  void truncate(SequenceId seq, int64_t new_length);
  void release(SequenceId seq);          // returns the blocks no other sequence shares; the id becomes invalid
  bool contains(SequenceId seq) const;
  int64_t length(SequenceId seq) const;  // cached tokens

  // Blocks an append of `tokens` to `seq` would take from the pool now (new blocks + a copy-on-write copy).
  // invalid_argument when tokens < 0 or the sequence's length plus tokens passes the cache's context_length.
  int64_t blocks_needed(SequenceId seq, int64_t tokens) const;

  int64_t block_tokens() const;
  static int64_t default_block_tokens(const Config& config);  // what block_tokens = 0 gives
  int64_t total_blocks() const;
  int64_t free_blocks() const;
  int64_t num_sequences() const;
  size_t block_bytes() const;     // 2 * H_kv * block_tokens * D * size_of(dtype()) (rounded up to 4), plus for i8, fp8
                                  // the scales, 2 * H_kv * block_tokens * 4
  DType dtype() const;            // the storage type of K and V
  size_t capacity_bytes() const;  // total_blocks() * block_bytes()
  const Config& config() const;

  // Copies the cached key / value of token t (0 <= t < length) and K/V head h into dst (D floats), converted from
  // the storage format. For tests and tools: it takes the cache's lock. invalid_argument for an unknown sequence,
  // a head or token out of range, or a null dst.
  void read_key(SequenceId seq, int64_t h, int64_t t, float* dst) const;
  void read_value(SequenceId seq, int64_t h, int64_t t, float* dst) const;

  struct GPT2ATTN_LOCAL Impl;  // engine-internal (engine/kv_cache.hpp)
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpt2attn
