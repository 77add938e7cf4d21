// engine/io/safetensors.cpp: the strict safetensors reader (every header field, offset and size checked before
// any data is trusted), F32/F16/BF16 widening, and the atomic writer of tensors of any dtype. Knows nothing of
// attention layers.
#include "engine/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <vector>

#include "engine/convert.hpp"
#include "engine/util.hpp"
#include "gpt2attn/error.hpp"
#include "support/file_io.hpp"

namespace gpt2attn::safetensors {
namespace {

using nlohmann::json;

// The reference implementation's limit too: a larger header is a corrupt length, not a real checkpoint.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Bytes per element; 0 for an unknown dtype.
uint64_t dtype_size(const std::string& dtype) {
  static const std::pair<const char*, uint64_t> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1},
  };
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  return 0;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A JSON value that must be a non-negative integer; floats, negatives and values past uint64 are refused.
bool as_u64(const json& v, uint64_t& out) {
  if (!v.is_number_unsigned()) return false;
  out = v.get<uint64_t>();
  return true;
}

// A short rendering of a header value for messages. Arrays and objects are named, not dumped: dump() recurses,
// and a hostile header can nest a million levels deep.
std::string describe(const json& v) {
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  if (v.is_string()) return v.get_ref<const std::string&>().size() <= 40 ? v.dump() : "a long string";
  return v.is_array() ? "an array" : "an object";
}

// The two offsets as written, for messages: [begin, end] when both are scalars.
std::string describe_offsets(const json& v) {
  if (!v.is_array()) return describe(v);
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 4; ++i) s += (i ? ", " : "") + describe(v[i]);
  return s + (v.size() > 4 ? ", ...]" : "]");
}

Tensor parse_entry(const std::string& path, const std::string& name, const json& v) {
  const std::string where = "tensor '" + name + "': ";
  if (!v.is_object()) io::file_error(path, where + "header entry is not an object");
  const auto field = [&](const char* key) -> const json& {
    const auto it = v.find(key);
    if (it == v.end()) io::file_error(path, where + "missing '" + key + "'");
    return *it;
  };

  Tensor t;
  const json& dtype = field("dtype");
  if (!dtype.is_string()) io::file_error(path, where + "'dtype' is not a string");
  t.dtype = dtype.get<std::string>();
  const uint64_t itemsize = dtype_size(t.dtype);
  if (itemsize == 0)
    io::file_error(path, where + "unknown dtype '" + t.dtype + "' (known: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");

  const json& shape = field("shape");
  if (!shape.is_array()) io::file_error(path, where + "'shape' is not an array");
  for (const json& d : shape) {
    uint64_t dim = 0;
    if (d.is_number_integer() && !d.is_number_unsigned())
      io::file_error(path, where + "negative dimension " + describe(d) + " in 'shape'");
    if (!as_u64(d, dim) || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      io::file_error(path, where + "'shape' entry " + describe(d) + " is not a non-negative integer");
    t.shape.push_back(static_cast<int64_t>(dim));
  }

  const json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !as_u64(offsets[0], t.begin) || !as_u64(offsets[1], t.end))
    io::file_error(path, where + "'data_offsets' must be [begin, end] with non-negative integers, got " +
                             describe_offsets(offsets));
  if (t.begin > t.end)
    io::file_error(path, where + "data_offsets begin " + std::to_string(t.begin) + " > end " + std::to_string(t.end));

  uint64_t numel = 1, bytes = 0;
  for (int64_t d : t.shape)
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
      io::file_error(path, where + "shape " + shape_text(t.shape) + " overflows the element count");
  if (__builtin_mul_overflow(numel, itemsize, &bytes))
    io::file_error(path, where + "shape " + shape_text(t.shape) + " overflows the byte count");
  // An empty tensor's bytes bound none of its other dimensions: [0, 2^32, 2^32] passes the checks above, yet the
  // row-major strides that view() and every consumer derive from it overflow int64. Refused as numpy refuses such a
  // shape ("array is too big"): the non-zero dimensions' byte count must fit int64.
  if (numel == 0) {
    uint64_t extent = itemsize;
    for (int64_t d : t.shape)
      if (d != 0 && (__builtin_mul_overflow(extent, static_cast<uint64_t>(d), &extent) ||
                     extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
        io::file_error(path, where + "shape " + shape_text(t.shape) +
                                 " is too large for any tensor, even an empty one (its non-zero dimensions span over "
                                 "2^63 bytes)");
  }
  if (bytes != t.end - t.begin)
    io::file_error(path, where + "shape " + shape_text(t.shape) + " " + t.dtype + " needs " + std::to_string(bytes) +
                             " bytes but data_offsets span " + std::to_string(t.end - t.begin) + " bytes");
  return t;
}

// A file cut short leaves every tensor from the cut onwards running past the data section. The one named is the
// earliest by offset, the tensor the file ends inside (or, cut at a boundary, the first one missing): that is where
// the file was cut, where the first by name could be any of the tensors lost after it.
void check_within_data(const std::string& path, const std::map<std::string, Tensor>& tensors, uint64_t data_size) {
  const std::pair<const std::string, Tensor>* cut = nullptr;
  for (const auto& e : tensors) {
    const Tensor& t = e.second;
    if (t.end > data_size && (!cut || std::tie(t.begin, t.end) < std::tie(cut->second.begin, cut->second.end)))
      cut = &e;
  }
  if (!cut) return;
  io::file_error(path, "tensor '" + cut->first + "': data_offsets end " + std::to_string(cut->second.end) +
                           " is past the end of the data section (" + std::to_string(data_size) +
                           " bytes; truncated file?)");
}

// Parses the header, refusing a key that appears twice in one object: nlohmann keeps the last silently, while other
// readers (and the writer's intent) may take the first, so the file would mean different tensors to each.
json parse_header(const std::string& path, const std::string& text) {
  struct Object {
    std::string name;  // the key it is the value of, or of the array holding it ("" for the header itself)
    std::set<std::string> keys;
  };
  std::vector<Object> open;  // innermost last; at most one entry per nesting level the parser itself holds
  std::string last_key;
  const auto check_key = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open.push_back({last_key, {}});
    } else if (event == json::parse_event_t::object_end) {
      open.pop_back();
    } else if (event == json::parse_event_t::key) {
      last_key = parsed.get<std::string>();
      if (!open.back().keys.insert(last_key).second)
        io::file_error(path, "header has duplicate key '" + last_key + "'" +
                                 (open.size() > 1 ? " (in '" + open.back().name + "')" : std::string()));
    }
    return true;
  };
  io::refuse_byte_order_mark(text, path, "header");
  try {
    return json::parse(text, check_key);
  } catch (const json::exception& e) {
    io::file_error(path, std::string("header is not valid JSON: ") + e.what());
  }
}

// "[begin, end)". Built by appending: GCC 12 warns falsely (-Wrestrict) on "[" + std::to_string(...).
std::string span_text(const Tensor& t) {
  std::string s = "[";
  s += std::to_string(t.begin) + ", " + std::to_string(t.end) + ")";
  return s;
}

// The data section must be tiled exactly, as the reference reader requires: sorted by (begin, end), each tensor
// starts where the previous one ended, the first at 0, and the last ends at the data size. Anything else is two
// names for one byte, or bytes no tensor owns (room for a hidden payload). An empty tensor owns no byte, so it may
// sit at any boundary, several at one; one strictly inside another tensor is refused like a gap, not an overlap.
void check_layout(const std::string& path, const std::map<std::string, Tensor>& tensors, uint64_t data_size) {
  using Entry = std::map<std::string, Tensor>::value_type;
  std::vector<const Entry*> order;
  for (const Entry& e : tensors) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* x, const Entry* y) {
    return std::tie(x->second.begin, x->second.end, x->first) < std::tie(y->second.begin, y->second.end, y->first);
  });
  uint64_t covered = 0;         // bytes [0, covered) belong to the tensors seen so far
  const Entry* last = nullptr;  // the last non-empty tensor seen; it ends at `covered`
  for (const Entry* e : order) {
    const auto& [name, t] = *e;
    if (t.begin < covered) {
      if (t.begin == t.end)
        io::file_error(path, "empty tensor '" + name + "' at offset " + std::to_string(t.begin) +
                                 " lies inside tensor '" + last->first + "' " + span_text(last->second) +
                                 "; an empty tensor must sit at a boundary between tensors");
      io::file_error(path, "tensors '" + last->first + "' " + span_text(last->second) + " and '" + name + "' " +
                               span_text(t) + " overlap (data_offsets must not share bytes)");
    }
    if (t.begin > covered) {
      const std::string where =
          last ? "between '" + last->first + "' and '" + name + "'" : "before '" + name + "', the first";
      io::file_error(path, "bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                               ") of the data section belong to no tensor (" + where +
                               "); data_offsets must cover the data section without gaps");
    }
    if (t.end > t.begin) {
      covered = t.end;
      last = e;
    }
  }
  if (covered == data_size) return;
  if (!last)
    io::file_error(path, std::to_string(data_size) + " bytes of data but " +
                             (tensors.empty() ? "the header lists no tensors" : "every tensor in the header is empty"));
  io::file_error(path, std::to_string(data_size - covered) + " trailing bytes after the last tensor '" + last->first +
                           "', which ends at " + std::to_string(covered) + " of " + std::to_string(data_size) +
                           " (the data section must end where the last tensor does)");
}

// The file's bytes [offset, offset + n) mapped read-only, from the descriptor the header was read from; `total` is
// the size the header was checked against.
Bytes map_section(const io::ReadFile& file, uint64_t offset, uint64_t n, uint64_t total) {
  if (n == 0) return {};
  const std::string& path = file.path();
  struct stat st {};
  const bool same = ::fstat(file.fd(), &st) == 0 && static_cast<uint64_t>(st.st_size) == total;
  void* base = same ? ::mmap(nullptr, total, PROT_READ, MAP_PRIVATE, file.fd(), 0) : MAP_FAILED;
  const int map_errno = errno;
  if (!same) io::file_error(path, "changed size since it was opened");
  if (base == MAP_FAILED) io::file_error(path, std::string("cannot map: ") + std::strerror(map_errno));
  std::shared_ptr<const void> owner(base, [total](const void* p) { ::munmap(const_cast<void*>(p), total); });
  return Bytes(std::move(owner), static_cast<const uint8_t*>(base) + offset, n);
}

// A file of another format, named by its first bytes where they make no header length the file can hold (so a
// safetensors file is never mistaken for one): torch.save's zip archive or pickle (.pt, .bin), a .npy array, GGUF,
// HDF5; "header length ... over the 100 MB limit" is all such a file got before.
void refuse_other_format(const std::string& path, const unsigned char* b) {
  const auto starts = [&](const char* magic, size_t n) { return std::memcmp(b, magic, n) == 0; };
  const char* what = starts("PK\x03\x04", 4)   ? "a zip archive (torch.save's format: a .pt or .bin file)"
                     : b[0] == 0x80 && b[1] >= 2 && b[1] <= 5 ? "a Python pickle (an older torch.save .pt or .bin file)"
                     : starts("\x93NUMPY", 6)   ? "a .npy array"
                     : starts("GGUF", 4)         ? "a GGUF file"
                     : starts("\x89HDF", 4)     ? "an HDF5 file"
                                                : nullptr;
  if (!what) return;
  io::file_error(path, std::string(what) + ", not a safetensors file; a PyTorch state dict converts with "
                       "scripts/export_safetensors.py IN.pt OUT.safetensors");
}

// read(), map() and parse(): the whole format, from a file or from memory.
File parse_from(io::ByteSource& src, bool map_data = false) {
  const std::string& path = src.path();
  const uint64_t size = src.size();
  if (size == 0) io::file_error(path, "empty file (a safetensors file starts with an 8-byte header length)");
  if (size < 8)
    io::file_error(path, "too short: " + std::to_string(size) +
                             " bytes (a safetensors file starts with an 8-byte header length)");
  unsigned char len_bytes[8];
  src.read(len_bytes, 8);
  const uint64_t header_len = io::load_le_u64(len_bytes);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) refuse_other_format(path, len_bytes);
  if (header_len > kMaxHeaderBytes)
    io::file_error(path, "header length " + std::to_string(header_len) + " is over the 100 MB limit (corrupt file?)");
  if (header_len > size - 8)
    io::file_error(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                             std::to_string(size - 8) + " bytes follow)");

  std::string text(header_len, '\0');
  src.read(text.data(), header_len);
  // nlohmann stops at a NUL as if the input ended, which would accept "{}\0garbage"; the format says JSON only.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    io::file_error(path, "header is not valid JSON: NUL byte at offset " + std::to_string(nul));
  const json header = parse_header(path, text);
  if (!header.is_object())
    io::file_error(path, std::string("header JSON is not an object (it is ") + header.type_name() + ")");

  File f;
  f.path = path;
  const uint64_t data_size = size - 8 - header_len;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      // Free-form string annotations ({"format": "pt"}), kept for the readers that give them a meaning
      // (load_quantized's "gpt2attn.weights").
      if (!value.is_object()) io::file_error(path, "'__metadata__' is not an object");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) io::file_error(path, "'__metadata__' value for '" + key + "' is not a string");
        f.metadata.emplace(key, v.get<std::string>());
      }
      continue;
    }
    f.tensors.emplace(name, parse_entry(path, name, value));
  }
  check_within_data(path, f.tensors, data_size);
  check_layout(path, f.tensors, data_size);

  if (map_data) {
    if (!src.file()) fail(ErrorCode::internal, path + ": map() of bytes that are not a file");
    f.data = map_section(*src.file(), 8 + header_len, data_size, size);
    return f;
  }
  // Every tensor's bytes were proved to lie inside data_size, so this is the only large allocation.
  detail::check_fits_in_memory(static_cast<int64_t>(std::min<uint64_t>(data_size, INT64_MAX)),
                               (path + ": the data section").c_str());
  uint8_t* dst = nullptr;
  f.data = Bytes::allocate(data_size, dst);
  src.read(dst, data_size);
  return f;
}

}  // namespace

File read(const std::string& path) {
  io::ByteSource src(path);
  return parse_from(src);
}

File map(const std::string& path) {
  io::ByteSource src(path);
  return parse_from(src, true);
}

Bytes Bytes::allocate(uint64_t n, uint8_t*& writable) {
  if (n == 0) return {};
  std::shared_ptr<uint8_t[]> buf(new uint8_t[n]);
  writable = buf.get();
  return Bytes(std::shared_ptr<const void>(buf, buf.get()), buf.get(), n);
}

File parse(const std::string& path, const uint8_t* bytes, size_t size) {
  io::ByteSource src(path, bytes, size);
  return parse_from(src);
}

TensorView File::view(const std::string& name) const {
  const auto it = tensors.find(name);
  if (it == tensors.end()) invalid(path + ": no tensor named '" + name + "'");
  const Tensor& t = it->second;
  static const std::pair<const char*, DType> kTypes[] = {{"F32", DType::f32}, {"F16", DType::f16}, {"BF16", DType::bf16}};
  const auto type = std::find_if(std::begin(kTypes), std::end(kTypes), [&](const auto& k) { return t.dtype == k.first; });
  if (type == std::end(kTypes)) {
    io::file_error(path, "tensor '" + name + "' has dtype " + t.dtype + "; only F32, F16 and BF16 load as weights");
  }
  if (t.shape.size() > 4) {
    io::file_error(path, "tensor '" + name + "' has rank " + std::to_string(t.shape.size()) + "; at most 4 load");
  }
  // An empty tensor (or data section) has no bytes. parse() refused shapes whose strides overflow.
  return TensorView::contiguous(t.end > t.begin ? data.data() + t.begin : nullptr, type->second, t.shape);
}

std::vector<float> File::to_f32(const std::string& name) const {
  const TensorView v = view(name);
  return detail::f32_values(TensorView::contiguous(v.data, v.dtype, {v.numel()}));
}

void write(const std::string& path, const std::vector<TensorBytes>& tensors,
           const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorBytes& t : tensors) {
    const std::string where = "safetensors::write(" + path + "): tensor '" + t.name + "': ";
    if (t.name.empty() || t.name == "__metadata__") invalid(where + "reserved or empty name");
    if (header.contains(t.name)) invalid(where + "duplicate name");
    const uint64_t itemsize = dtype_size(t.dtype);
    if (itemsize == 0) invalid(where + "unknown dtype '" + t.dtype + "'");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) invalid(where + "negative dimension in shape " + shape_text(t.shape));
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) invalid(where + "shape overflows");
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(numel, itemsize, &bytes) || bytes != t.size)
      invalid(where + "shape " + shape_text(t.shape) + " " + t.dtype + " has " + std::to_string(numel) +
              " elements of " + std::to_string(itemsize) + " bytes but " + std::to_string(t.size) +
              " bytes were given");
    if (t.size > 0 && t.data == nullptr) invalid(where + "data is null");
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", json::array({offset, offset + t.size})}};
    offset += t.size;
  }
  std::string text = header.dump();
  // The format pads the header with spaces so the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  io::write_atomically(path, [&](std::ostream& out) {
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xFF);
    out.write(len, 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    // Tensors in the order given, which is the order the offsets above were assigned in.
    for (const TensorBytes& t : tensors)
      out.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(t.size));
  });
}

void write_f32(const std::string& path,
               const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>>& tensors) {
  std::vector<TensorBytes> all;
  for (const auto& [name, tensor] : tensors) {
    const auto& [shape, values] = tensor;
    // A shape write() refuses (negative, overflowing) is left to it; a count that is not the shape's is said here in
    // values, as the caller gave them.
    uint64_t numel = 1;
    bool refused = false;
    for (int64_t d : shape)
      refused = refused || d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
    if (!refused && numel != values.size())
      invalid("safetensors::write_f32(" + path + "): tensor '" + name + "': shape " + shape_text(shape) + " has " +
              std::to_string(numel) + " elements but " + std::to_string(values.size()) + " values were given");
    all.push_back({name, "F32", shape, values.data(), 4 * values.size()});
  }
  write(path, all);
}

}  // namespace gpt2attn::safetensors
