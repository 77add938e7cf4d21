// engine/kv_cache.cpp: the KV block pool: allocated once, blocks handed out and reference counted, sequences'
// block tables, copy on write for forks, all-or-nothing reservation before any K/V is written.
#include "engine/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "engine/dispatch.hpp"
#include "engine/util.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/kv_codec.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn {

using detail::ceil_div;
using detail::str;

KvCache::Impl::Impl(const Config& c, const KvCacheOptions& o) : cfg(c) {
  cfg.validate();
  block_tokens = o.block_tokens == 0 ? KvCache::default_block_tokens(cfg) : o.block_tokens;
  if (block_tokens < 1) invalid("KvCacheOptions.block_tokens must be >= 1, got " + str(block_tokens));
  if (block_tokens > cfg.context_length) {
    invalid("KvCacheOptions.block_tokens=" + str(block_tokens) + " exceeds context_length=" + str(cfg.context_length));
  }
  if ((o.capacity_tokens > 0) == (o.capacity_bytes > 0)) {
    invalid("KvCacheOptions: set exactly one of capacity_tokens (" + str(o.capacity_tokens) + ") and capacity_bytes (" +
            std::to_string(o.capacity_bytes) + ")");
  }
  if (o.capacity_tokens < 0) invalid("KvCacheOptions.capacity_tokens must be >= 0, got " + str(o.capacity_tokens));
  if (!detail::is_kv_format(o.dtype)) {
    invalid(std::string("KvCacheOptions.dtype: ") + to_string(o.dtype) + " is not a K/V storage format (" +
            detail::kv_format_names() + ")");
  }
  layout.dtype = o.dtype;
  layout.heads = cfg.kv_heads();
  layout.block_tokens = block_tokens;
  layout.D = cfg.head_dim();
  // Checked here once (the tiles, rounded up to 4, plus int8's scales): every size and offset the layout computes
  // afterwards is at most this.
  const int64_t tiles = detail::checked_product(
      {2, layout.heads, block_tokens, layout.D, static_cast<int64_t>(size_of(layout.dtype))}, "KvCache: block bytes");
  const int64_t scales =
      layout.scaled() ? detail::checked_product({2, layout.heads, block_tokens, 4}, "KvCache: block bytes") : 0;
  block_bytes = static_cast<size_t>(
      detail::checked_add(detail::round_up(tiles, 4, "KvCache: block bytes"), scales, "KvCache: block bytes"));
  if (block_bytes != static_cast<size_t>(layout.block_bytes())) fail(ErrorCode::internal, "KvCache: block layout");
  nblocks = o.capacity_tokens > 0 ? ceil_div(o.capacity_tokens, block_tokens)
                                  : static_cast<int64_t>(o.capacity_bytes / block_bytes);
  if (nblocks < 1) {
    invalid("KvCacheOptions.capacity_bytes=" + std::to_string(o.capacity_bytes) + " holds no block (one block is " +
            std::to_string(block_bytes) + " bytes)");
  }
  if (nblocks > INT32_MAX) invalid("KvCacheOptions: capacity of " + str(nblocks) + " blocks exceeds 2^31 - 1");
  max_blocks_per_seq = ceil_div(cfg.context_length, block_tokens);

  const size_t pool_bytes =
      static_cast<size_t>(detail::checked_mul(nblocks, static_cast<int64_t>(block_bytes), "KvCache: pool bytes"));
  pool = detail::allocate_buffer(pool_bytes, "KvCache: the pool");
  // Touched now, so no step pays the page faults of a block's first write: left to the steps, zeroing the pages
  // took 2.9% of a gpt2-small B = 16 decode step's cycles (perf, 128 -> 378 cached tokens).
  std::memset(pool.get(), 0, pool_bytes);
  refcount.assign(static_cast<size_t>(nblocks), 0);
  pins.assign(static_cast<size_t>(nblocks), 0);
  block_stamp.assign(static_cast<size_t>(nblocks), 0);
  block_count.assign(static_cast<size_t>(nblocks), 0);
  free_list.reserve(static_cast<size_t>(nblocks));
  for (int64_t b = nblocks - 1; b >= 0; --b) free_list.push_back(static_cast<int32_t>(b));
}

KvCache::Impl::Sequence& KvCache::Impl::find(SequenceId id) {
  return const_cast<Sequence&>(std::as_const(*this).find(id));
}
const KvCache::Impl::Sequence& KvCache::Impl::find(SequenceId id) const {
  auto it = seqs.find(id);
  if (it == seqs.end()) invalid("KvCache: unknown sequence id " + str(id) + " (never created, or released)");
  return it->second;
}

int32_t KvCache::Impl::block_holding(const Sequence& s, int64_t t) const {
  if (t < 0 || t >= s.length) invalid("KvCache: token " + str(t) + " out of range [0, " + str(s.length) + ")");
  return s.blocks[t / block_tokens];
}

int32_t KvCache::Impl::take_block() {
  const int32_t b = free_list.back();
  free_list.pop_back();
  refcount[b] = 1;
  return b;
}

void KvCache::Impl::drop_block(int32_t b) {
  if (--refcount[b] == 0 && pins[b] == 0) free_list.push_back(b);
}

void KvCache::Impl::unpin(int32_t b) {
  if (--pins[b] == 0 && refcount[b] == 0) free_list.push_back(b);
}

int32_t KvCache::Impl::partial_block(const Sequence& s) const {
  const int64_t b = s.length / block_tokens;
  if (s.length % block_tokens == 0 || b >= static_cast<int64_t>(s.blocks.size())) return -1;
  return s.blocks[b];
}

int64_t KvCache::Impl::blocks_for_append(const SequenceId* ids, int64_t n, AppendTokens each,
                                         int64_t max_length) const {
  int64_t needed = 0;
  const uint64_t pass = ++pass_stamp;
  for (int64_t i = 0; i < n; ++i) {
    const Sequence& s = find(ids[i]);
    const int64_t tokens = each[i];
    if (s.seen == pass) {
      const int64_t j = std::find(ids, ids + i, ids[i]) - ids;
      invalid("sequence id " + str(ids[i]) + " appears twice in one call (at " + str(j) + " and " + str(i) + ")");
    }
    s.seen = pass;
    if (s.busy) invalid("sequence " + str(ids[i]) + " is in use by another call");
    if (s.length + tokens > max_length) {
      invalid("sequence " + str(ids[i]) + ": length " + str(s.length) + " + " + str(tokens) +
              " new tokens exceeds context_length=" + str(max_length));
    }
    // A sequence larger than the whole pool is a wrong request, not a full pool: waiting for room cannot help.
    // (A batch whose sequences fit one by one but not together is out_of_memory: a smaller batch would fit.)
    if (table_size_after(s, tokens) > nblocks) {
      invalid("sequence " + str(ids[i]) + ": length " + str(s.length) + " + " + str(tokens) + " new tokens needs " +
              str(table_size_after(s, tokens)) + " blocks of " + str(block_tokens) + " tokens, more than the pool's " +
              str(nblocks) + " in all: it can never fit");
    }
    needed += new_blocks(s, tokens);
    // A shared block about to be written is copied (must_copy), unless every other holder copies it first in this
    // same call: count this call's earlier writers of it.
    const int32_t x = partial_block(s);
    if (x >= 0) {
      if (must_copy(x, 0)) needed += must_copy(x, earlier_in_pass(x, pass));
      count_in_pass(x, pass);
    }
  }
  if (needed > static_cast<int64_t>(free_list.size())) {
    fail(ErrorCode::out_of_memory, "KV pool exhausted: this call needs " + str(needed) + " free block(s) of " +
                                       str(block_tokens) + " tokens, " + str(static_cast<int64_t>(free_list.size())) +
                                       " of " + str(nblocks) + " are free; nothing was written");
  }
  return needed;
}

void KvCache::Impl::check_append(const SequenceId* ids, int64_t n, AppendTokens tokens, int64_t max_length) const {
  std::lock_guard<std::mutex> lock(mu);
  blocks_for_append(ids, n, tokens, max_length);
}

void KvCache::Impl::begin_append(const SequenceId* ids, int64_t n, AppendTokens tokens, int64_t max_length,
                                 std::byte** tables, int64_t table_stride, int64_t* lengths) {
  std::lock_guard<std::mutex> lock(mu);
  // Pass 1: checks and the block count, changing nothing.
  blocks_for_append(ids, n, tokens, max_length);
  // Pass 2: cannot fail. What it changes is recorded in the sequence so end_append can undo it.
  const uint64_t pass = ++pass_stamp;  // counts this call's copies of each block so far
  for (int64_t i = 0; i < n; ++i) {
    Sequence& s = seqs.find(ids[i])->second;
    s.blocks_before = static_cast<int64_t>(s.blocks.size());
    s.cow_original = -1;
    const int32_t x = partial_block(s);
    const bool copies = x >= 0 && must_copy(x, earlier_in_pass(x, pass));
    if (copies) {
      count_in_pass(x, pass);
      const int64_t b = s.length / block_tokens;
      const int32_t copy = take_block();
      std::memcpy(block(copy), block(s.blocks[b]), block_bytes);
      // The sequence gives up its hold on the original but pins it until end_append, so that the original
      // cannot return to the pool (and be taken and written by another sequence) while the undo may still
      // hand it back: its other holders may be released in the meantime.
      s.cow_original = s.blocks[b];
      --refcount[s.blocks[b]];  // still held by others: it was shared
      ++pins[s.blocks[b]];
      s.blocks[b] = copy;
    }
    const int64_t want = table_size_after(s, tokens[i]);
    while (static_cast<int64_t>(s.blocks.size()) < want) s.blocks.push_back(take_block());
    s.busy = true;
    lengths[i] = s.length;
    for (int64_t b = 0; b < want; ++b) tables[i * table_stride + b] = block(s.blocks[b]);
  }
}

void KvCache::Impl::end_append(const SequenceId* ids, int64_t n, AppendTokens tokens, bool success) noexcept {
  std::lock_guard<std::mutex> lock(mu);
  for (int64_t i = 0; i < n; ++i) {
    auto it = seqs.find(ids[i]);
    if (it == seqs.end()) continue;
    Sequence& s = it->second;
    if (success) {
      s.length += tokens[i];
      if (s.cow_original >= 0) unpin(s.cow_original);  // the copy is ours for good: the original may go
    } else {
      // Undo begin_append: the new blocks go back, a copy-on-write copy gives way to the shared original
      // (which the failed call never wrote, which its pin kept out of the pool, and which no other call wrote
      // meanwhile: a pinned block counts as shared, must_copy), so the pool reads exactly as before the call.
      while (static_cast<int64_t>(s.blocks.size()) > s.blocks_before) {
        drop_block(s.blocks.back());
        s.blocks.pop_back();
      }
      if (s.cow_original >= 0) {
        int32_t& b = s.blocks[s.length / block_tokens];
        drop_block(b);
        b = s.cow_original;
        ++refcount[b];
        unpin(b);
      }
    }
    s.cow_original = -1;
    s.busy = false;
  }
}

KvCache::KvCache(const Config& config, const KvCacheOptions& options)
    : impl_(detail::translate_bad_alloc("KvCache", [&] { return std::make_unique<Impl>(config, options); })) {}
KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;

SequenceId KvCache::create() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return detail::translate_bad_alloc("KvCache::create", [&] {
    Impl::Sequence s;
    s.blocks.reserve(static_cast<size_t>(impl_->max_blocks_per_seq));
    const SequenceId id = impl_->next_id;
    impl_->seqs.emplace(id, std::move(s));  // may throw bad_alloc: nothing changed then
    ++impl_->next_id;
    return id;
  });
}

// The bookkeeping calls below build their error messages, and their copies of a table, inside translate_bad_alloc:
// a bad id met with an exhausted heap still reaches the caller as an Error.
namespace {

// fork() and fork(prefix): a new sequence holding the parent's first `prefix` tokens (all of them without one).
SequenceId fork_at(KvCache::Impl& impl, SequenceId parent, std::optional<int64_t> prefix) {
  std::lock_guard<std::mutex> lock(impl.mu);
  return detail::translate_bad_alloc("KvCache::fork", [&] {
    KvCache::Impl::Sequence& p = impl.find(parent);
    if (p.busy) invalid("KvCache::fork: sequence " + str(parent) + " is in use by another call");
    const int64_t length = prefix.value_or(p.length);
    if (length < 0 || length > p.length) {
      invalid("KvCache::fork: prefix_tokens " + str(length) + " of sequence " + str(parent) + ", which holds " +
              str(p.length) + " tokens (must be 0.." + str(p.length) + ")");
    }
    // Only the blocks holding the child's tokens are shared (a block reserved past the length stays the parent's);
    // a partly used last one is copied on the first append into it while the other still holds it (must_copy).
    const int64_t used = impl.blocks_for(length);
    KvCache::Impl::Sequence c;
    c.blocks.reserve(static_cast<size_t>(impl.max_blocks_per_seq));
    c.blocks.assign(p.blocks.begin(), p.blocks.begin() + used);
    c.length = length;
    const SequenceId id = impl.next_id;
    auto& child = impl.seqs.emplace(id, std::move(c)).first->second;  // may throw bad_alloc: nothing changed then
    ++impl.next_id;
    for (int32_t b : child.blocks) ++impl.refcount[b];
    return id;
  });
}

}  // namespace

SequenceId KvCache::fork(SequenceId parent) { return fork_at(*impl_, parent, std::nullopt); }

SequenceId KvCache::fork(SequenceId parent, int64_t prefix_tokens) { return fork_at(*impl_, parent, prefix_tokens); }

void KvCache::truncate(SequenceId seq, int64_t new_length) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::translate_bad_alloc("KvCache::truncate", [&] {
    Impl::Sequence& s = impl_->find(seq);
    if (s.busy) invalid("KvCache::truncate: sequence " + str(seq) + " is in use by another call");
    if (new_length < 0 || new_length > s.length) {
      invalid("KvCache::truncate: new_length " + str(new_length) + " for sequence " + str(seq) + ", which holds " +
              str(s.length) + " tokens (must be 0.." + str(s.length) + ")");
    }
    // The table keeps the blocks holding the first new_length tokens (a sequence holds no block past its length).
    // A kept block that another sequence shares is never written in place: the next append copies it (must_copy).
    const auto keep = static_cast<size_t>(impl_->blocks_for(new_length));
    for (size_t b = keep; b < s.blocks.size(); ++b) impl_->drop_block(s.blocks[b]);
    s.blocks.resize(keep);
    s.length = new_length;
  });
}

void KvCache::release(SequenceId seq) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::translate_bad_alloc("KvCache::release", [&] {
    Impl::Sequence& s = impl_->find(seq);
    if (s.busy) invalid("KvCache::release: sequence " + str(seq) + " is in use by another call");
    for (int32_t b : s.blocks) impl_->drop_block(b);
    impl_->seqs.erase(seq);
  });
}

bool KvCache::contains(SequenceId seq) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->seqs.count(seq) != 0;
}

int64_t KvCache::length(SequenceId seq) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return detail::translate_bad_alloc("KvCache::length", [&] { return impl_->find(seq).length; });
}

int64_t KvCache::blocks_needed(SequenceId seq, int64_t tokens) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return detail::translate_bad_alloc("KvCache::blocks_needed", [&] {
    if (tokens < 0) invalid("KvCache::blocks_needed: tokens must be >= 0, got " + str(tokens));
    const Impl::Sequence& s = impl_->find(seq);
    const int64_t context = impl_->cfg.context_length;  // tokens is compared before it is added: no overflow
    if (tokens > context - s.length) {
      invalid("KvCache::blocks_needed: sequence " + str(seq) + ": length " + str(s.length) + " + " + str(tokens) +
              " new tokens exceeds context_length=" + str(context));
    }
    const int32_t x = impl_->partial_block(s);
    return impl_->new_blocks(s, tokens) + (tokens > 0 && x >= 0 && impl_->must_copy(x, 0));
  });
}

int64_t KvCache::block_tokens() const { return impl_->block_tokens; }
int64_t KvCache::default_block_tokens(const Config& config) {
  return std::min<int64_t>(kernels::tiles::kKeyTile, config.context_length);
}
int64_t KvCache::total_blocks() const { return impl_->nblocks; }
int64_t KvCache::free_blocks() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->free_list.size());
}
int64_t KvCache::num_sequences() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->seqs.size());
}
size_t KvCache::block_bytes() const { return impl_->block_bytes; }
DType KvCache::dtype() const { return impl_->layout.dtype; }
size_t KvCache::capacity_bytes() const { return static_cast<size_t>(impl_->nblocks) * block_bytes(); }
const Config& KvCache::config() const { return impl_->cfg; }

void KvCache::Impl::store_row(std::byte* b, kernels::KvPart part, int64_t h, int64_t slot, const float* src) const {
  kernels::store_kv_row(layout, b, part, h, slot, src);
}

void KvCache::Impl::load_row(const std::byte* b, kernels::KvPart part, int64_t h, int64_t slot, float* dst) const {
  kernels::load_kv_row(layout, b, part, h, slot, dst);
}

int32_t KvCache::Impl::block_of(SequenceId seq, int64_t t) const {
  std::lock_guard<std::mutex> lock(mu);
  return block_holding(find(seq), t);
}

namespace {
void read_row(const KvCache::Impl& c, SequenceId seq, int64_t h, int64_t t, float* dst, kernels::KvPart part) {
  std::lock_guard<std::mutex> lock(c.mu);
  detail::translate_bad_alloc("KvCache::read_key/read_value", [&] {
    const KvCache::Impl::Sequence& s = c.find(seq);
    if (h < 0 || h >= c.layout.heads) {
      invalid("KvCache: head " + str(h) + " out of range [0, " + str(c.layout.heads) + ")");
    }
    const int32_t b = c.block_holding(s, t);
    if (!dst) invalid("KvCache: dst is a null pointer");
    c.load_row(c.block(b), part, h, t % c.block_tokens, dst);
  });
}
}  // namespace

void KvCache::read_key(SequenceId seq, int64_t h, int64_t t, float* dst) const {
  read_row(*impl_, seq, h, t, dst, kernels::KvPart::key);
}
void KvCache::read_value(SequenceId seq, int64_t h, int64_t t, float* dst) const {
  read_row(*impl_, seq, h, t, dst, kernels::KvPart::value);
}

std::string KvCache::Impl::audit() const {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<int32_t> held(static_cast<size_t>(nblocks), 0), freed(static_cast<size_t>(nblocks), 0);
  for (const auto& [id, s] : seqs) {
    if (static_cast<int64_t>(s.blocks.size()) < table_size_after(s, 0)) {
      return "sequence " + str(id) + " holds " + str(static_cast<int64_t>(s.blocks.size())) + " blocks for " +
             str(s.length) + " tokens";
    }
    for (int32_t b : s.blocks) {
      if (b < 0 || b >= nblocks) return "sequence " + str(id) + " names block " + str(b) + " outside the pool";
      ++held[b];
    }
  }
  for (int32_t b : free_list) {
    if (b < 0 || b >= nblocks) return "free list names block " + str(b) + " outside the pool";
    if (freed[b]++) return "block " + str(b) + " is on the free list twice";
  }
  for (int64_t b = 0; b < nblocks; ++b) {
    if (held[b] != refcount[b]) {
      return "block " + str(b) + " has refcount " + str(refcount[b]) + " but " + str(held[b]) + " table entries";
    }
    if (pins[b] < 0) return "block " + str(b) + " has a negative pin count";
    const bool in_use = refcount[b] > 0 || pins[b] > 0;
    if (in_use == (freed[b] != 0)) {
      return "block " + str(b) + (in_use ? " is held or pinned and on the free list" : " is neither held nor free");
    }
  }
  return "";
}

}  // namespace gpt2attn
