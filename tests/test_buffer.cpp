// tests/test_buffer.cpp: the engine's large-buffer allocator (engine/buffer.hpp): sizes and alignment, huge-page
// advice on the buffers decode streams (the KV pool, the packed weights, a workspace), and refusals.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "engine/buffer.hpp"
#include "engine/kv_cache.hpp"
#include "engine/workspace.hpp"
#include "gpt2attn/gpt2attn.hpp"
#include "tests/file_test_util.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using detail::kHugePageBytes;

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Whether the kernel would back the mapping holding p with huge pages (smaps "THPeligible: 1"); nullopt when
// the kernel does not say (no smaps field), or has transparent huge pages off altogether.
std::optional<bool> thp_eligible(const void* p) {
  std::ifstream mode("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string m((std::istreambuf_iterator<char>(mode)), std::istreambuf_iterator<char>());
  if (m.empty() || m.find("[never]") != std::string::npos) return std::nullopt;
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      return line.find('1') != std::string::npos;
    }
  }
  return std::nullopt;
}

TEST(Buffer, SmallBuffersAre64ByteAlignedAndRoundedTo64) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{64}, size_t{100}, kHugePageBytes - 1}) {
    const detail::Buffer b = detail::allocate_buffer(n, "test");
    ASSERT_NE(b, nullptr) << n;
    EXPECT_TRUE(aligned(b.get(), 64)) << n;
    EXPECT_EQ(detail::buffer_capacity(n), n == 0 ? 64 : (n + 63) / 64 * 64) << n;
  }
}

TEST(Buffer, LargeBuffersSitOnHugePageBoundariesWithTheAdvice) {
  const size_t n = 3 * kHugePageBytes + 5;
  EXPECT_EQ(detail::buffer_capacity(n), 4 * kHugePageBytes);
  const detail::Buffer b = detail::allocate_buffer(n, "test");
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(aligned(b.get(), kHugePageBytes));
  if (const auto eligible = thp_eligible(b.get())) {
    EXPECT_TRUE(*eligible);
  }
  // The advice changes where the bytes live, not what they hold.
  for (size_t i = 0; i < n; i += 4096) b.get()[i] = std::byte(i / 4096);
  for (size_t i = 0; i < n; i += 4096) ASSERT_EQ(b.get()[i], std::byte(i / 4096));
}

TEST(Buffer, RefusesSizesPastMemoryAndSizeT) {
  EXPECT_TRUE(testutil::ThrowsError([] { detail::allocate_buffer(SIZE_MAX - 3, "the test buffer"); },
                                     ErrorCode::invalid_argument, "overflow"));
  EXPECT_TRUE(testutil::ThrowsError([] { detail::allocate_buffer(size_t{1} << 62, "the test buffer"); },
                                     ErrorCode::out_of_memory, "the test buffer"));
}

// What decode streams every step: the pool, the packed weights, and a grown workspace.
TEST(Buffer, DecodeStreamsHugePageBuffers) {
  Config c = test::small_causal_config(1024);
  KvCacheOptions o;
  o.capacity_bytes = 2 * kHugePageBytes;
  KvCache cache(c, o);
  EXPECT_TRUE(aligned(cache.impl().pool.get(), kHugePageBytes)) << cache.capacity_bytes();
  if (const auto eligible = thp_eligible(cache.impl().pool.get())) {
    EXPECT_TRUE(*eligible);
  }

  Workspace ws;
  std::byte* p = ws.impl().reserve(kHugePageBytes);
  EXPECT_TRUE(aligned(p, kHugePageBytes));
  EXPECT_EQ(ws.bytes(), kHugePageBytes);
}

}  // namespace
}  // namespace gpt2attn
