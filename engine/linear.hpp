// engine/linear.hpp: y = x W^T + b on oneDNN's matmul. Weights are reordered once, at construction, into
// the blocked layout oneDNN prefers; each (M, strides, threads) gets its primitive once, then only execute().
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <memory>
#include <string>
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

class Linear {
 public:
  // w: (N, K) row-major (torch layout), bias: (N) or null. Both are copied.
  Linear(const float* w, const float* bias, int64_t N, int64_t K);
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;
  ~Linear();

  // x: (M, K) with row stride lda; y: (M, N) with row stride ldc. M >= 1.
  // The first call for a given (M, lda, ldc, threads) creates its primitive; later calls allocate nothing.
  void run(const float* x, int64_t M, int64_t lda, float* y, int64_t ldc, int threads);
  void prepare(int64_t M, int64_t lda, int64_t ldc, int threads);  // creates without running

  int64_t N() const { return N_; }
  int64_t K() const { return K_; }
  std::string implementation() const;  // oneDNN's name for the last primitive used, e.g. "brg:avx512_core"

 private:
  struct Entry;
  Entry& entry(int64_t M, int64_t lda, int64_t ldc, int threads);

  int64_t N_ = 0, K_ = 0;
  bool has_bias_ = false;
  dnnl::memory::desc weights_desc_;
  dnnl::memory weights_, bias_;
  std::vector<std::unique_ptr<Entry>> entries_;
  Entry* last_ = nullptr;
};

dnnl::engine& cpu_engine();

}  // namespace gpt2attn::detail
