// tests/file_test_util.hpp: helpers for the file-reader tests: a fresh temporary directory per test, raw byte
// files, and an assertion that a call throws gpt2attn::Error with a given code and message word. Test-only.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"

namespace gpt2attn::testutil {

namespace fs = std::filesystem;

// Each test gets its own directory (pid + counter keeps parallel ctest runs apart), removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / ("gpt2attn_io_" + std::to_string(::getpid()) + "_" +
                                             std::to_string(counter++) + "_" + info->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Little-endian bytes of any trivially copyable values (the library itself requires a little-endian host).
template <class T>
std::string le_bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// EXPECT_TRUE(ThrowsError([&] { ... }, ErrorCode::bad_file, "magic")): the right type, code and message word.
template <class F>
::testing::AssertionResult ThrowsError(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (e.code() != code)
      return ::testing::AssertionFailure() << "error code " << static_cast<int>(e.code()) << ", expected "
                                           << static_cast<int>(code) << ": " << msg;
    if (msg.find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message lacks \"" << needle << "\": " << msg;
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-gpt2attn exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace gpt2attn::testutil
