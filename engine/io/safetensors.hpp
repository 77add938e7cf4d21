// engine/io/safetensors.hpp: a strict reader of the safetensors format (8-byte LE header length, JSON header,
// raw little-endian tensor bytes). Only the parsing; mapping names to Weights is in weights_io.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpt2attn/tensor.hpp"

namespace gpt2attn::safetensors {

struct Tensor {
  std::string dtype;            // "F32", "F16", "BF16" (others are listed but cannot be converted)
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data section
};

// A file's data section: read into memory (read, parse), or mapped read-only from the file (map). Copies share it.
class Bytes {
 public:
  Bytes() = default;
  // n bytes of new memory, which `writable` points at until they are filled.
  static Bytes allocate(uint64_t n, uint8_t*& writable);
  // n bytes at p, kept alive by `owner` (a mapping).
  Bytes(std::shared_ptr<const void> owner, const uint8_t* p, uint64_t n) : owner_(std::move(owner)), p_(p), n_(n) {}
  const uint8_t* data() const { return p_; }
  uint64_t size() const { return n_; }
  const uint8_t* begin() const { return p_; }
  const uint8_t* end() const { return p_ + n_; }

 private:
  std::shared_ptr<const void> owner_;
  const uint8_t* p_ = nullptr;
  uint64_t n_ = 0;
};

struct File {
  std::string path;
  std::map<std::string, Tensor> tensors;  // "__metadata__" excluded
  std::map<std::string, std::string> metadata;  // "__metadata__"'s string pairs ({"format": "pt"}); empty without one
  Bytes data;                             // the data section (everything after the header)

  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  // A contiguous view of the tensor's bytes in `data`, as stored (F32, F16 or BF16; not necessarily aligned);
  // throws Error(bad_file) for other dtypes or a rank past 4, invalid_argument for a name the file lacks.
  TensorView view(const std::string& name) const;
  // The tensor converted to f32, flat (exact for F32, F16 and BF16); the same errors as view().
  std::vector<float> to_f32(const std::string& name) const;
};

// Checks: file size >= 8, header length <= file size - 8 and <= 100 MB, valid JSON object with no key twice in
// any one object, every entry has dtype/shape/data_offsets of the right types, known dtype, non-negative shape
// whose byte size equals end - begin, begin <= end <= data size, no overflow (an empty tensor's non-zero dimensions
// too: their byte count fits int64, as numpy requires); and the offsets tile the data
// section exactly: sorted by (begin, end), the first starts at 0, each starts where the previous non-empty one
// ends (no overlap, no gap; an empty tensor may sit only at such a boundary), the last ends at the data size (no
// trailing bytes). Throws Error(bad_file) naming path + tensor(s) (or the duplicated key); a file cut short names
// the tensor it ends in (the earliest by offset of those past its end).
File read(const std::string& path);
// The same checks, with the data section mapped read-only instead of read (mmap): only the pages a caller touches are
// read from disk and held, so a tensor-parallel rank that reads its slices of a layer holds those slices, not the
// file. The file must not shrink while the File lives (a read of a page past its new end raises SIGBUS, as with any
// mapped file); the size is checked again after mapping.
File map(const std::string& path);
// The same checks and messages over a file's bytes already in memory (the fuzz targets); `path` names them in
// messages and becomes File::path.
File parse(const std::string& path, const uint8_t* bytes, size_t size);

// One tensor for write(): its bytes exactly as the file stores them (row-major, little-endian), held by the caller
// until write() returns.
struct TensorBytes {
  std::string name;
  std::string dtype;            // one read() knows: "F32", "I8", "U8", ...
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t size = 0;            // bytes: the shape's element count x the dtype's size
};

// Writes a safetensors file of `tensors`, their bytes in the order given, with `metadata` as its "__metadata__"
// (none when empty), atomically (a temporary file renamed over `path`). Throws invalid_argument for an empty,
// reserved or repeated name, an unknown dtype, or a size that is not the shape's; Error(bad_file) when the file cannot
// be written.
void write(const std::string& path, const std::vector<TensorBytes>& tensors,
           const std::map<std::string, std::string>& metadata = {});

// write() of F32 tensors given as values (tests and `gpt2attn` tooling).
void write_f32(const std::string& path,
               const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>>& tensors);

}  // namespace gpt2attn::safetensors
