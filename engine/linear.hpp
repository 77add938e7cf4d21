// engine/linear.hpp: y = x W^T + b on oneDNN's matmul. Weights are reordered once, at construction, into
// the blocked layout oneDNN prefers; each (M, strides, threads) gets its primitive once per ExecContext,
// then only execute().
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpt2attn::detail {

// Sets the calling thread's OpenMP team size for the scope (oneDNN's OpenMP runtime reads it), so the
// caller's thread count governs the GEMMs too and no second pool ever exists.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads);
  ~ScopedOmpThreads();
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

class Linear;

// The mutable half of the GEMMs: oneDNN primitives with their memory objects and scratchpads, one per GEMM
// shape (N, K, bias, M, lda, ldc, threads) and slot, created on first use. Weights are bound per call, so one
// entry serves every Linear of its shape (the H per-head projections share theirs). `slot` is the calling
// thread's number inside an OpenMP team, so team threads running same-shape GEMMs at once never share an
// entry. Each Workspace owns one ExecContext: calls with distinct workspaces share no mutable oneDNN state,
// while the weights (Linear) are shared read-only.
class ExecContext {
 public:
  ExecContext();
  ~ExecContext();
  ExecContext(const ExecContext&) = delete;
  ExecContext& operator=(const ExecContext&) = delete;

 private:
  friend class Linear;
  struct Entry;
  struct Key {
    int64_t N, K;
    bool bias;
    int64_t M, lda, ldc;
    int threads, slot;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  std::mutex mu_;  // the team's threads look up and add entries concurrently
  std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> entries_;
};

// y = x W^T + b. Immutable after construction: run() may be called from several threads at once, each with
// its own ExecContext.
class Linear {
 public:
  // w: (N, K) row-major (torch layout), bias: (N) or null. Both are copied.
  Linear(const float* w, const float* bias, int64_t N, int64_t K);
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;
  ~Linear();

  // x: (M, K) with row stride lda; y: (M, N) with row stride ldc. M >= 1.
  // The first call for a given (M, lda, ldc, threads) in `ctx` creates its primitive; later calls allocate nothing.
  void run(ExecContext& ctx, const float* x, int64_t M, int64_t lda, float* y, int64_t ldc, int threads) const;
  // Creates the entry run() would use from OpenMP thread `slot` (0 outside a parallel region), without running.
  void prepare(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot) const;

  int64_t N() const { return N_; }
  int64_t K() const { return K_; }
  const std::string& implementation() const { return impl_; }  // oneDNN's name, e.g. "brg:avx512_core"

 private:
  ExecContext::Entry& entry(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot) const;

  int64_t N_ = 0, K_ = 0;
  bool has_bias_ = false;
  dnnl::memory::desc weights_desc_;
  dnnl::memory weights_, bias_;
  std::string impl_;
};

dnnl::engine& cpu_engine();

}  // namespace gpt2attn::detail
