// engine/workspace.hpp: what a Workspace holds (include/gpt2attn/options.hpp): one 64-byte aligned buffer of
// bytes that grows only when a call needs more, and the oneDNN execution state of every GEMM run with it; and the
// plan that cuts a call's buffer into typed regions.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <mutex>

#include "engine/buffer.hpp"
#include "engine/linear.hpp"
#include "engine/util.hpp"
#include "gpt2attn/options.hpp"

namespace gpt2attn {

struct Workspace::Impl {
  detail::ExecContext exec;
  detail::Buffer buffer;  // 64-byte aligned, on huge pages when large (engine/buffer.hpp)
  size_t bytes = 0;
  std::atomic<bool> in_use{false};

  // The buffer with room for at least n bytes; reallocates (losing the contents) only when it is smaller.
  std::byte* reserve(size_t n);
};

namespace detail {

// A region of a call's workspace holding elements of type T: a byte offset, 64-byte aligned. T is an
// implicit-lifetime type (float, int64_t, a pointer), so the aligned_alloc'd bytes can hold it directly.
template <class T>
struct Region {
  int64_t offset = 0;
  T* in(std::byte* base) const { return reinterpret_cast<T*>(base + offset); }
};

// Hands out the regions of a workspace; used twice per call, once to size and once to place, so the size and the
// layout can never disagree. A region is the product of its factors elements of T; every product and sum is
// checked, so a call too large to allocate is refused (out_of_memory) before it is tried.
class WorkspacePlan {
 public:
  template <class T>
  Region<T> region(std::initializer_list<int64_t> factors, const char* what) {
    return {place(factors, sizeof(T), what)};
  }
  // A region of elements of run-time type t (activations in the compute type, f32 or bf16).
  Region<std::byte> region(DType t, std::initializer_list<int64_t> factors, const char* what) {
    return {place(factors, size_of(t), what)};
  }
  int64_t bytes() const { return at_; }

 private:
  // The next region's offset, for the product of `factors` elements of `element_bytes` each.
  int64_t place(std::initializer_list<int64_t> factors, size_t element_bytes, const char* what) {
    const int64_t bytes = checked_mul(checked_product(factors, what), static_cast<int64_t>(element_bytes), what);
    const int64_t offset = at_;
    at_ = checked_add(at_, round_up(bytes, 64, what), what);
    return offset;
  }

  int64_t at_ = 0;
};

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

// Runs f(workspace) for a public call named `call` of an object holding its own Workspace `own` guarded by `mu`: with
// the caller's Workspace (leased, so two threads sharing one are refused) or `own` (under mu), and with std::bad_alloc
// turned into Error. Held by this call alone from here: the place to bound its oneDNN primitives (ExecContext::trim).
template <class F>
void with_workspace(Workspace* ws, Workspace& own, std::mutex& mu, const char* call, F&& f) {
  translate_bad_alloc(call, [&] {
    if (ws) {
      WorkspaceLease lease(ws->impl());
      ws->impl().exec.trim();
      f(ws->impl());
    } else {
      std::lock_guard<std::mutex> lock(mu);
      own.impl().exec.trim();
      f(own.impl());
    }
  });
}

}  // namespace detail
}  // namespace gpt2attn
