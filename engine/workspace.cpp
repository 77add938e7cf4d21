// engine/workspace.cpp: Workspace's buffer growth and the one-call-at-a-time lease.
#include "engine/workspace.hpp"

#include <cstdint>
#include <string>

#include "engine/util.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

std::byte* Workspace::Impl::reserve(size_t n) {
  if (n <= bytes && buffer) return buffer.get();
  n = n > 0 ? n : 64;  // aligned_alloc(64, 0) may return null, which is not an out-of-memory
  if (n > SIZE_MAX - 64) fail(ErrorCode::out_of_memory, "workspace: " + std::to_string(n) + " bytes overflow size_t");
  const size_t size = (n + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  detail::check_fits_in_memory(size > static_cast<size_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(size),
                               "workspace");
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, size));
  if (!p) fail(ErrorCode::out_of_memory, "workspace: cannot allocate " + std::to_string(size) + " bytes");
  buffer.reset(p);
  bytes = size;
  return p;
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
