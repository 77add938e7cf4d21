// engine/buffer.hpp: the engine's long-lived large buffers (the KV pool, decode's packed weights, workspaces), in one
// allocator that asks Linux for transparent huge pages: decode streams these buffers from memory every step, and
// with 4 KiB pages each page is a TLB miss whose walk, after other layers have evicted the page tables, goes to
// memory, and a page boundary the hardware prefetcher does not cross. With 2 MiB pages a gpt2-small decode step
// (B=16, T=1024, cold caches, 2 threads) measured 4.55 -> 4.10 ms over an f32 cache (bench/README.md).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace gpt2attn::detail {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<std::byte, FreeDeleter>;

// The huge-page size buffers of at least this many bytes are aligned to and advised onto (MADV_HUGEPAGE).
inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// At least `bytes` bytes (uninitialised), 64-byte aligned; from kHugePageBytes up, aligned to and rounded up to
// kHugePageBytes, and advised onto huge pages (advice only: where the kernel has them off, they are plain pages).
// Error(invalid_argument) naming `what` when the size, once aligned, overflows int64 (no machine could hold it);
// Error(out_of_memory) naming `what` when it exceeds physical memory or the allocation fails.
Buffer allocate_buffer(size_t bytes, const char* what);

// The bytes allocate_buffer(bytes) reserves: bytes rounded up to 64, or to kHugePageBytes from there up;
// Error(invalid_argument) when that overflows size_t.
size_t buffer_capacity(size_t bytes);

}  // namespace gpt2attn::detail
