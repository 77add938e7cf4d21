// engine/kv_cache.hpp: KvCache's internals: the block pool, reference counts, sequences' block tables, the two
// calls a layer makes around an append (begin_append reserves and leases, end_append commits), and the one K/V row
// writer and reader. Holds no attention code: the layer (engine/serving.cpp) stores K/V into the blocks through
// the layout (kernels/kv_layout.hpp) and the kernels read them in place.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/buffer.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "kernels/kv_layout.hpp"

namespace gpt2attn {

// How many tokens an append adds to each of its sequences: the same count for all (extend, decode) or one per
// sequence (a ragged step), so one lease serves both.
struct AppendTokens {
  const int64_t* each = nullptr;  // (n) counts, or null for `all`
  int64_t all = 0;
  AppendTokens(int64_t all_) : all(all_) {}  // NOLINT(google-explicit-constructor): a count reads as itself
  explicit AppendTokens(const int64_t* each_) : each(each_) {}
  int64_t operator[](int64_t i) const { return each ? each[i] : all; }
};

struct KvCache::Impl {
  struct Sequence {
    std::vector<int32_t> blocks;  // block table; capacity reserved for context_length at create()
    int64_t length = 0;           // cached tokens
    bool busy = false;            // leased by a running extend/decode
    // What the running append changed, so a failed call can be undone (end_append):
    int64_t blocks_before = 0;    // the table's size before it
    int32_t cow_original = -1;    // the shared block a copy-on-write copy replaced (pinned), or -1
    mutable uint64_t seen = 0;    // the call stamp of the append pass that last met it (repeated ids)
  };

  Config cfg;
  kernels::KvLayout layout;  // every block's layout: dtype, H_kv heads, block_tokens, D
  int64_t block_tokens = 0, max_blocks_per_seq = 0;
  size_t block_bytes = 0;    // layout.block_bytes(), computed checked
  int64_t nblocks = 0;
  detail::Buffer pool;                       // nblocks x block_bytes, on huge pages (engine/buffer.hpp)
  std::vector<int32_t> refcount;             // sequences holding each block
  std::vector<int32_t> pins;                 // running appends that may hand the block back (cow_original)
  std::vector<int32_t> free_list;            // a stack of the blocks with refcount == 0 and pins == 0
  std::unordered_map<SequenceId, Sequence> seqs;
  SequenceId next_id = 1;
  mutable std::mutex mu;
  // An append's passes count, per block, how many of the call's earlier sequences write or copied it: count[b] is
  // valid where stamp[b] is the pass's stamp (a new stamp per pass, so nothing is cleared). O(1) a sequence, where a
  // rescan of the earlier ones makes a batch of B sequences O(B^2) under mu: a decode of 2048 forks of one prompt
  // spends 1.6 ms here with the stamps, 40 ms with the rescan.
  mutable uint64_t pass_stamp = 0;
  mutable std::vector<uint64_t> block_stamp;
  mutable std::vector<int64_t> block_count;
  // This pass's count of block x so far, and its increment.
  int64_t earlier_in_pass(int32_t x, uint64_t pass) const { return block_stamp[x] == pass ? block_count[x] : 0; }
  void count_in_pass(int32_t x, uint64_t pass) const {
    block_count[x] = earlier_in_pass(x, pass) + 1;
    block_stamp[x] = pass;
  }

  Impl(const Config& c, const KvCacheOptions& o);

  std::byte* block(int32_t b) const { return pool.get() + static_cast<size_t>(b) * block_bytes; }

  // The one K/V writer and reader: head h's row of token `slot` in `block`, stored from / loaded into D floats in
  // the layout's element type by kernels/kv_codec.hpp (f32 copies, bf16 rounds to nearest even, int8 quantises
  // with the row's own scale; a new format converts there and nowhere else). The layer's prefill GEMMs write f32
  // rows in place instead, at the same address (layout.row), when the format is f32.
  void store_row(std::byte* block, kernels::KvPart part, int64_t h, int64_t slot, const float* src) const;
  void load_row(const std::byte* block, kernels::KvPart part, int64_t h, int64_t slot, float* dst) const;

  // For an append of tokens[i] to each seqs[i], i < n: checks every id (known, not busy, not repeated) and the
  // lengths against `max_length` and the pool's size (invalid_argument), then takes the blocks all of them need
  // (new blocks and copy-on-write copies of shared blocks about to be written) or throws out_of_memory with nothing
  // changed. O(n) besides the blocks taken (the pass stamps). On success the
  // sequences are marked busy, lengths[i] = cached tokens before the append, and tables + i * table_stride
  // holds the block pointers covering [0, lengths[i] + tokens[i]).
  void begin_append(const SequenceId* seqs, int64_t n, AppendTokens tokens, int64_t max_length, std::byte** tables,
                    int64_t table_stride, int64_t* lengths);
  // begin_append's checks alone, with the same errors, changing nothing (a tensor-parallel rank checks before the
  // ranks agree to go ahead, engine/mpi/). Takes mu.
  void check_append(const SequenceId* seqs, int64_t n, AppendTokens tokens, int64_t max_length) const;
  // Those checks, returning the blocks the append takes; caller holds mu.
  int64_t blocks_for_append(const SequenceId* seqs, int64_t n, AppendTokens tokens, int64_t max_length) const;
  // Ends the lease: on success the lengths grow by tokens[i]; on failure every block taken is returned and a
  // copy-on-write copy is replaced by the original again. Either way the sequences are free again.
  void end_append(const SequenceId* seqs, int64_t n, AppendTokens tokens, bool success) noexcept;

  Sequence& find(SequenceId id);  // throws invalid_argument for an unknown or released id; caller holds mu
  const Sequence& find(SequenceId id) const;
  // The pool index of the block holding token t of `s`; invalid_argument unless 0 <= t < length. Caller holds mu.
  int32_t block_holding(const Sequence& s, int64_t t) const;
  // The partly filled block an append to `s` writes into first (it holds the last position), or -1 when the length
  // sits on a block boundary. Only it can be shared and about to be written: full blocks are never written again,
  // and a sequence holds no block past its length (end_append trims).
  int32_t partial_block(const Sequence& s) const;
  // Whether an append must copy block x before writing into it, where `own` earlier sequences of the same call
  // hold or held x (pass 1: the earlier writers of x; pass 2: those that copied it, now pinning it). x may be
  // written in place only by its last holder: while another sequence holds it (refcount) or another call's
  // copy-on-write may still hand it back on failure (pins), an in-place write would change what they read. A
  // copy moves one count from refcount to pins, so the sum stays r + p over a call and, of w writers in one call,
  // min(w, r + p - 1) copy: the last holder writes in place only when no other call pins the block.
  bool must_copy(int32_t x, int64_t own) const { return refcount[x] + pins[x] - own > 1; }
  // The blocks holding the first `tokens` tokens of a sequence: its table's size at that length.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_tokens - 1) / block_tokens; }
  // The table size `s` needs after appending `tokens`, and the new blocks that takes beyond what it holds.
  int64_t table_size_after(const Sequence& s, int64_t tokens) const { return blocks_for(s.length + tokens); }
  int64_t new_blocks(const Sequence& s, int64_t tokens) const {
    const int64_t grow = table_size_after(s, tokens) - static_cast<int64_t>(s.blocks.size());
    return grow > 0 ? grow : 0;
  }
  int32_t take_block();           // caller holds mu and has checked free_list is not empty
  void drop_block(int32_t b);     // caller holds mu
  void unpin(int32_t b);          // caller holds mu

  // The pool's accounting, checked from scratch (for tests): every block is free exactly once or held or
  // pinned; each refcount equals the table entries that name the block; lengths fit their tables. Returns ""
  // when it holds, else what is wrong.
  std::string audit() const;
  // The pool index of the block holding token t of `seq` (for tests that check which blocks are shared).
  int32_t block_of(SequenceId seq, int64_t t) const;
};

}  // namespace gpt2attn
