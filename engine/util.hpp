// engine/util.hpp: the engine's small shared helpers: overflow-checked size arithmetic (every element and byte
// count derived from a config, a shape, a flag or a file goes through it), ceil_div, and number formatting for
// error messages. Nothing here allocates on success or knows about attention.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>

#include "gpt2attn/error.hpp"

namespace gpt2attn::detail {

inline std::string str(int64_t v) { return std::to_string(v); }

// a * b and a + b for sizes (non-negative), or Error(invalid_argument) naming `what` and the size when the result
// does not fit in int64. No machine could ever satisfy such a request, so it is the caller's mistake, not the
// out_of_memory a server reads as "retry later"; that code is kept for sizes that are representable but more than
// this machine has (check_fits_in_memory, a failed allocation). Every size-overflow refusal goes through
// fail_size_overflow, so the rule lives here.
[[noreturn]] inline void fail_size_overflow(const std::string& what, const std::string& size, const char* limit) {
  invalid(what + ": size " + size + " overflows " + limit + " (no machine could hold it)");
}
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) {
    fail_size_overflow(what, str(a) + " x " + str(b), "int64");
  }
  return r;
}
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) {
    fail_size_overflow(what, str(a) + " + " + str(b), "int64");
  }
  return r;
}
// The product of every factor, checked: checked_product({B, T, E}, "q").
inline int64_t checked_product(std::initializer_list<int64_t> factors, const char* what) {
  int64_t r = 1;
  for (int64_t f : factors) r = checked_mul(r, f, what);
  return r;
}

// The machine's physical memory in bytes, or INT64_MAX where the system does not say.
inline int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t r = 0;
  if (pages <= 0 || page <= 0 || __builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page), &r)) {
    return INT64_MAX;
  }
  return r;
}
// Error(out_of_memory) naming `what` when one buffer of `bytes` would exceed the physical memory. Linux overcommits:
// such an allocation often succeeds, and the process is OOM-killed later, when its pages are touched (a KV pool
// filling up in a server); refusing it up front gives the caller an error instead.
inline void check_fits_in_memory(int64_t bytes, const char* what) {
  const int64_t physical = physical_memory_bytes();
  if (bytes > physical) {
    fail(ErrorCode::out_of_memory, std::string(what) + ": " + str(bytes) + " bytes exceed the machine's " +
                                       str(physical) + " bytes of physical memory");
  }
}

// ceil(a / b) for a >= 0, b > 0, without the overflow of (a + b - 1) / b.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }
// The multiple of m at or above n (n >= 0, m > 0), checked.
inline int64_t round_up(int64_t n, int64_t m, const char* what = "size") { return checked_mul(ceil_div(n, m), m, what); }

// Throws Error(out_of_memory, "<what>: out of memory"); where the heap cannot spare even that message (or the
// Error's copy of it), a preallocated Error(out_of_memory) that does not name the call (engine/buffer.cpp), so that
// std::bad_alloc never leaves the API.
[[noreturn]] void fail_out_of_memory(const char* what);

// Runs f() and turns a std::bad_alloc escaping it into Error(out_of_memory) naming `what` (fail_out_of_memory), so a
// C++ caller sees the library's one exception type for every failure (the public entry points wrap their bodies in
// this).
template <class F>
decltype(auto) translate_bad_alloc(const char* what, F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    fail_out_of_memory(what);
  }
}

}  // namespace gpt2attn::detail
