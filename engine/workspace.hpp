// engine/workspace.hpp: what a Workspace holds (include/gpt2attn/attention.hpp): one aligned float buffer that
// grows only when a call needs more, and the oneDNN execution state of every GEMM run with it.
#pragma once

#include <atomic>
#include <cstdlib>
#include <memory>

#include "engine/linear.hpp"
#include "gpt2attn/attention.hpp"

namespace gpt2attn {

struct Workspace::Impl {
  struct FreeDeleter {
    void operator()(float* p) const { std::free(p); }
  };

  detail::ExecContext exec;
  std::unique_ptr<float, FreeDeleter> buffer;  // 64-byte aligned
  size_t floats = 0;
  std::atomic<bool> in_use{false};

  // The buffer with room for at least n floats; reallocates (losing the contents) only when it is smaller.
  float* reserve(size_t n);
};

namespace detail {

// Marks a Workspace busy for one call, so two threads sharing one are told so instead of corrupting it.
class WorkspaceLease {
 public:
  explicit WorkspaceLease(Workspace::Impl& ws);
  ~WorkspaceLease() { ws_.in_use.store(false, std::memory_order_release); }
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;

 private:
  Workspace::Impl& ws_;
};

}  // namespace detail
}  // namespace gpt2attn
