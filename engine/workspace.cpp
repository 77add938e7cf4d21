// engine/workspace.cpp: Workspace's buffer growth and the one-call-at-a-time lease.
#include "engine/workspace.hpp"

#include <cstdint>
#include <string>

#include "engine/util.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

float* Workspace::Impl::reserve(size_t n) {
  if (n <= floats && buffer) return buffer.get();
  n = n > 0 ? n : 16;  // aligned_alloc(64, 0) may return null, which is not an out-of-memory
  if (n > SIZE_MAX / sizeof(float) - 16) fail(ErrorCode::out_of_memory, "workspace: " + std::to_string(n) + " floats overflow size_t");
  const size_t bytes = (n + 15) / 16 * 16 * sizeof(float);
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) fail(ErrorCode::out_of_memory, "workspace: cannot allocate " + std::to_string(bytes) + " bytes");
  buffer.reset(p);
  floats = bytes / sizeof(float);
  return p;
}

Workspace::Workspace() : impl_(detail::translate_bad_alloc("Workspace", [] { return std::make_unique<Impl>(); })) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;
size_t Workspace::bytes() const { return impl_->floats * sizeof(float); }

namespace detail {

WorkspaceLease::WorkspaceLease(Workspace::Impl& ws) : ws_(ws) {
  if (ws_.in_use.exchange(true, std::memory_order_acquire)) {
    invalid("workspace: already in use by another call (give each calling thread its own Workspace)");
  }
}

}  // namespace detail
}  // namespace gpt2attn
