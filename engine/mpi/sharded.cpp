// engine/mpi/sharded.cpp: tensor parallel over MPI (include/gpt2attn/parallel.hpp). Each rank runs an ordinary layer
// over its heads (engine/shard.hpp) and its own KV pool; this file adds only what crosses ranks: the agreement before
// every collective call, the one all-reduce of the outputs, and keeping the sharded pool's sequences in step.
// Nothing here computes attention.
#include "gpt2attn/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/convert.hpp"
#include "engine/io/safetensors.hpp"
#include "engine/io/weights_io.hpp"
#include "engine/kv_cache.hpp"
#include "engine/layer.hpp"
#include "engine/shard.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "engine/weights_check.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {
namespace {

using detail::str;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// An MPI call's failure as Error(internal) naming the call (the library's communicators return errors).
void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(ErrorCode::internal, std::string("tensor parallel: ") + call + " failed: " + std::string(text, len));
}

// A 64-bit fingerprint of a call's arguments, compared across ranks: equal inputs hash equal; unequal inputs are told
// apart with overwhelming probability (FNV-1a over 8-byte words with a final avalanche; not a defence against a
// rank that forges inputs, which MPI programs trust anyway).
class Fingerprint {
 public:
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      mix(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, b + i, n - i);
    mix(tail ^ (static_cast<uint64_t>(n) << 56));
  }
  template <class T>
  void value(const T& v) {
    bytes(&v, sizeof v);
  }
  // The view's dtype, shape and values in logical order (its strides do not matter, only what it holds).
  void view(const TensorView& v) {
    value(v.dtype);
    value(v.rank);
    for (int d = 0; d < v.rank; ++d) value(v.shape[d]);
    if (v.empty() || v.numel() == 0) return;
    const int64_t es = static_cast<int64_t>(size_of(v.dtype)), last = v.rank - 1;
    const int64_t n = v.shape[last], outer = v.numel() / n;
    for (int64_t o = 0; o < outer; ++o) {
      int64_t off = 0, rest = o;
      for (int d = last - 1; d >= 0; --d) {
        off += (rest % v.shape[d]) * v.strides[d];
        rest /= v.shape[d];
      }
      const auto* row = static_cast<const std::byte*>(v.data) + off * es;
      if (v.strides[last] == 1) {
        bytes(row, static_cast<size_t>(n * es));
      } else {
        for (int64_t j = 0; j < n; ++j) bytes(row + j * v.strides[last] * es, static_cast<size_t>(es));
      }
    }
  }
  uint64_t digest() const {
    uint64_t x = h_ ^ (h_ >> 33);
    x *= 0xff51afd7ed558ccdULL;
    return x ^ (x >> 33);
  }

 private:
  void mix(uint64_t w) { h_ = (h_ ^ w) * 0x100000001b3ULL; }
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

// A layer's weights as ranks compare them at construction: every tensor's dtype and shape, and its values: all of
// them (WeightCheck::full), or up to kSampleRows rows of each matrix spread over it and all of a bias (sampled).
// Ranks that build one layer from weights each holds (or maps) must hold the same weights: each rank uses its own
// copy of its slices, so two files that differ where only one rank reads would give a sum of two layers.
void fingerprint_weights(Fingerprint& f, const WeightsView& w, WeightCheck check) {
  constexpr int64_t kSampleRows = 64;
  f.value(check);
  for (const TensorView* t : {&w.w_q, &w.w_k, &w.w_v, &w.w_o, &w.b_q, &w.b_k, &w.b_v, &w.b_o}) {
    if (check == WeightCheck::full || t->rank != 2 || t->shape[0] <= kSampleRows) {
      f.view(*t);
      continue;
    }
    f.value(t->dtype);
    f.value(t->shape[0]);
    f.value(t->shape[1]);
    const int64_t rows = t->shape[0];
    for (int64_t i = 0; i < kSampleRows; ++i) f.view(detail::slice(*t, 0, i * (rows - 1) / (kSampleRows - 1), 1));
  }
}

// What one rank says in an agreement: whether its checks failed (and how), a fingerprint of its arguments that every
// rank must share, and a value whose minimum over the ranks every rank learns (0 when unused).
struct Verdict {
  bool failed = false;
  ErrorCode code = ErrorCode::internal;
  std::string message;
  uint64_t fingerprint = 0;
  uint64_t min_value = std::numeric_limits<uint64_t>::max();
};

// A failed verdict's code and message. Copying the message may itself need memory; where the heap has none, the
// verdict says "out of memory", which fits std::string's in-place buffer: so local_verdict cannot throw, and a rank
// short of memory still reaches the agreement that the others wait in.
void set_failure(Verdict& v, ErrorCode code, const char* what) noexcept {
  v.failed = true, v.code = code;
  try {
    v.message = what;
  } catch (const std::bad_alloc&) {
    v.code = ErrorCode::out_of_memory, v.message = "out of memory";
  }
}

// Runs f(verdict), which checks this rank's inputs (throwing as the library does) and fills the fingerprint and the
// value to minimise, as a verdict.
template <class F>
Verdict local_verdict(F&& f) {
  Verdict v;
  try {
    f(v);
  } catch (const Error& e) {
    set_failure(v, e.code(), e.what());
  } catch (const std::bad_alloc&) {
    set_failure(v, ErrorCode::out_of_memory, "out of memory");
  } catch (const std::exception& e) {
    set_failure(v, ErrorCode::internal, e.what());
  }
  return v;
}

// Where a collective happens: the communicator, the call as its errors name it ("forward"), the library operation
// a deadline error names ("ShardedAttention::forward"), and the deadline of one wait.
struct Site {
  MPI_Comm comm;
  const char* call;
  const char* op;
  double deadline_s;
};

// Set when a wait of this process passed its deadline. MPI cannot cancel a collective: the abandoned one stays posted,
// its buffer may still be written, and its communicator is unusable; so every later collective is refused, and
// communicators and buffers that may be involved are never freed.
std::atomic<bool> g_abandoned{false};

// The small collectives' buffers (the agreement, the broadcast error), per thread rather than on the stack: a wait
// abandoned at its deadline leaves MPI free to write into its buffer when the stopped rank resumes, so the buffer
// must outlive the call. Fixed size, so no rank short of memory can leave before a collective the others enter.
struct SharedError {
  int code;
  char text[2048];
};
struct Scratch {
  uint64_t agree[4];
  uint64_t one;
  SharedError error;
};
thread_local Scratch t_scratch;

std::string seconds_text(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g s", s);
  return b;
}

// Refuses a deadline that is NaN or not above 0 (+infinity: no deadline).
void check_deadline(const char* call, double deadline_s) {
  if (!(deadline_s > 0)) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", deadline_s);
    invalid(std::string(call) + ": deadline_s=" + b +
            ": the deadline of a wait inside a collective must be above 0 seconds (+infinity for none)");
  }
}

// Polls `req` until it completes or this rank has waited site.deadline_s since `t0` (when it entered the collective).
// The first `spin_s` it spins on MPI_Test; after that it sleeps between tests, each sleep an eighth of the time waited
// so far and at most 1 ms, so a rank waiting seconds for a slow or stopped peer uses little CPU and notices the end of
// a long wait at most 1/8 later.
void wait_for(const Site& site, MPI_Request& req, const char* what, Clock::time_point t0, double spin_s) {
  constexpr double kMaxSleepS = 1e-3;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) return;
    const double waited = seconds_since(t0);
    if (waited > site.deadline_s) {
      g_abandoned = true;
      int rank = 0, ranks = 0;
      MPI_Comm_rank(site.comm, &rank);
      MPI_Comm_size(site.comm, &ranks);
      detail::translate_bad_alloc(site.op, [&] {
        throw CollectiveTimeout(std::string(site.op) + ": " + what + ": rank " + std::to_string(rank) + " of " +
                                    std::to_string(ranks) + " waited " + seconds_text(site.deadline_s) +
                                    " (its deadline) for the other ranks, one of which stopped answering "
                                    "(stopped, deadlocked or far slower); MPI cannot cancel a collective, so the "
                                    "communicator is unusable: end the job with MPI_Abort",
                                rank, site.deadline_s);
      });
    }
    if (waited > spin_s) {
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(kMaxSleepS, waited / 8)));
    }
  }
}

// Spinning for the first 1 ms keeps a decode step as fast as the blocking collectives were: the ranks of a step
// arrive within a millisecond, and a sleep costs at least the kernel's 50 us timer slack plus a reschedule. Spinning
// only 50 us, 3 of 7 runs of gpt2-small decode (B = 1, T = 128, 2 ranks of 1 thread) had a median step of 0.34 to
// 0.52 ms where runs with the blocking collectives had 0.19 to 0.30 ms (alternating runs on the 2-core VM while a
// build shared it); spinning 1 ms, 4 runs had 0.23 to 0.25 ms against 0.21 to 0.24 ms.
constexpr double kSpinS = 1e-3;
// The output all-reduce's data moves only while the ranks test, and every rank has arrived (the barrier before it):
// spinning keeps it as fast as the blocking MPI_Allreduce, sleeping only if a rank stops in the middle of it.
constexpr double kDataSpinS = 0.1;
// Outputs up to this many floats (64 KiB: a decode step's) are all-reduced without the barrier, which would add a
// round trip to the step; their one round waits with the back-off itself.
constexpr int64_t kSmallReduce = 16384;

// Before posting: a process that abandoned a collective posts no other (its buffers and communicators may be in use).
void check_not_abandoned(const Site& site) {
  if (g_abandoned) {
    fail(ErrorCode::internal, std::string(site.op) + ": refused: an earlier collective of this process passed its " +
                                  "deadline and MPI cannot cancel it; end the job with MPI_Abort");
  }
}

void allreduce(const Site& site, const char* what, void* buf, int count, MPI_Datatype type, MPI_Op op) {
  check_not_abandoned(site);
  const Clock::time_point t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, site.comm, &req), "MPI_Iallreduce");
  wait_for(site, req, what, t0, kSpinS);
}

void bcast(const Site& site, const char* what, void* buf, int count, MPI_Datatype type, int root) {
  check_not_abandoned(site);
  const Clock::time_point t0 = Clock::now();
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(buf, count, type, root, site.comm, &req), "MPI_Ibcast");
  wait_for(site, req, what, t0, kSpinS);
}

// The first failing rank's error, sent to every rank (all of them know one failed, so all join the broadcast), and
// thrown on each as "call: rank r: message".
[[noreturn]] void throw_shared_error(const Site& site, int rank, uint64_t failed_rank, const Verdict& mine) {
  const char* call = site.call;
  constexpr size_t kMax = sizeof(SharedError::text);
  SharedError& msg = t_scratch.error;
  msg = SharedError{};
  if (static_cast<uint64_t>(rank) == failed_rank) {
    msg.code = static_cast<int>(mine.code);
    std::strncpy(msg.text, mine.message.c_str(), kMax - 1);
  }
  bcast(site, "broadcast of the failing rank's error", &msg, sizeof msg, MPI_BYTE, static_cast<int>(failed_rank));
  msg.text[kMax - 1] = '\0';
  // "call: rank r: what", the call named once (most of the library's messages already start with it).
  // Every rank is past the collectives here: one that cannot build the message reports out of memory instead
  // (translate_bad_alloc's work, spelled out so that the compiler sees this function cannot return).
  try {
    const std::string text = msg.text, prefix = std::string(call) + ": ";
    const bool named = text.compare(0, prefix.size(), prefix) == 0;
    fail(static_cast<ErrorCode>(msg.code), prefix + "rank " + str(static_cast<int64_t>(failed_rank)) + ": " +
                                               (named ? text.substr(prefix.size()) : text));
  } catch (const std::bad_alloc&) {
    detail::fail_out_of_memory(call);
  }
}

// The agreement before a collective call: every rank's verdict and fingerprint combined by one all-reduce (MIN of
// {first failing rank, fingerprint, ~fingerprint, value}), so a bad input on any rank, or inputs that differ between
// ranks, give every rank the same Error before anything is computed. Returns the minimum of the ranks' values.
uint64_t agree(const Site& site, const Verdict& v) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(site.comm, &rank);
  MPI_Comm_size(site.comm, &ranks);
  uint64_t* buf = t_scratch.agree;
  buf[0] = v.failed ? static_cast<uint64_t>(rank) : static_cast<uint64_t>(ranks);
  buf[1] = v.fingerprint, buf[2] = ~v.fingerprint, buf[3] = v.min_value;
  allreduce(site, "all-reduce agreeing the ranks' checks and arguments", buf, 4, MPI_UINT64_T, MPI_MIN);
  if (buf[0] < static_cast<uint64_t>(ranks)) throw_shared_error(site, rank, buf[0], v);
  if (buf[1] != ~buf[2]) {
    // Every rank knows the fingerprints differ, so all join these two collectives to name the first rank unlike
    // rank 0: rank 0's fingerprint to all, then the least rank whose own differs. Fixed-size buffers, so no rank
    // short of memory can leave before them.
    uint64_t& one = t_scratch.one;
    one = v.fingerprint;
    bcast(site, "broadcast of rank 0's arguments' fingerprint", &one, 1, MPI_UINT64_T, 0);
    one = v.fingerprint != one ? static_cast<uint64_t>(rank) : static_cast<uint64_t>(ranks);
    allreduce(site, "all-reduce naming the rank whose arguments differ", &one, 1, MPI_UINT64_T, MPI_MIN);
    const uint64_t odd = one;
    const char* call = site.call;
    detail::translate_bad_alloc(call, [&] {
      invalid(std::string(call) + ": rank " + str(static_cast<int64_t>(odd)) + " was given other arguments than " +
              "rank 0 (every rank must pass the same config, inputs and sequence ids to a collective call)");
    });
  }
  return t_scratch.agree[3];
}

template <class F>
uint64_t check_and_agree(const Site& site, F&& f) {
  return agree(site, local_verdict(std::forward<F>(f)));
}

// The caller's communicator duplicated for the library's own traffic, returning errors instead of aborting
// (MPI_Comm_idup: the duplication is a collective too, so it waits with the deadline).
MPI_Comm private_comm(const Site& site) {
  check_not_abandoned(site);
  const Clock::time_point t0 = Clock::now();
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Comm_idup(site.comm, &dup, &req), "MPI_Comm_idup");
  wait_for(site, req, "duplication of the communicator", t0, kSpinS);
  check_mpi(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return dup;
}

// Frees the library's communicator, unless a collective was abandoned (it may be that one's).
void free_comm(MPI_Comm& comm) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm != MPI_COMM_NULL && !finalized && !g_abandoned) MPI_Comm_free(&comm);
  comm = MPI_COMM_NULL;
}

}  // namespace

struct ShardedAttention::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, ranks = 1;
  double deadline_s = kCollectiveDeadlineS;
  Config full;
  detail::HeadShard shard;
  std::unique_ptr<MultiHeadAttention::Impl> layer;
  // The all-reduce's buffer: a call's (B, T, E) partial output, then one float that is nonzero when a rank failed
  // while computing, so the output's sum also tells every rank whether all succeeded. Grows to the largest call.
  // Never freed once a collective was abandoned (g_abandoned): MPI may still write into it.
  std::unique_ptr<float[]> reduce;
  int64_t reduce_size = 0;
  ShardedCallTimes times;
  std::mutex mu;  // calls are collective: one at a time, in the same order on every rank

  ~Impl() {
    if (g_abandoned) static_cast<void>(reduce.release());
    free_comm(comm);
  }

  Site site(const char* call, const char* op) const { return {comm, call, op, deadline_s}; }

  // Grows `reduce` to n + 1 floats (in the agreement's checks: an allocation failure is a verdict like any other).
  float* reduce_buffer(int64_t n) {
    if (reduce_size < n + 1) {
      if (g_abandoned) static_cast<void>(reduce.release());
      reduce.reset();
      reduce_size = 0;
      reduce.reset(new float[static_cast<size_t>(n + 1)]);
      reduce_size = n + 1;
    }
    return reduce.get();
  }

  // Runs `compute` (this rank's heads into reduce[0, n)), then the one all-reduce that sums the partial outputs
  // and the failure flags; copies the sum to `out`, or throws the first failing rank's error on every rank (after
  // which `on_failure` runs first, on every rank).
  template <class Compute, class OnFailure>
  void compute_and_reduce(const Site& site, int64_t n, float* out, Clock::time_point t0, Compute&& compute,
                          OnFailure&& on_failure) {
    float* buf = reduce.get();
    const Verdict v = local_verdict([&](Verdict&) { compute(buf); });
    buf[n] = v.failed ? 1.0f : 0.0f;
    times.compute_s = seconds_since(t0);
    const Clock::time_point t1 = Clock::now();
    // First a barrier, waited for with sleeps: the wait for the slowest rank (the skew, up to a whole call's
    // compute) happens there, at little CPU. Then the data, polled by spinning, as it moves only while the ranks
    // test and every rank has arrived. MPI counts are int: an output past 2^31 - 1 floats (8 GiB) is summed in
    // pieces, the same on every rank.
    check_not_abandoned(site);
    MPI_Request req = MPI_REQUEST_NULL;
    const bool small = n + 1 <= kSmallReduce;
    if (!small) {
      check_mpi(MPI_Ibarrier(comm, &req), "MPI_Ibarrier");
      wait_for(site, req, "barrier before the all-reduce of the outputs", t1, kSpinS);
    }
    const Clock::time_point t2 = Clock::now();
    constexpr int64_t kPiece = int64_t{1} << 30;
    for (int64_t i = 0; i <= n; i += kPiece) {
      const int count = static_cast<int>(std::min(kPiece, n + 1 - i));
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf + i, count, MPI_FLOAT, MPI_SUM, comm, &req), "MPI_Iallreduce");
      wait_for(site, req, "all-reduce of the outputs", small ? t1 : t2, small ? kSpinS : kDataSpinS);
    }
    times.allreduce_s = seconds_since(t1);
    if (buf[n] != 0.0f) {
      on_failure();
      uint64_t& first = t_scratch.one;
      first = v.failed ? static_cast<uint64_t>(rank) : static_cast<uint64_t>(ranks);
      allreduce(site, "all-reduce naming the first rank that failed while computing", &first, 1, MPI_UINT64_T,
                MPI_MIN);
      throw_shared_error(site, rank, first, v);
    }
    std::memcpy(out, buf, static_cast<size_t>(n) * sizeof(float));
  }
};

struct ShardedKvCache::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  const ShardedAttention::Impl* layer = nullptr;  // the layer it was built for (its shard, config and deadline)
  std::unique_ptr<KvCache> local;
  // Set on every rank when a rank failed after the ranks agreed to append (an allocation inside the computation):
  // then some ranks' pools hold the new tokens and others' do not, so the cache refuses every further call. Two
  // literals, what happened and in which call, not a string: setting it must not need memory, because a rank that
  // throws there would skip the collective the other ranks wait in.
  struct OutOfStep {
    const char* what = nullptr;
    const char* call = nullptr;
  } out_of_step;

  ~Impl() { free_comm(comm); }

  Site site(const char* call) const { return {comm, call, call, layer->deadline_s}; }

  void check_in_step(const char* call) const {
    if (out_of_step.what) {
      invalid(std::string(call) + ": the sharded KV cache is out of step across ranks since " + out_of_step.what +
              out_of_step.call + "; release it and build a new one");
    }
  }
  // The pool's state that every rank must share before a call: its sequences and their lengths.
  void fingerprint_state(Fingerprint& f, const SequenceId* seqs, int64_t n) const {
    f.value(local->num_sequences());
    for (int64_t i = 0; i < n; ++i) f.value(local->contains(seqs[i]) ? local->length(seqs[i]) : int64_t{-1});
  }
};

// --- construction ---

namespace {

// Builds the rank's shard on every rank and agrees: `weights(shard)` gives this rank's slices as views (and keeps
// whatever they point into alive until the layer is built).
template <class Weights>
std::unique_ptr<ShardedAttention::Impl> build(const char* call, MPI_Comm comm, const EngineOptions& options,
                                              double deadline_s, Weights&& weights) {
  if (comm == MPI_COMM_NULL) invalid(std::string(call) + ": the communicator is MPI_COMM_NULL");
  int rank = 0, ranks = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  std::unique_ptr<ShardedAttention::Impl> impl;
  // A bad deadline is refused in the agreement, on every rank; the agreement itself waits the default.
  const Site site{comm, call, call, deadline_s > 0 ? deadline_s : kCollectiveDeadlineS};
  check_and_agree(site, [&](Verdict& v) {  // everything that may fail, the first allocation included
    check_deadline(call, deadline_s);
    impl = std::make_unique<ShardedAttention::Impl>();
    impl->rank = rank, impl->ranks = ranks, impl->deadline_s = deadline_s;
    // What every rank must share: the config, the compute type (the instruction set may differ from node to node),
    // and what `weights` adds of the weights' source.
    Fingerprint f;
    weights(*impl, [&](const WeightsView& w) { impl->layer = detail::make_shard_layer(impl->shard, w, options); }, f);
    const std::string json = to_json(impl->full);
    f.bytes(json.data(), json.size());
    f.value(options.compute);
    v.fingerprint = f.digest();
  });
  impl->comm = private_comm(site);
  return impl;
}

}  // namespace

ShardedAttention::ShardedAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ShardedAttention::ShardedAttention(const Config& config, const WeightsView& weights, MPI_Comm comm,
                                   const EngineOptions& options, WeightCheck check, double deadline_s)
    : impl_(build("ShardedAttention", comm, options, deadline_s, [&](Impl& s, auto&& make, Fingerprint& f) {
        config.validate();
        weights.validate(config);
        s.full = config;
        s.shard = detail::shard_of(config, s.rank, s.ranks);
        fingerprint_weights(f, weights, check);
        make(detail::shard_weights(weights, s.shard));
      })) {}

ShardedAttention::ShardedAttention(const Config& config, const std::string& path, const std::string& prefix,
                                   MPI_Comm comm, const EngineOptions& options, WeightCheck check,
                                   double deadline_s)
    : impl_(build("ShardedAttention", comm, options, deadline_s, [&](Impl& s, auto&& make, Fingerprint& f) {
        // Mapped, not read: the rank's layer copies its slices, so only their pages are read, and the hash's:
        // WeightCheck::full reads every page once, sampled only the sample's.
        const StoredLayer file =
            detail::open_safetensors_layer(std::make_shared<const safetensors::File>(safetensors::map(path)), prefix);
        s.full = apply_loaded_shapes(config, file);
        detail::validate_weights(file.weights, s.full, s.full.d_model, /*values=*/false);  // the slices' when built
        s.shard = detail::shard_of(s.full, s.rank, s.ranks);
        fingerprint_weights(f, file.weights, check);
        make(detail::shard_weights(file.weights, s.shard));
      })) {}

ShardedAttention ShardedAttention::random(const Config& config, uint64_t seed, MPI_Comm comm,
                                          const EngineOptions& options, double deadline_s) {
  return ShardedAttention(
      build("ShardedAttention::random", comm, options, deadline_s, [&](Impl& s, auto&& make, Fingerprint& f) {
        config.validate();
        s.full = config;
        s.shard = detail::shard_of(config, s.rank, s.ranks);
        f.value(seed);
        const Weights w = detail::random_shard_weights(config, seed, s.shard);
        make(detail::local_view(w, s.shard));
      }));
}

ShardedAttention::~ShardedAttention() = default;
ShardedAttention::ShardedAttention(ShardedAttention&&) noexcept = default;
ShardedAttention& ShardedAttention::operator=(ShardedAttention&&) noexcept = default;

// --- the collective calls ---

void ShardedAttention::forward(const AttentionInputs& in, float* out, const RunOptions& run) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  const Clock::time_point t0 = Clock::now();
  AttentionInputs local_in;
  int64_t n = 0;
  const Site site = s.site("forward", "ShardedAttention::forward");
  check_and_agree(site, [&](Verdict& v) {
    // Against the whole layer first, so that messages name its shapes; then the shard's view of the same inputs.
    const int threads = s.layer->threads_for(run);
    const detail::AttnShape full = detail::validate_inputs(s.full, in, run, threads);
    if (!out) invalid("output: null pointer");
    local_in = detail::shard_inputs(in, s.shard);
    RunOptions quiet = run;
    quiet.check_finite = false;  // scanned once, above
    const detail::AttnShape local = detail::validate_inputs(s.layer->cfg, local_in, quiet, threads);
    // Every allocation the computation makes of its own happens here, before the ranks agree to go ahead.
    const int64_t bytes = s.layer->forward_plan(local, true, true, true, threads).bytes;
    s.layer->with_workspace(nullptr, "forward", [&](Workspace::Impl& w) { w.reserve(static_cast<size_t>(bytes)); });
    n = full.B * full.T * full.E;
    s.reduce_buffer(n);
    Fingerprint f;
    for (const TensorView* t : {&in.query, &in.key, &in.value, &in.attn_mask, &in.key_padding}) f.view(*t);
    f.value(in.mask_kind), f.value(run.training), f.value(run.dropout_seed), f.value(run.check_finite);
    v.fingerprint = f.digest();
  });
  RunOptions quiet = run;
  quiet.check_finite = false;
  s.compute_and_reduce(site, n, out, t0, [&](float* partial) {
    s.layer->with_workspace(nullptr, "forward", [&](Workspace::Impl& w) {
      s.layer->forward(local_in, partial, DType::f32, quiet, w);
    });
  }, [] {});
}

namespace {

// What extend, decode and step share: the checks of any serving call (the cache belongs to this layer and is in step,
// `validate` the call's own, the pool can take tokens[i] more for each seqs[i], i < n), the allocations of the
// computation (`bytes(threads)` of workspace), and the fingerprint, all agreed; then `compute` (this rank's heads) and
// the all-reduce of the (rows, E) output, rows the tokens of all n. A failure while computing leaves the ranks' pools
// out of step, which the cache then says.
template <class Validate, class Bytes, class Compute>
void serving_call(ShardedAttention::Impl& s, ShardedKvCache::Impl& c, const char* call, const char* op,
                  const SequenceId* seqs, int64_t n, AppendTokens tokens, const float* x, float* out,
                  const RunOptions& run, Validate&& validate, Bytes&& bytes, Compute&& compute) {
  std::lock_guard<std::mutex> lock(s.mu);
  const Clock::time_point t0 = Clock::now();
  const int threads = s.layer->threads_for(run);
  int64_t rows = 0;  // summed after validate() has bounded every count
  const Site site = s.site(call, op);
  check_and_agree(site, [&](Verdict& v) {
    if (c.layer != &s) invalid(std::string(call) + ": the sharded KV cache was built for another ShardedAttention");
    c.check_in_step(call);
    validate();
    for (int64_t i = 0; i < n; ++i) rows += tokens[i];
    c.local->impl().check_append(seqs, n, tokens, s.layer->cfg.context_length);
    const int64_t ws_bytes = bytes(threads);
    s.layer->with_workspace(nullptr, call, [&](Workspace::Impl& w) { w.reserve(static_cast<size_t>(ws_bytes)); });
    s.reduce_buffer(rows * s.full.d_model);
    Fingerprint f;
    c.fingerprint_state(f, seqs, n);
    f.value(n), f.value(run.check_finite);
    for (int64_t i = 0; i < n; ++i) f.value(tokens[i]);
    f.bytes(seqs, static_cast<size_t>(n) * sizeof(SequenceId));
    f.bytes(x, static_cast<size_t>(rows * s.full.query_width()) * sizeof(float));
    v.fingerprint = f.digest();
  });
  RunOptions quiet = run;
  quiet.check_finite = false;  // scanned once, in the agreement
  s.compute_and_reduce(site, rows * s.full.d_model, out, t0, [&](float* partial) {
    s.layer->with_workspace(nullptr, call, [&](Workspace::Impl& w) { compute(partial, quiet, w); });
  }, [&] { c.out_of_step = {"a rank failed while computing ", call}; });
}

}  // namespace

void ShardedAttention::extend(ShardedKvCache& cache, SequenceId seq, const float* x, int64_t T, float* out,
                              const RunOptions& run) {
  Impl& s = *impl_;
  KvCache& pool = *cache.impl_->local;
  serving_call(s, *cache.impl_, "extend", "ShardedAttention::extend", &seq, 1, T, x, out, run,
               [&] { detail::validate_extend(s.layer->cfg, pool, x, T, out, run, s.layer->threads_for(run)); },
               [&](int threads) { return s.layer->serving_bytes(T, 0, threads); },
               [&](float* partial, const RunOptions& r, Workspace::Impl& w) {
                 s.layer->extend(pool, seq, x, T, partial, r, w);
               });
}

void ShardedAttention::decode(ShardedKvCache& cache, const SequenceId* seqs, int64_t B, const float* x, float* out,
                              const RunOptions& run) {
  Impl& s = *impl_;
  KvCache& pool = *cache.impl_->local;
  serving_call(s, *cache.impl_, "decode", "ShardedAttention::decode", seqs, B, 1, x, out, run,
               [&] { detail::validate_decode(s.layer->cfg, pool, seqs, B, x, out, run, s.layer->threads_for(run)); },
               [&](int threads) { return s.layer->serving_bytes(0, B, threads); },
               [&](float* partial, const RunOptions& r, Workspace::Impl& w) {
                 s.layer->decode(pool, seqs, B, x, partial, r, w);
               });
}

void ShardedAttention::step(ShardedKvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n,
                            const float* x, float* out, const RunOptions& run) {
  Impl& s = *impl_;
  KvCache& pool = *cache.impl_->local;
  int64_t M = 0;  // read only once validate_step has bounded every count
  serving_call(s, *cache.impl_, "step", "ShardedAttention::step", seqs, n, AppendTokens(tokens), x, out, run,
               [&] {
                 M = detail::validate_step(s.layer->cfg, pool, seqs, tokens, n, x, out, run,
                                           s.layer->threads_for(run)).T;
               },
               [&](int threads) { return s.layer->step_bytes(M, n, threads); },
               [&](float* partial, const RunOptions& r, Workspace::Impl& w) {
                 s.layer->step(pool, seqs, tokens, n, x, partial, r, w);
               });
}

const Config& ShardedAttention::config() const { return impl_->full; }
int ShardedAttention::rank() const { return impl_->rank; }
int ShardedAttention::ranks() const { return impl_->ranks; }
int64_t ShardedAttention::first_head() const { return impl_->shard.first_head; }
int64_t ShardedAttention::heads() const { return impl_->shard.local.num_heads; }
int64_t ShardedAttention::first_kv_head() const { return impl_->shard.first_kv_head; }
int64_t ShardedAttention::kv_heads() const { return impl_->shard.local.kv_heads(); }
Isa ShardedAttention::isa() const { return impl_->layer->kset.isa; }
std::string ShardedAttention::implementation() const {
  return "tensor-parallel over MPI, rank " + str(impl_->rank) + " of " + str(impl_->ranks) + ": heads [" +
         str(first_head()) + ", " + str(first_head() + heads()) + "), " + impl_->layer->kset.name;
}
ShardedCallTimes ShardedAttention::last_call_times() const { return impl_->times; }
double ShardedAttention::deadline_s() const { return impl_->deadline_s; }

void run_agreed(MPI_Comm comm, const char* what, const std::function<void()>& step, double deadline_s) {
  check_and_agree(Site{comm, what, what, deadline_s > 0 ? deadline_s : kCollectiveDeadlineS}, [&](Verdict&) {
    check_deadline(what, deadline_s);
    step();
  });
}

// --- the sharded cache ---

ShardedKvCache::ShardedKvCache(const ShardedAttention& layer, const KvCacheOptions& options) {
  const ShardedAttention::Impl& s = *layer.impl_;
  // Round 1: the options are valid on every rank, and the tokens each rank's bytes would hold (a one-block probe
  // pool gives the block size); every rank learns the smallest.
  const Site site = s.site("ShardedKvCache", "ShardedKvCache");
  const uint64_t tokens = check_and_agree(site, [&](Verdict& v) {
    impl_ = std::make_unique<Impl>();  // inside the agreement: a rank that cannot allocate still joins it
    impl_->layer = &s;
    if (!s.full.causal || !s.full.same_input_widths()) {
      invalid("ShardedKvCache: a KV cache serves causal self-attention (config.causal, kdim = vdim = d_in), as "
              "CausalSelfAttention does; this layer's config is " + to_json(s.full));
    }
    KvCacheOptions probe = options;
    probe.capacity_bytes = 0;
    probe.capacity_tokens = 1;
    const KvCache one(s.layer->cfg, probe);
    if ((options.capacity_tokens > 0) == (options.capacity_bytes > 0)) KvCache(s.layer->cfg, options);  // its error
    const int64_t bt = one.block_tokens();
    v.min_value = options.capacity_tokens > 0
                      ? static_cast<uint64_t>(options.capacity_tokens)
                      : static_cast<uint64_t>(options.capacity_bytes / one.block_bytes()) * static_cast<uint64_t>(bt);
    if (v.min_value == 0) {
      invalid("ShardedKvCache: capacity_bytes=" + std::to_string(options.capacity_bytes) +
              " holds no block on this rank (one block is " + std::to_string(one.block_bytes()) + " bytes)");
    }
    Fingerprint f;
    f.value(options.block_tokens), f.value(options.dtype), f.value(options.capacity_tokens > 0);
    v.fingerprint = f.digest();
  });
  // Round 2: every rank's pool, of the agreed token capacity.
  Impl& c = *impl_;
  check_and_agree(site, [&](Verdict&) {
    KvCacheOptions o = options;
    o.capacity_bytes = 0;
    o.capacity_tokens = static_cast<int64_t>(tokens);
    c.local = std::make_unique<KvCache>(s.layer->cfg, o);
  });
  c.comm = private_comm(site);
}

ShardedKvCache::~ShardedKvCache() = default;
ShardedKvCache::ShardedKvCache(ShardedKvCache&&) noexcept = default;
ShardedKvCache& ShardedKvCache::operator=(ShardedKvCache&&) noexcept = default;

namespace {

// A sequence operation on every rank's pool: agreed first (the cache in step, `seq` known where it is needed, the
// same arguments everywhere), then done locally. Ids are assigned in order and never reused, so every rank's pool
// gives the same id. An allocation failure after the agreement (a sequence entry) marks the cache out of step on
// that rank, which the next call's agreement reports to all.
// `length`: fork's prefix or truncate's new length, checked here against the sequence's (0..length) and agreed.
template <class Op>
SequenceId sequence_op(ShardedKvCache::Impl& c, const char* call, int op, SequenceId seq, bool needs_seq, Op&& f,
                       std::optional<int64_t> length = std::nullopt) {
  check_and_agree(c.site(call), [&](Verdict& v) {
    c.check_in_step(call);
    if (needs_seq && !c.local->contains(seq)) {
      invalid(std::string(call) + ": unknown sequence id " + str(seq) + " (never created, or released)");
    }
    if (length && (*length < 0 || *length > c.local->length(seq))) {
      invalid(std::string(call) + ": " + str(*length) + " tokens of sequence " + str(seq) + ", which holds " +
              str(c.local->length(seq)) + " (must be 0.." + str(c.local->length(seq)) + ")");
    }
    Fingerprint fp;
    c.fingerprint_state(fp, &seq, needs_seq ? 1 : 0);
    fp.value(op), fp.value(seq), fp.value(length.value_or(-1));
    v.fingerprint = fp.digest();
  });
  try {
    return f();
  } catch (...) {
    c.out_of_step = {"a rank failed in ", call};
    throw;
  }
}

}  // namespace

SequenceId ShardedKvCache::create() {
  return sequence_op(*impl_, "ShardedKvCache::create", 0, 0, false, [&] { return impl_->local->create(); });
}
SequenceId ShardedKvCache::fork(SequenceId parent) {
  return sequence_op(*impl_, "ShardedKvCache::fork", 1, parent, true, [&] { return impl_->local->fork(parent); });
}
SequenceId ShardedKvCache::fork(SequenceId parent, int64_t prefix_tokens) {
  return sequence_op(
      *impl_, "ShardedKvCache::fork", 3, parent, true, [&] { return impl_->local->fork(parent, prefix_tokens); },
      prefix_tokens);
}
void ShardedKvCache::truncate(SequenceId seq, int64_t new_length) {
  sequence_op(
      *impl_, "ShardedKvCache::truncate", 4, seq, true,
      [&] {
        impl_->local->truncate(seq, new_length);
        return seq;
      },
      new_length);
}
void ShardedKvCache::release(SequenceId seq) {
  sequence_op(*impl_, "ShardedKvCache::release", 2, seq, true, [&] {
    impl_->local->release(seq);
    return seq;
  });
}

bool ShardedKvCache::contains(SequenceId seq) const { return impl_->local->contains(seq); }
int64_t ShardedKvCache::length(SequenceId seq) const { return impl_->local->length(seq); }
int64_t ShardedKvCache::free_blocks() const { return impl_->local->free_blocks(); }
int64_t ShardedKvCache::total_blocks() const { return impl_->local->total_blocks(); }
KvCache& ShardedKvCache::local() { return *impl_->local; }
const KvCache& ShardedKvCache::local() const { return *impl_->local; }

}  // namespace gpt2attn
