// gpt2attn/parallel.hpp: tensor parallel over MPI, Megatron's split of attention. Each rank of a communicator owns a
// contiguous run of K/V heads and their query heads: the matching rows of W_q, W_k, W_v, the matching columns of W_o,
// and those heads' K/V cache. A rank computes its heads alone; one MPI_Allreduce sums the partial outputs. The same
// program serves one process, N processes on one machine, or N machines.
//
// An optional module (libgpt2attn_mpi.so, CMake target gpt2attn::mpi of find_package(gpt2attn COMPONENTS mpi); built
// when MPI is found) over the single-process library: nothing in the engine knows about MPI. The library never calls
// MPI_Init or MPI_Finalize; the caller owns MPI and `comm`.
//
// Collective calls. Every method marked (collective) must be called by every rank of the communicator, in the same
// order, with the same arguments (each rank passes its own copy of x, seqs, masks: they must hold the same values).
// Each such call first checks its inputs on every rank and agrees the verdict across ranks with one small
// all-reduce, which also compares a hash of the arguments: a bad input on any rank, or ranks whose inputs differ,
// gives every rank the same Error ("call: rank r: " and the first failing rank's message, or the first rank whose
// arguments differ from rank 0's), and no rank waits in a collective the others never reach. The constructors'
// hash covers the config, the compute type (not the instruction set, which may differ from node to node), the
// seed of random(), and the weights' dtypes, shapes and every value of every tensor in logical order (WeightCheck:
// ranks given weights that differ in any byte any rank uses are refused; each rank so reads the whole layer once,
// at construction). Only then is anything computed or written; forward, extend and decode end
// with one MPI_Allreduce of the (B, T, E) output, which also carries each rank's success, so an error while
// computing (out of memory) is reported on every rank too. Calls on one ShardedAttention are serialised; MPI is
// called only from the calling thread (MPI_THREAD_FUNNELED suffices when that is the thread that initialised MPI,
// MPI_THREAD_SERIALIZED otherwise).
//
// Failure. The library's private communicator (a duplicate of `comm`) returns errors instead of aborting
// (MPI_ERRORS_RETURN): an MPI error becomes Error(internal) naming the MPI call. A rank that dies cannot be detected
// from inside MPI 3.1 (Open MPI 4.1 has no ULFM): under mpirun the runtime ends every other rank when one exits
// abnormally, so the survivors end with mpirun's error rather than hang.
//
// Deadlines. A rank that stops without exiting (SIGSTOP, a deadlock in the caller) would hang the others in their
// next collective. So every collective of this module waits with a deadline: it is posted nonblocking and polled,
// spinning briefly and then sleeping between polls (a waiting rank uses little CPU), and a rank whose wait inside one
// collective passes `deadline_s` seconds throws CollectiveTimeout, naming itself, the library call and the
// collective. MPI cannot cancel a collective, so after that the communicator is unusable, and every later collective
// of this module in the process is refused: the embedding program must end the job with MPI_Abort (which ends every
// rank, the stopped one included), as `gpt2attn` does. The deadline bounds one wait, which starts when this rank
// enters the collective: it must cover the longest local work of one call on the slowest rank (the skew between
// ranks), not the whole call. The default, kCollectiveDeadlineS, and its measurement: docs/mpi.md.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {

class ShardedKvCache;

// The default deadline of one wait inside a collective, in seconds: 12x the slowest single call measured, 51 s (the
// largest preset, gpt3-175b, prefill of T = 2048 on one thread per rank; docs/mpi.md).
inline constexpr double kCollectiveDeadlineS = 600;

// Thrown by a rank whose wait inside a collective passed its deadline (code internal: no other rank answered, which
// no argument of the call explains). The communicator is unusable after it: end the job with MPI_Abort.
class GPT2ATTN_API CollectiveTimeout : public Error {
 public:
  CollectiveTimeout(const std::string& what, int rank, double deadline_s)
      : Error(ErrorCode::internal, what), rank_(rank), deadline_s_(deadline_s) {}
  int rank() const noexcept { return rank_; }  // the rank that gave up waiting, in the call's communicator
  double deadline_s() const noexcept { return deadline_s_; }

 private:
  int rank_;
  double deadline_s_;
};

// Seconds the last forward/extend/decode of a rank spent: before the all-reduce (checks and this rank's heads) and
// in it (which includes waiting for the slowest rank).
struct ShardedCallTimes {
  double compute_s = 0, allreduce_s = 0;
};

// What the constructors from weights compare across ranks, beside the config, dtypes and shapes.
enum class WeightCheck : uint8_t {
  full,     // every value of every tensor: weights that differ in any byte on any rank are refused (the default)
  sampled,  // 64 rows of each matrix spread over it, and each bias: for callers who guarantee identical files and
            // would rather each rank read only its own slices (a safetensors file's other pages stay unread)
};

class GPT2ATTN_API ShardedAttention {
 public:
  // (collective) From the whole layer's weights in each rank's memory: each rank copies its slices. Heads are split
  // by K/V head, as evenly as possible, the first ranks one more (gpt2-xl's 25 heads on 2 ranks: 13 + 12); a
  // communicator with more ranks than K/V heads is refused. A causal self-attention config also serves a KV cache.
  // `deadline_s` bounds every wait inside a collective of this layer and of the caches built for it, construction
  // included (Deadlines, above): above 0, +infinity for none; NaN or <= 0 is refused.
  ShardedAttention(const Config& config, const WeightsView& weights, MPI_Comm comm, const EngineOptions& options = {},
                   WeightCheck check = WeightCheck::full, double deadline_s = kCollectiveDeadlineS);
  // (collective) From one layer of a safetensors file (open_safetensors_layer's namings and dtypes) that every rank
  // can read: each rank maps the file and copies only its slices (a rank of N holds about 1/N of the layer, never
  // the whole file); WeightCheck::full reads the layer's other pages once, to hash them. `config` is completed from
  // the file as apply_loaded_shapes does.
  ShardedAttention(const Config& config, const std::string& safetensors_path, const std::string& prefix,
                   MPI_Comm comm, const EngineOptions& options = {}, WeightCheck check = WeightCheck::full,
                   double deadline_s = kCollectiveDeadlineS);
  // (collective) Weights::random(config, seed)'s values, each rank generating only its slices.
  static ShardedAttention random(const Config& config, uint64_t seed, MPI_Comm comm,
                                 const EngineOptions& options = {}, double deadline_s = kCollectiveDeadlineS);
  ~ShardedAttention();
  ShardedAttention(ShardedAttention&&) noexcept;
  ShardedAttention& operator=(ShardedAttention&&) noexcept;

  // (collective) MultiHeadAttention::forward's semantics and shapes: out (B, T, E) f32, the whole layer's output on
  // every rank. Masks as the single-process layer takes them (a (B, H, T, Tk) mask has all H heads).
  void forward(const AttentionInputs& in, float* out, const RunOptions& run = {});
  // (collective) CausalSelfAttention's serving calls on a sharded cache built for this layer.
  void extend(ShardedKvCache& cache, SequenceId seq, const float* x, int64_t T, float* out, const RunOptions& run = {});
  void decode(ShardedKvCache& cache, const SequenceId* seqs, int64_t B, const float* x, float* out,
              const RunOptions& run = {});
  void step(ShardedKvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n, const float* x,
            float* out, const RunOptions& run = {});

  const Config& config() const;  // the whole layer's (what every rank agreed on)
  int rank() const;
  int ranks() const;
  int64_t first_head() const;  // this rank's query heads: [first_head, first_head + heads)
  int64_t heads() const;
  int64_t first_kv_head() const;  // and K/V heads
  int64_t kv_heads() const;
  Isa isa() const;
  std::string implementation() const;  // names this rank and its heads, so it differs between ranks
  ShardedCallTimes last_call_times() const;
  double deadline_s() const;  // as constructed

  struct GPT2ATTN_LOCAL Impl;  // engine/mpi/sharded.cpp

 private:
  explicit ShardedAttention(std::unique_ptr<Impl> impl);
  friend class ShardedKvCache;
  std::unique_ptr<Impl> impl_;
};

// A KV cache sharded like its layer: each rank's pool holds its own K/V heads of every sequence. Sequences are kept
// in step by making create, fork and release collective: every rank performs the same operation on its pool and
// gets the same id (ids are assigned in order, never reused), and the agreement step refuses a call whose
// arguments differ between ranks. Appends happen only through the layer's collective extend/decode, so lengths and
// block tables agree on every rank.
class GPT2ATTN_API ShardedKvCache {
 public:
  // (collective) For a causal self-attention layer (config.causal, kdim = vdim = d_in), as a KvCache serves only
  // CausalSelfAttention; another is refused. capacity_tokens as given; capacity_bytes is per rank, and every rank's pool then holds the tokens
  // the smallest rank's bytes hold (ranks with more heads need more bytes per token). Its collectives wait at most
  // the layer's deadline_s().
  ShardedKvCache(const ShardedAttention& layer, const KvCacheOptions& options);
  ~ShardedKvCache();
  ShardedKvCache(ShardedKvCache&&) noexcept;
  ShardedKvCache& operator=(ShardedKvCache&&) noexcept;

  SequenceId create();                 // (collective)
  SequenceId fork(SequenceId parent);  // (collective)
  // KvCache::fork(parent, prefix_tokens) and KvCache::truncate on every rank (collective; the length is agreed with
  // the other arguments, so ranks given different lengths are refused on every rank).
  SequenceId fork(SequenceId parent, int64_t prefix_tokens);
  void truncate(SequenceId seq, int64_t new_length);
  void release(SequenceId seq);        // (collective)

  bool contains(SequenceId seq) const;  // local: the same on every rank
  int64_t length(SequenceId seq) const;
  int64_t free_blocks() const;
  int64_t total_blocks() const;
  KvCache& local();  // this rank's pool: its K/V heads only
  const KvCache& local() const;

  struct GPT2ATTN_LOCAL Impl;  // engine/mpi/sharded.cpp

 private:
  friend class ShardedAttention;
  std::unique_ptr<Impl> impl_;
};

// (collective) Runs `step` on every rank and agrees on its outcome as the calls above do: when it throws on any rank,
// every rank throws the same Error ("what: rank r: message"). For a caller's own work before a collective call
// (reading its inputs), so that one rank's missing file gives every rank the error instead of leaving the others
// waiting in the next call. Its one all-reduce waits at most `deadline_s` (as the constructors' does); as a barrier
// with a deadline, pass a step that does nothing.
GPT2ATTN_API void run_agreed(MPI_Comm comm, const char* what, const std::function<void()>& step,
                             double deadline_s = kCollectiveDeadlineS);

}  // namespace gpt2attn
