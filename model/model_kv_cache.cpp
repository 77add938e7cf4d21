// model/model_kv_cache.cpp: ModelKvCache, the per-layer KvCache pools behind one id per sequence: the id map and
// the all-or-nothing structure calls across layers. It never touches K/V; the layers' calls do, through layer(l).
#include "gpt2attn/model_kv_cache.hpp"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpt2attn/error.hpp"

namespace gpt2attn {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// The engine turns std::bad_alloc into Error(out_of_memory) at its boundary; this library does the same at its own.
template <class F>
auto translate_bad_alloc(const char* call, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    fail(ErrorCode::out_of_memory, std::string(call) + ": out of memory");
  }
}

// A layer's refusal, retold with the model's call, sequence and layer: its own message names the layer's id only.
[[noreturn]] void rethrow_for_layer(const Error& e, const std::string& where, int64_t l) {
  fail(e.code(), where + ": layer " + str(l) + ": " + e.what());
}

std::string of(const char* call, SequenceId seq) { return std::string(call) + " of sequence " + str(seq); }

}  // namespace

struct ModelKvCache::Impl {
  std::vector<KvCache> pools;  // one per layer, built with the same options
  mutable std::mutex mu;       // guards ids and next_id, and serialises the structure calls
  // The model's id -> the L layer ids, in layer order. Never assume layer ids equal the model's or each other.
  std::unordered_map<SequenceId, std::vector<SequenceId>> ids;
  SequenceId next_id = 0;  // advances only on success, never reused

  int64_t layers() const { return static_cast<int64_t>(pools.size()); }

  const std::vector<SequenceId>& find(SequenceId seq, const char* call) const {
    auto it = ids.find(seq);
    if (it == ids.end()) {
      invalid(std::string(call) + ": unknown sequence id " + str(seq) + " (never created, or released)");
    }
    return it->second;
  }

  // The tokens every layer holds: layers differ only after a failed model step (see the header's Lengths).
  int64_t min_length(const std::vector<SequenceId>& lids, const char* call, SequenceId seq) const {
    int64_t n = INT64_MAX;
    for (int64_t l = 0; l < layers(); ++l) {
      try {
        n = std::min(n, pools[l].length(lids[l]));
      } catch (const Error& e) {  // only if a layer's id was released behind our back, through layer(l)
        rethrow_for_layer(e, of(call, seq), l);
      }
    }
    return n;
  }

  // A new model sequence whose layer l id is make(l). If a layer throws, the ids made before it are released, so
  // no pool holds a sequence the map does not know; the layers' counters have moved, which the map absorbs.
  template <class Make>
  SequenceId add(const std::string& where, Make&& make) {
    // The map entry first: inserting it is the one step that allocates, and it is done before any pool changes.
    auto& lids = translate_bad_alloc(where.c_str(), [&]() -> std::vector<SequenceId>& {
      std::vector<SequenceId> v(pools.size(), -1);
      return ids.emplace(next_id, std::move(v)).first->second;
    });
    int64_t l = 0;
    try {
      for (; l < layers(); ++l) lids[l] = make(l);
    } catch (const Error& e) {
      undo_add(l);
      rethrow_for_layer(e, where, l);
    } catch (const std::bad_alloc&) {  // KvCache translates its own; defensive only
      undo_add(l);
      fail(ErrorCode::out_of_memory, where + ": layer " + str(l) + ": out of memory");
    }
    return next_id++;
  }

  void undo_add(int64_t made) noexcept {
    std::vector<SequenceId>& lids = ids.find(next_id)->second;
    for (int64_t l = 0; l < made; ++l) {
      // A sequence made a moment ago under our lock: no call can hold it, so its release cannot be refused.
      try {
        pools[l].release(lids[l]);
      } catch (...) {
      }
    }
    ids.erase(next_id);
  }
};

ModelKvCache::ModelKvCache(const Config& layer_config, int64_t layers, const KvCacheOptions& options) {
  // Far past any GPT (GPT-3 175B has 96 layers); it keeps a pool vector's size an ordinary allocation's question.
  constexpr int64_t kMaxLayers = int64_t{1} << 16;
  if (layers < 1 || layers > kMaxLayers) {
    invalid("ModelKvCache: layers must be 1.." + str(kMaxLayers) + ", got " + str(layers));
  }
  KvCacheOptions each = options;
  const bool split = options.capacity_bytes > 0 && options.capacity_tokens == 0;  // both set: KvCache refuses
  if (split) each.capacity_bytes = options.capacity_bytes / static_cast<size_t>(layers);
  // Is the share below one block? A one-block pool of the same options tells (and throws itself if something else
  // is wrong with them). Only a failure pays for it: the block size is the engine's to compute.
  const auto refuse_small_share = [&] {
    KvCacheOptions probe = options;
    probe.capacity_bytes = 0;
    probe.capacity_tokens = 1;
    const size_t block = KvCache(layer_config, probe).block_bytes();
    if (each.capacity_bytes >= block) return;
    invalid("ModelKvCache: KvCacheOptions.capacity_bytes=" + std::to_string(options.capacity_bytes) + " over " +
            str(layers) + " layers gives each " + std::to_string(each.capacity_bytes) +
            " bytes, less than one block (" + std::to_string(block) + " bytes; at least " +
            std::to_string(block * static_cast<size_t>(layers)) + " in all)");
  };
  // A share of 0 would read as "capacity unset" to KvCache, which would name the wrong cause.
  if (split && each.capacity_bytes == 0) refuse_small_share();
  impl_ = translate_bad_alloc("ModelKvCache", [] { return std::make_unique<Impl>(); });
  translate_bad_alloc("ModelKvCache", [&] { impl_->pools.reserve(static_cast<size_t>(layers)); });
  try {
    impl_->pools.emplace_back(layer_config, each);
  } catch (const Error& e) {
    if (split && e.code() == ErrorCode::invalid_argument) refuse_small_share();
    throw;
  }
  // A failure here destroys the pools made so far with impl_: nothing stays allocated.
  for (int64_t l = 1; l < layers; ++l) impl_->pools.emplace_back(layer_config, each);
}

ModelKvCache::~ModelKvCache() = default;
ModelKvCache::ModelKvCache(ModelKvCache&&) noexcept = default;
ModelKvCache& ModelKvCache::operator=(ModelKvCache&&) noexcept = default;

int64_t ModelKvCache::layers() const { return impl_->layers(); }

KvCache& ModelKvCache::layer(int64_t l) {
  return const_cast<KvCache&>(static_cast<const ModelKvCache&>(*this).layer(l));
}

const KvCache& ModelKvCache::layer(int64_t l) const {
  if (l < 0 || l >= impl_->layers()) {
    invalid("ModelKvCache::layer: l=" + str(l) + " out of range [0, " + str(impl_->layers()) + ")");
  }
  return impl_->pools[static_cast<size_t>(l)];
}

void ModelKvCache::layer_ids(const SequenceId* seqs, int64_t n, SequenceId* out) const {
  if (n < 0) invalid("ModelKvCache::layer_ids: n must be >= 0, got " + str(n));
  if (n > 0 && (!seqs || !out)) invalid("ModelKvCache::layer_ids: seqs or out is a null pointer");
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (int64_t i = 0; i < n; ++i) impl_->find(seqs[i], "ModelKvCache::layer_ids");  // all checked before out
  const int64_t L = impl_->layers();
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<SequenceId>& lids = impl_->ids.find(seqs[i])->second;
    for (int64_t l = 0; l < L; ++l) out[l * n + i] = lids[l];
  }
}

SequenceId ModelKvCache::create() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->add("ModelKvCache::create", [&](int64_t l) { return impl_->pools[l].create(); });
}

SequenceId ModelKvCache::fork(SequenceId parent) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  // A reference stays valid when add() inserts the child: unordered_map never moves its elements.
  const std::vector<SequenceId>& p = impl_->find(parent, "ModelKvCache::fork");
  return impl_->add(of("ModelKvCache::fork", parent), [&](int64_t l) { return impl_->pools[l].fork(p[l]); });
}

SequenceId ModelKvCache::fork(SequenceId parent, int64_t prefix_tokens) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::vector<SequenceId>& p = impl_->find(parent, "ModelKvCache::fork");
  // Checked against every layer before any forks, so a bad prefix is named in the model's terms.
  const int64_t length = impl_->min_length(p, "ModelKvCache::fork", parent);
  if (prefix_tokens < 0 || prefix_tokens > length) {
    invalid("ModelKvCache::fork: prefix_tokens " + str(prefix_tokens) + " of sequence " + str(parent) +
            ", which holds " + str(length) + " tokens (must be 0.." + str(length) + ")");
  }
  return impl_->add(of("ModelKvCache::fork", parent),
                    [&](int64_t l) { return impl_->pools[l].fork(p[l], prefix_tokens); });
}

void ModelKvCache::truncate(SequenceId seq, int64_t new_length) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::vector<SequenceId>& lids = impl_->find(seq, "ModelKvCache::truncate");
  const int64_t length = impl_->min_length(lids, "ModelKvCache::truncate", seq);
  if (new_length < 0 || new_length > length) {
    invalid("ModelKvCache::truncate: new_length " + str(new_length) + " for sequence " + str(seq) +
            ", which holds " + str(length) + " tokens in every layer (must be 0.." + str(length) + ")");
  }
  // Only the longer layers are cut: a layer already at new_length is left alone, so a repair after a step that
  // failed at layer k touches only layers 0..k-1.
  for (int64_t l = 0; l < impl_->layers(); ++l) {
    try {
      if (impl_->pools[l].length(lids[l]) > new_length) impl_->pools[l].truncate(lids[l], new_length);
    } catch (const Error& e) {
      rethrow_for_layer(e, of("ModelKvCache::truncate", seq), l);  // a layer call running on it: see the header
    }
  }
}

void ModelKvCache::release(SequenceId seq) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::vector<SequenceId>& lids = impl_->find(seq, "ModelKvCache::release");
  // A layer that no longer holds it was released by an earlier release that a layer refused (see the header):
  // the repeat finishes the rest. Only this object releases layer ids, so contains() is not racing anyone.
  for (int64_t l = 0; l < impl_->layers(); ++l) {
    try {
      if (impl_->pools[l].contains(lids[l])) impl_->pools[l].release(lids[l]);
    } catch (const Error& e) {
      rethrow_for_layer(e, of("ModelKvCache::release", seq), l);
    }
  }
  impl_->ids.erase(seq);
}

bool ModelKvCache::contains(SequenceId seq) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->ids.count(seq) != 0;
}

int64_t ModelKvCache::length(SequenceId seq) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->min_length(impl_->find(seq, "ModelKvCache::length"), "ModelKvCache::length", seq);
}

int64_t ModelKvCache::blocks_needed(SequenceId seq, int64_t tokens) const {
  return blocks_needed(&seq, &tokens, 1);
}

int64_t ModelKvCache::blocks_needed(const SequenceId* seqs, const int64_t* tokens, int64_t n) const {
  const char* call = "ModelKvCache::blocks_needed";
  if (n < 0) invalid(std::string(call) + ": n must be >= 0, got " + str(n));
  if (n > 0 && (!seqs || !tokens)) invalid(std::string(call) + ": seqs or tokens is a null pointer");
  // A step's batch is tens of sequences: the quadratic scan costs less than a set would allocate.
  for (int64_t i = 1; i < n; ++i) {
    const int64_t j = std::find(seqs, seqs + i, seqs[i]) - seqs;
    if (j < i) invalid(std::string(call) + ": sequence " + str(seqs[i]) + " appears twice (at " + str(j) + " and " +
                       str(i) + ")");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0) invalid(std::string(call) + ": tokens[" + str(i) + "] must be >= 0, got " + str(tokens[i]));
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (int64_t i = 0; i < n; ++i) impl_->find(seqs[i], call);
  int64_t most = 0;
  for (int64_t l = 0; l < impl_->layers(); ++l) {
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      try {
        sum += impl_->pools[l].blocks_needed(impl_->ids.find(seqs[i])->second[l], tokens[i]);
      } catch (const Error& e) {
        rethrow_for_layer(e, of(call, seqs[i]), l);
      }
    }
    most = std::max(most, sum);
  }
  return most;
}

int64_t ModelKvCache::free_blocks() const {
  int64_t n = INT64_MAX;
  for (const KvCache& p : impl_->pools) n = std::min(n, p.free_blocks());
  return n;
}

int64_t ModelKvCache::total_blocks() const { return impl_->pools[0].total_blocks(); }
int64_t ModelKvCache::block_tokens() const { return impl_->pools[0].block_tokens(); }
size_t ModelKvCache::block_bytes() const { return impl_->pools[0].block_bytes(); }

size_t ModelKvCache::capacity_bytes() const {
  size_t n = 0;
  for (const KvCache& p : impl_->pools) n += p.capacity_bytes();
  return n;
}

DType ModelKvCache::dtype() const { return impl_->pools[0].dtype(); }
const Config& ModelKvCache::config() const { return impl_->pools[0].config(); }

int64_t ModelKvCache::num_sequences() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->ids.size());
}

}  // namespace gpt2attn
