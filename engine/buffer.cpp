// engine/buffer.cpp: allocate_buffer (engine/buffer.hpp), and the out-of-memory error of last resort (engine/util.hpp).
#include "engine/buffer.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "engine/util.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn::detail {

namespace {
// Made while the library loads, when the heap has room: rethrowing it takes no operator new (the C++ runtime
// allocates a rethrown exception's header with malloc, or from its emergency pool when malloc fails). Never freed,
// so a thread still running while statics are destroyed at exit finds it too; null (zero-initialised) only before
// the library's own initialisers have run.
const std::exception_ptr* const g_out_of_memory = new std::exception_ptr(std::make_exception_ptr(
    Error(ErrorCode::out_of_memory, "gpt2attn: out of memory (too little left to name the call)")));
}  // namespace

void fail_out_of_memory(const char* what) {
  try {
    fail(ErrorCode::out_of_memory, std::string(what) + ": out of memory");
  } catch (const std::bad_alloc&) {  // building the message, or the Error's copy of it
    if (g_out_of_memory) std::rethrow_exception(*g_out_of_memory);
    throw;  // before the library's statics are made (another library's initialiser calling in): bad_alloc as it came
  }
}

size_t buffer_capacity(size_t bytes) {
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : 64;
  if (bytes > SIZE_MAX - align) {
    fail_size_overflow("buffer", std::to_string(bytes) + " bytes", "size_t once aligned");
  }
  return bytes == 0 ? 64 : (bytes + align - 1) / align * align;  // aligned_alloc(64, 0) may return null
}

Buffer allocate_buffer(size_t bytes, const char* what) {
  const size_t size = buffer_capacity(bytes);
  if (size > static_cast<size_t>(INT64_MAX)) fail_size_overflow(what, std::to_string(size) + " bytes", "int64");
  check_fits_in_memory(static_cast<int64_t>(size), what);
  const bool huge = size >= kHugePageBytes;
  Buffer p(static_cast<std::byte*>(std::aligned_alloc(huge ? kHugePageBytes : 64, size)));
  if (!p) fail(ErrorCode::out_of_memory, std::string(what) + ": cannot allocate " + std::to_string(size) + " bytes");
  // Before the first touch, so the pages are faulted in huge. Failure (a kernel without THP) leaves plain pages.
  if (huge) static_cast<void>(madvise(p.get(), size, MADV_HUGEPAGE));
  return p;
}

}  // namespace gpt2attn::detail
