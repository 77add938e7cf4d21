// engine/workspace.cpp: Workspace's buffer growth and the one-call-at-a-time lease.
#include "engine/workspace.hpp"

#include <cstdint>
#include <string>

#include "engine/util.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

std::byte* Workspace::Impl::reserve(size_t n) {
  if (n <= bytes && buffer) return buffer.get();
  buffer = detail::allocate_buffer(n, "workspace");  // on failure the old buffer stays
  bytes = detail::buffer_capacity(n);
  return buffer.get();
}

Workspace::Workspace() : impl_(detail::translate_bad_alloc("Workspace", [] { return std::make_unique<Impl>(); })) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;
size_t Workspace::bytes() const { return impl_->bytes; }

namespace detail {

WorkspaceLease::WorkspaceLease(Workspace::Impl& ws) : ws_(ws) {
  if (ws_.in_use.exchange(true, std::memory_order_acquire)) {
    invalid("workspace: already in use by another call (give each calling thread its own Workspace)");
  }
}

}  // namespace detail
}  // namespace gpt2attn
