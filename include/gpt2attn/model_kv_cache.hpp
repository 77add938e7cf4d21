// gpt2attn/model_kv_cache.hpp: one KV cache for a whole model: a KvCache pool per attention layer behind one
// SequenceId per sequence, so a server creates, forks, truncates and releases a sequence once, not once per layer.
// It computes nothing and does not run layers: the model runner calls each layer with layer(l) and layer_ids().
// Part of the model library (gpt2attn::model).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpt2attn/config.hpp"
#include "gpt2attn/dtype.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/kv_cache.hpp"

namespace gpt2attn {

// Why a thin owner of L KvCaches rather than a multi-layer mode inside KvCache: the layer API
// (CausalSelfAttention::extend / decode / step over one KvCache) stays as it is, and each pool stays one contiguous
// allocation with its own lock, so the layers of concurrent steps never contend on one mutex. The cost is
// bookkeeping: per structure call (create, fork, truncate, release) L pool operations under L mutexes instead of one,
// and a map from the model's id to the L layer ids. A pool assigns its ids from a counter that advances only on
// success, so after one pool refused a create or fork (undone in the others) the layers' ids differ: the map is the
// only truth, layer ids are never assumed equal.
//
// Measured cost per decode step, B = 16 sequences, L = 48 layers (gpt2-xl's depth): layer_ids() plus
// blocks_needed(batch) take 15-30 us, layer_ids() alone 0.5-0.8 us (blocks_needed asks every pool about every
// sequence: 768 locked look-ups). On the same machine one gpt2-small attention layer's decode step (B = 16, 128
// cached tokens, 2 threads) takes 0.64 ms, so 48 layers' attention alone take about 30 ms: the bookkeeping is about
// 0.1% of the step it serves, as it is at 12 layers (a quarter of the look-ups, a quarter of the attention).
// Measured with ModelKvCacheCost.BookkeepingPerDecodeStep (tests/model/test_model_kv_cache.cpp: one thread, -O2,
// median of 2000 steps) on an "Intel(R) Xeon(R) Processor" with 2 cores shared with other work (the range is
// their load), 2026-11.
//
// Lengths. The layers' appends bypass this object (they run through layer(l)), so a model step that fails after
// layers 0..k-1 appended leaves the layers' lengths apart. length() is then the minimum, the tokens every layer
// holds, and truncate(seq, n) accepts 0 <= n <= length(seq) and cuts every longer layer to n: a runner repairs a
// failed step with truncate(seq, the length before the step), or truncate(seq, length(seq)). Until repaired, the
// sequence must not be stepped again or forked (fork copies each layer as it stands).
//
// Thread safety: every method may be called from any thread; one mutex serialises the structure calls and id
// look-ups (the layers' own calls take only their pool's lock). As with KvCache, a sequence must not be used by
// a structure call while a layer call runs on it; a pool refuses that (invalid_argument, "in use"), and if it
// refuses after earlier layers acted on a truncate or release, those layers stay done and the sequence stays
// known: repeating the call once the other has ended completes it. Every other failed call changes nothing.
class GPT2ATTN_API ModelKvCache {
 public:
  // `layers` pools (layers >= 1, else invalid_argument naming it), each built from layer_config and options as
  // KvCache takes them, with capacity_tokens the tokens EACH layer holds but capacity_bytes the total over all
  // layers: each layer gets capacity_bytes / layers, rounded down to whole blocks (a share below one block is
  // refused naming capacity_bytes). Every pool is allocated now (Error out_of_memory if one cannot be; nothing
  // stays allocated then). Identical options give identical pools, so the same sequence operations keep the
  // layers' block counts equal.
  ModelKvCache(const Config& layer_config, int64_t layers, const KvCacheOptions& options);
  ~ModelKvCache();
  ModelKvCache(ModelKvCache&&) noexcept;
  ModelKvCache& operator=(ModelKvCache&&) noexcept;

  int64_t layers() const;
  KvCache& layer(int64_t l);  // layer l's pool, 0 <= l < layers() (else invalid_argument); its ids via layer_ids()
  const KvCache& layer(int64_t l) const;

  // Layer ids for a batch, one look-up under the lock for all layers: out[l * n + i] = layer l's id of seqs[i], so
  // layer l's call takes out + l * n. invalid_argument naming the first unknown id (out untouched then).
  void layer_ids(const SequenceId* seqs, int64_t n, SequenceId* out) const;

  // As KvCache's, on every layer. create() and fork() are all or nothing: if a layer refuses, the sequences made in
  // the layers before it are released and the error (naming the layer) is rethrown.
  SequenceId create();
  SequenceId fork(SequenceId parent);
  SequenceId fork(SequenceId parent, int64_t prefix_tokens);  // 0 <= prefix_tokens <= length(parent)
  void truncate(SequenceId seq, int64_t new_length);          // 0 <= new_length <= length(seq); see Lengths above
  void release(SequenceId seq);
  bool contains(SequenceId seq) const;
  int64_t length(SequenceId seq) const;  // tokens every layer holds (the minimum over layers)

  // Blocks an append of `tokens` to `seq` takes from each layer's pool: the same in every layer while their lengths
  // agree; the maximum over layers otherwise. Errors as KvCache::blocks_needed.
  int64_t blocks_needed(SequenceId seq, int64_t tokens) const;
  // What a model step of n entries (distinct sequences, tokens[i] >= 0 new tokens each) takes from each pool: the sum
  // of each entry's blocks_needed. Exact, except that two entries sharing a partly filled block (forks) count a copy
  // each where the step copies it once: an upper bound then, safe for admission. invalid_argument for n < 0, a null
  // pointer with n > 0, or a sequence given twice.
  int64_t blocks_needed(const SequenceId* seqs, const int64_t* tokens, int64_t n) const;

  int64_t free_blocks() const;  // per layer: the minimum over layers (what a step can count on in every pool)
  int64_t total_blocks() const;  // per layer
  int64_t block_tokens() const;
  size_t block_bytes() const;     // per layer's block
  size_t capacity_bytes() const;  // all layers together
  DType dtype() const;
  const Config& config() const;   // the layers' config
  int64_t num_sequences() const;

  struct GPT2ATTN_LOCAL Impl;  // model/model_kv_cache.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpt2attn
