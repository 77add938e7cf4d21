// engine/io/file_io.hpp: small pieces shared by the npy and safetensors readers and writers: bad_file errors,
// checked file sizes and reads, atomic writes (and where they may land), f16/bf16 widening. No format knowledge.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "gpt2attn/error.hpp"

namespace gpt2attn::io {

// The readers copy little-endian file bytes straight into host integers and floats.
static_assert(std::endian::native == std::endian::little, "gpt2attn's file readers assume a little-endian host");

[[noreturn]] inline void file_error(const std::string& path, const std::string& problem) {
  fail(ErrorCode::bad_file, path + ": " + problem);
}

// Size of a regular file; a missing path or a directory is a bad_file error, not a 0-byte read.
inline uint64_t file_size(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) file_error(path, "cannot open: no such file");
  if (!std::filesystem::is_regular_file(status)) file_error(path, "cannot open: not a regular file");
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) file_error(path, "cannot open: " + ec.message());
  return size;
}

inline std::ifstream open_for_read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) file_error(path, std::string("cannot open: ") + std::strerror(errno));
  return in;
}

// Callers have already checked the byte count against the file size, so a short read here means the
// file changed underneath us or the device failed.
inline void read_exact(std::ifstream& in, const std::string& path, void* dst, uint64_t n) {
  if (n == 0) return;
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  if (static_cast<uint64_t>(in.gcount()) != n) file_error(path, "read failed (file shrank while reading?)");
}

// A file's bytes read front to back, from disk or from memory: each reader has one parser that both its read(path)
// and its in-memory parse(path, bytes) run, so a file and the same bytes in memory give the same result and the same
// messages (the fuzz targets use the in-memory one). A file is opened at the first read, or by open().
class ByteSource {
 public:
  // The file at `path`, `size` bytes long (file_size(path)).
  ByteSource(const std::string& path, uint64_t size) : path_(path), size_(size) {}
  // `size` bytes at `data`, which the caller keeps alive; `path` only names them in messages.
  ByteSource(const std::string& path, const void* data, uint64_t size)
      : path_(path), size_(size), mem_(static_cast<const unsigned char*>(data)), in_memory_(true) {}

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  void open() {
    if (!in_memory_ && !in_.is_open()) in_ = open_for_read(path_);
  }
  // The next n bytes. Parsers check n against size() before reading, so running past the end is their bug.
  void read(void* dst, uint64_t n) {
    if (n == 0) return;
    if (n > size_ - pos_) fail(ErrorCode::internal, path_ + ": read of " + std::to_string(n) + " bytes past the end");
    if (in_memory_) {
      std::memcpy(dst, mem_ + pos_, n);
    } else {
      open();
      read_exact(in_, path_, dst, n);
    }
    pos_ += n;
  }

 private:
  std::string path_;
  uint64_t size_ = 0, pos_ = 0;
  const unsigned char* mem_ = nullptr;  // may be null for 0 bytes
  bool in_memory_ = false;
  std::ifstream in_;
};

inline uint64_t load_le_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Where a write to `path` lands: the one policy every writer shares, so that replacing a file by rename
// never replaces something that is not a file.
// - A symbolic link (or chain of links) to an existing file is followed: the data goes to the final target,
//   written next to it and renamed onto it, and the link survives. A link to a missing file is refused
//   rather than guessed at.
// - A path that does not exist yet is created in its parent directory, itself resolved through links.
// - An existing target that is not a regular file (a character device such as /dev/null, a FIFO, a socket,
//   a directory) is refused: the rename would replace it with a regular file, and as root that means
//   replacing /dev/null.
// Returns the resolved path; throws bad_file naming `path`. The check and the later rename are not one
// atomic step: a target swapped for a special file in between is still replaced.
inline std::string resolve_write_target(const std::string& path) {
  auto real = [&](const std::string& p, const std::string& what) {
    char* r = ::realpath(p.c_str(), nullptr);
    if (r == nullptr) file_error(path, "cannot write: " + what + ": " + std::strerror(errno));
    std::string s = r;
    std::free(r);
    return s;
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {  // exists, links followed
    const std::string target = real(path, "cannot resolve it");
    if (!S_ISREG(st.st_mode)) {
      struct stat lst {};
      const bool link = ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode);
      const std::string why = "the atomic write would rename a new file over it";
      file_error(path, "not a regular file (" + (link ? "a link to " + target + "; " : std::string()) + why + ")");
    }
    return target;
  }
  if (errno != ENOENT) file_error(path, std::string("cannot write: ") + std::strerror(errno));
  if (::lstat(path.c_str(), &st) == 0) file_error(path, "cannot write: a symbolic link to a missing file");
  const std::filesystem::path p(path);
  if (p.filename().empty()) file_error(path, "cannot write: not a file name");
  const std::string dir = p.parent_path().empty() ? std::string(".") : p.parent_path().string();
  return (std::filesystem::path(real(dir, "directory " + dir)) / p.filename()).string();
}

// Writes through `body(std::ostream&)` into a temporary file next to the target (resolve_write_target():
// links followed, special files refused) and renames it onto the target, so readers see either the old
// file or the complete new one, never a partial one. The temporary is removed on every failure path,
// including an exception from `body`.
template <class Body>
void write_atomically(const std::string& path, Body&& body) {
  const std::string target = resolve_write_target(path);
  const std::string tmp = target + ".tmp." + std::to_string(::getpid());
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) file_error(path, "cannot create temporary file " + tmp + ": " + std::strerror(errno));
    body(out);
    out.close();
    if (out.fail()) file_error(path, "write to " + tmp + " failed (disk full?)");
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    file_error(path, "cannot rename " + tmp + " onto " + target + ": " + std::strerror(err));
  }
}

// IEEE binary16 -> binary32, exact for every input: normals rebias the exponent (127 - 15 = 112),
// subnormals are man * 2^-24 (exactly representable in f32), inf/nan keep sign and payload.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(man), -24);
    return sign ? -mag : mag;
  }
  const uint32_t bits = exp == 0x1F ? (sign | 0x7F800000u | (man << 13))
                                    : (sign | ((exp + 112u) << 23) | (man << 13));
  return std::bit_cast<float>(bits);
}

// bfloat16 is the high half of a binary32, so widening is a shift.
inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

}  // namespace gpt2attn::io
