// tools/npy.cpp: the .npy reader (versions 1.0-3.0; float16/32/64 widen to f32, uint8/bool to u8) and the
// atomic float32 writer. The header dict is parsed by a small literal parser, never evaluated.
#include "tools/npy.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>

#include "gpt2attn/error.hpp"
#include "support/file_io.hpp"

namespace gpt2attn::npy {
namespace {

constexpr char kMagic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Parses the Python literal numpy writes, e.g. {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }.
// Exactly the three keys numpy requires, each once; anything else is a bad_file error quoting the header.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  Header parse() {
    Header h;
    bool seen_descr = false, seen_fortran = false, seen_shape = false;
    skip_ws();
    expect('{');
    for (;;) {
      skip_ws();
      if (peek() == '}') break;
      const std::string key = string_literal();
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        once(seen_descr, key);
        if (peek() == '[') error("structured dtypes (a list 'descr') are not supported");
        h.descr = string_literal();
      } else if (key == "fortran_order") {
        once(seen_fortran, key);
        h.fortran_order = bool_literal();
      } else if (key == "shape") {
        once(seen_shape, key);
        h.shape = shape_tuple();
      } else {
        error("unexpected key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != '}') error("expected ',' or '}' after the value of '" + key + "'");
    }
    ++pos_;  // the '}'
    skip_ws();
    if (pos_ != s_.size()) error("unexpected text after the closing '}'");
    if (!seen_descr) error("missing 'descr'");
    if (!seen_fortran) error("missing 'fortran_order'");
    if (!seen_shape) error("missing 'shape'");
    return h;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    std::string shown(s_.substr(0, 120));
    for (char& c : shown)
      if (c == '\n' || c == '\0') c = ' ';
    io::file_error(path_, "bad header: " + what + " (header: \"" + shown + (s_.size() > 120 ? "...\")" : "\")"));
  }

  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c) error(std::string("expected '") + c + "'");
    ++pos_;
  }
  void once(bool& seen, const std::string& key) {
    if (seen) error("duplicate key '" + key + "'");
    seen = true;
  }

  std::string string_literal() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') error("expected a quoted string");
    const size_t start = ++pos_;
    while (pos_ < s_.size() && s_[pos_] != quote) {
      // numpy never writes escapes in these keys or dtype strings; refusing them keeps the parser honest.
      if (s_[pos_] == '\\') error("escape sequences in strings are not supported");
      ++pos_;
    }
    if (pos_ == s_.size()) error("unterminated string");
    return std::string(s_.substr(start, pos_++ - start));
  }

  bool bool_literal() {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    error("'fortran_order' must be True or False");
  }

  int64_t dimension() {
    if (peek() == '-') error("negative dimension in 'shape'");
    if (peek() < '0' || peek() > '9') error("expected an integer in 'shape'");
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) error("dimension in 'shape' overflows int64");
      v = v * 10 + digit;
      ++pos_;
    }
    if (peek() == 'L') ++pos_;  // Python 2 long suffix, written by old numpy
    return v;
  }

  // (), (n,), (a, b) and so on; "(n)" is an int in Python, not a 1-d shape, so it is refused like numpy does.
  std::vector<int64_t> shape_tuple() {
    expect('(');
    std::vector<int64_t> dims;
    skip_ws();
    if (peek() == ')') {
      ++pos_;
      return dims;
    }
    bool trailing_comma = false;
    for (;;) {
      skip_ws();
      dims.push_back(dimension());
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        skip_ws();
        if (peek() == ')') {
          trailing_comma = true;
          ++pos_;
          break;
        }
        continue;
      }
      expect(')');
      break;
    }
    if (dims.size() == 1 && !trailing_comma) error("'shape' (n) is not a tuple; a 1-d shape is written (n,)");
    return dims;
  }

  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

struct Dtype {
  Kind kind;
  uint64_t itemsize;
  const char* name;  // numpy's name, used in messages
  bool is_bool = false;
};

Dtype parse_descr(const std::string& descr, const std::string& path) {
  const std::string supported = " (supported: <f2, <f4, <f8, |u1, |b1)";
  if (descr.size() >= 2 && descr[0] == '>') {
    io::file_error(path, "big-endian dtype '" + descr +
                             "' is not supported; convert with arr.astype(arr.dtype.newbyteorder('<'))");
  }
  if (descr.size() == 3) {
    const char order = descr[0];
    const std::string type = descr.substr(1);
    // '=' is native order, which static_assert in support/file_io.hpp pins to little-endian.
    const bool little = order == '<' || order == '=';
    if (little && type == "f2") return {Kind::f32, 2, "float16"};
    if (little && type == "f4") return {Kind::f32, 4, "float32"};
    if (little && type == "f8") return {Kind::f32, 8, "float64"};
    // Byte order is meaningless for one-byte types; numpy writes '|', but '<' and '=' mean the same.
    if ((little || order == '|') && type == "u1") return {Kind::u8, 1, "uint8"};
    if ((little || order == '|') && type == "b1") return {Kind::u8, 1, "bool", true};
  }
  io::file_error(path, "unsupported dtype '" + descr + "'" + supported);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  if (shape.empty()) return "scalar";
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += 'x';  // two appends: `(i ? "x" : "") + to_string(...)` trips GCC 12's -Wrestrict (PR 105329)
    s += std::to_string(shape[i]);
  }
  return s;
}

// numpy's repr of a shape tuple: (), (5,), (3, 4).
std::string shape_tuple_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

// read() and parse(): the whole format, from a file or from memory.
Array parse_from(io::ByteSource& src) {
  const std::string& path = src.path();
  const uint64_t size = src.size();

  // Prefix: magic (6), version major/minor (2), header length (2 bytes in 1.0, 4 bytes in 2.0 and 3.0).
  unsigned char prefix[12] = {};
  src.read(prefix, std::min<uint64_t>(size, 8));
  if (size < sizeof kMagic || std::memcmp(prefix, kMagic, sizeof kMagic) != 0)
    io::file_error(path, "bad magic: not a .npy file");
  if (size < 8) io::file_error(path, "truncated header: file ends inside the version field");
  const int major = prefix[6], minor = prefix[7];
  if (major < 1 || major > 3 || minor != 0)
    io::file_error(path, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor));
  const uint64_t len_bytes = major == 1 ? 2 : 4;
  const uint64_t prefix_size = 8 + len_bytes;
  if (size < prefix_size) io::file_error(path, "truncated header: file ends inside the header length field");
  src.read(prefix + 8, len_bytes);
  uint64_t header_len = 0;
  for (uint64_t i = len_bytes; i-- > 0;) header_len = (header_len << 8) | prefix[8 + i];
  if (header_len > size - prefix_size)
    io::file_error(path, "truncated header: header length says " + std::to_string(header_len) + " bytes but only " +
                             std::to_string(size - prefix_size) + " follow");

  std::string text(header_len, '\0');
  src.read(text.data(), header_len);
  const Header h = HeaderParser(text, path).parse();
  if (h.fortran_order)
    io::file_error(path, "fortran_order is True; only C-order arrays are read (save np.ascontiguousarray(a))");
  const Dtype dt = parse_descr(h.descr, path);

  uint64_t numel = 1, bytes = 0;
  for (int64_t d : h.shape)
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      io::file_error(path, "shape " + shape_tuple_text(h.shape) + " overflows the element count");
  if (__builtin_mul_overflow(numel, dt.itemsize, &bytes))
    io::file_error(path, "shape " + shape_tuple_text(h.shape) + " overflows the byte count");
  // An empty array's payload bounds none of its other dimensions: refused as numpy refuses (0, 2^32, 2^32) ("array is
  // too big"), so that the row-major strides a consumer derives from the shape fit int64.
  if (numel == 0) {
    uint64_t extent = dt.itemsize;
    for (int64_t d : h.shape)
      if (d != 0 && (__builtin_mul_overflow(extent, static_cast<uint64_t>(d), &extent) ||
                     extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
        io::file_error(path, "shape " + shape_tuple_text(h.shape) +
                                 " is too large for any array, even an empty one (its non-zero dimensions span over "
                                 "2^63 bytes; numpy refuses it too)");
  }

  const uint64_t payload = size - prefix_size - header_len;
  if (payload != bytes) {
    const std::string expected = "header says " + shape_text(h.shape) + " " + dt.name + " (" + std::to_string(bytes) +
                                 " bytes) but " + std::to_string(payload) + " bytes follow";
    io::file_error(path, (payload < bytes ? "truncated payload: " : "trailing bytes after the payload: ") + expected);
  }

  Array a;
  a.kind = dt.kind;
  a.descr = h.descr;
  a.shape = h.shape;
  // From here every allocation is bounded by the file size, which the comparison above guarantees.
  if (dt.kind == Kind::u8) {
    a.u8.resize(numel);
    src.read(a.u8.data(), bytes);
    if (dt.is_bool)
      for (uint8_t& v : a.u8) v = v != 0;
    return a;
  }
  a.f32.resize(numel);
  if (dt.itemsize == 4) {
    src.read(a.f32.data(), bytes);
    return a;
  }
  std::vector<unsigned char> raw(bytes);
  src.read(raw.data(), bytes);
  for (uint64_t i = 0; i < numel; ++i) {
    if (dt.itemsize == 2) {
      uint16_t h16;
      std::memcpy(&h16, raw.data() + 2 * i, 2);
      a.f32[i] = io::f16_to_f32(h16);
    } else {
      double d;
      std::memcpy(&d, raw.data() + 8 * i, 8);
      a.f32[i] = static_cast<float>(d);
      // A finite double past float32's range would arrive as an infinity the file does not hold, and the finiteness
      // check would then report that infinity; say what happened instead.
      if (std::isfinite(d) && !std::isfinite(a.f32[i])) {
        char value[32];  // the shortest text that reads back as d
        const auto end = std::to_chars(value, value + sizeof value, d).ptr;
        io::file_error(path, "element " + std::to_string(i) + " (flat index) is " + std::string(value, end) +
                                 ", beyond float32's range (|x| <= 3.4028235e+38); the CLI computes in float32");
      }
    }
  }
  return a;
}

}  // namespace

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // read() proved the product fits
  return n;
}

Array read(const std::string& path) {
  io::ByteSource src(path);  // opened here: an unreadable file is "cannot open" even when too short for a magic
  return parse_from(src);
}

Array parse(const std::string& path, const uint8_t* bytes, size_t size) {
  io::ByteSource src(path, bytes, size);
  return parse_from(src);
}

void write_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) invalid("npy::write_f32(" + path + "): negative dimension in shape " + shape_tuple_text(shape));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) || numel > (uint64_t{1} << 61))
      invalid("npy::write_f32(" + path + "): shape " + shape_tuple_text(shape) + " overflows");
  }
  if (numel > 0 && data == nullptr) invalid("npy::write_f32(" + path + "): data is null");

  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_tuple_text(shape) + ", }";
  // numpy pads with spaces and ends with '\n' so the data starts 64-byte aligned (10 = magic + version + len).
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 0xFFFF) invalid("npy::write_f32(" + path + "): shape has too many dimensions for a 1.0 header");

  io::write_atomically(path, [&](std::ostream& out) {
    out.write(kMagic, sizeof kMagic);
    const char version_and_len[4] = {1, 0, static_cast<char>(header.size() & 0xFF),
                                     static_cast<char>(header.size() >> 8)};
    out.write(version_and_len, 4);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    if (numel > 0) out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(numel * 4));
  });
}

void check_write_target(const std::string& path) { (void)io::resolve_write_target(path); }

}  // namespace gpt2attn::npy
