// support/file_io.hpp. support/: header-only pieces with no library state, used by the library and its tools alike.
// What the library's safetensors and config readers and the CLI's .npy reader and writer share: bad_file errors,
// checked file sizes and reads, atomic writes (and where they may land), f16/bf16 widening. No format knowledge.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <system_error>
#include <utility>

#include "gpt2attn/error.hpp"

namespace gpt2attn::io {

// The readers copy little-endian file bytes straight into host integers and floats.
static_assert(std::endian::native == std::endian::little, "gpt2attn's file readers assume a little-endian host");

[[noreturn]] inline void file_error(const std::string& path, const std::string& problem) {
  fail(ErrorCode::bad_file, path + ": " + problem);
}

// Error(bad_file) when `text`, the JSON of `path` (what: "header", "config"), starts with a UTF-8 byte-order mark.
// nlohmann skips one, but the safetensors format has none (its reference reader, serde_json, refuses one) and
// neither does a config.json that Hugging Face or gpt2attn writes: every JSON reader here applies this one rule,
// so a file is not accepted by one reader and refused by the other.
inline void refuse_byte_order_mark(const std::string& text, const std::string& path, const std::string& what) {
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) {
    file_error(path, what + " is not valid JSON: it starts with a UTF-8 byte-order mark (EF BB BF); save it as "
                            "UTF-8 without one");
  }
}

// What a path that is not a regular file is, for messages.
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "of an unknown type";
}

// A regular file opened for reading, links followed: the one way every reader opens its input. The path is looked
// up first and anything but a regular file refused without being opened (opening a FIFO releases a writer waiting
// on it, and opening some devices has effects of its own). Then the file is opened (O_NONBLOCK, so that a FIFO
// swapped in meanwhile cannot block the open; O_NOCTTY) and the descriptor itself checked: still a regular file. Its
// type and size are then the descriptor's, so a path swapped between the check and the open cannot slip a FIFO (a
// read that blocks for good) or a device (/dev/zero, read until memory runs out) past the checks. (A regular file
// swapped in is read as what it is; no identity check, which some filesystems would fail for the same file.)
// O_NONBLOCK is cleared before reading. Errors are bad_file naming the path: "cannot open[ <noun>]: no such file"
// (or the system's reason) and "not a regular file (a FIFO)[; a <noun> must be one]".
class ReadFile {
 public:
  explicit ReadFile(const std::string& path, const std::string& noun = "") : path_(path) {
    const std::string what = noun.empty() ? "cannot open" : "cannot open " + noun;
    const auto refuse = [&](int err) {
      file_error(path, what + ": " + (err == ENOENT ? std::string("no such file") : std::strerror(err)));
    };
    const auto not_regular = [&](mode_t mode) {
      file_error(path, std::string("not a regular file (") + file_kind(mode) + ")" +
                           (noun.empty() ? "" : "; a " + noun + " must be one"));
    };
    struct stat looked {};
    if (::stat(path.c_str(), &looked) != 0) refuse(errno);
    if (!S_ISREG(looked.st_mode)) not_regular(looked.st_mode);
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd_ < 0) refuse(errno);
    struct stat st {};
    const int fstat_err = ::fstat(fd_, &st) != 0 ? errno : 0;
    const int flags = fstat_err == 0 ? ::fcntl(fd_, F_GETFL) : -1;
    const bool blocking = flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) == 0;
    const int fcntl_err = blocking ? 0 : errno;
    if (fstat_err != 0 || !S_ISREG(st.st_mode) || !blocking) {
      ::close(fd_);
      fd_ = -1;
      if (fstat_err != 0) refuse(fstat_err);
      if (!S_ISREG(st.st_mode)) not_regular(st.st_mode);
      refuse(fcntl_err);
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ReadFile(ReadFile&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  ReadFile& operator=(ReadFile&&) = delete;
  ReadFile(const ReadFile&) = delete;
  ~ReadFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  uint64_t size() const { return size_; }  // when opened
  // Bytes [offset, offset + n). Callers have checked them against size(), so a short read means the file shrank
  // underneath us or the device failed.
  void read_at(uint64_t offset, void* dst, uint64_t n) const {
    auto* p = static_cast<unsigned char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, std::min<uint64_t>(n, uint64_t{1} << 30), static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) file_error(path_, std::string("read failed: ") + std::strerror(errno));
      if (got == 0) file_error(path_, "read failed (file shrank while reading?)");
      p += got, offset += static_cast<uint64_t>(got), n -= static_cast<uint64_t>(got);
    }
  }
  // Whether a byte lies past size(): the file grew after it was opened, or is a /proc-like file whose size says 0.
  bool grew() const {
    unsigned char more = 0;
    for (;;) {
      const ssize_t got = ::pread(fd_, &more, 1, static_cast<off_t>(size_));
      if (got < 0 && errno == EINTR) continue;
      return got > 0;
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A file's bytes read front to back, from disk or from memory: each reader has one parser that both its read(path)
// and its in-memory parse(path, bytes) run, so a file and the same bytes in memory give the same result and the same
// messages (the fuzz targets use the in-memory one). A file is opened, and its type checked, at construction.
class ByteSource {
 public:
  // The regular file at `path` (ReadFile: opened, its type checked, its size taken, all on one descriptor).
  explicit ByteSource(const std::string& path) : path_(path), file_(std::in_place, path) { size_ = file_->size(); }
  // `size` bytes at `data`, which the caller keeps alive; `path` only names them in messages.
  ByteSource(const std::string& path, const void* data, uint64_t size)
      : path_(path), size_(size), mem_(static_cast<const unsigned char*>(data)), in_memory_(true) {}

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  const ReadFile* file() const { return file_ ? &*file_ : nullptr; }  // null for bytes in memory
  // The next n bytes. Parsers check n against size() before reading, so running past the end is their bug.
  void read(void* dst, uint64_t n) {
    if (n == 0) return;
    if (n > size_ - pos_) fail(ErrorCode::internal, path_ + ": read of " + std::to_string(n) + " bytes past the end");
    if (in_memory_) {
      std::memcpy(dst, mem_ + pos_, n);
    } else {
      file_->read_at(pos_, dst, n);
    }
    pos_ += n;
  }

 private:
  std::string path_;
  std::optional<ReadFile> file_;
  uint64_t size_ = 0, pos_ = 0;
  const unsigned char* mem_ = nullptr;  // may be null for 0 bytes
  bool in_memory_ = false;
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

// An output stream buffer over a file descriptor, which std::ofstream cannot be opened on. Writes in 64 KiB runs,
// retrying on EINTR and short writes; a failed write makes the stream fail.
class FdOutBuf : public std::streambuf {
 public:
  explicit FdOutBuf(int fd) : fd_(fd) { setp(buf_, buf_ + sizeof buf_); }

 protected:
  int_type overflow(int_type ch) override {
    if (sync() != 0) return traits_type::eof();
    if (!traits_type::eq_int_type(ch, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(ch);
      pbump(1);
    }
    return traits_type::not_eof(ch);
  }
  int sync() override {
    for (const char* p = pbase(); p < pptr();) {
      const ssize_t n = ::write(fd_, p, static_cast<size_t>(pptr() - p));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return -1;
      p += n;
    }
    setp(buf_, buf_ + sizeof buf_);
    return 0;
  }

 private:
  int fd_;
  char buf_[size_t{1} << 16];
};

// Writes through `body(std::ostream&)` into a temporary file next to the target (resolve_write_target():
// links followed, special files refused) and renames it onto the target, so readers see either the old
// file or the complete new one, never a partial one. The temporary is created exclusively (O_CREAT | O_EXCL, which
// also refuses a symbolic link planted at its name), takes the mode of the file it replaces (a new file gets 0666
// less the umask), and is removed on every failure path, including an exception from `body`.
template <class Body>
void write_atomically(const std::string& path, Body&& body) {
  const std::string target = resolve_write_target(path);
  struct stat old {};
  const bool replaces = ::stat(target.c_str(), &old) == 0;
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    tmp = target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(attempt);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) file_error(path, "cannot create temporary file " + tmp + ": " + std::strerror(errno));
  }
  if (fd < 0) file_error(path, "cannot create a temporary file next to it: 100 names taken (" + tmp + ")");
  try {
    if (replaces && ::fchmod(fd, old.st_mode & 07777) != 0) {
      file_error(path, "cannot give " + tmp + " the mode of " + target + ": " + std::strerror(errno));
    }
    FdOutBuf buf(fd);
    std::ostream out(&buf);
    body(out);
    out.flush();
    if (out.fail()) file_error(path, "write to " + tmp + " failed: " + std::strerror(errno));
    if (::close(std::exchange(fd, -1)) != 0) file_error(path, "write to " + tmp + " failed: " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
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
