// tools/npy.hpp: NumPy .npy reading and writing for the CLI and the tests (format versions 1.0-3.0). Not part of the
// library: servers embedding gpt2attn pass TensorViews and need no file parser linked in.
// Reads trust nothing in the file; writes are atomic (temporary file + rename), so no partial output exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpt2attn::npy {

enum class Kind : uint8_t { f32, u8 };  // f32 holds float16/32/64 input, u8 holds bool/uint8 input

struct Array {
  Kind kind = Kind::f32;
  std::string descr;            // the file's dtype string, e.g. "<f8", "|b1"
  std::vector<int64_t> shape;   // C order
  std::vector<float> f32;       // filled when kind == f32 (converted from the file's float dtype)
  std::vector<uint8_t> u8;      // filled when kind == u8 (bool/uint8 values, bool normalised to 0/1)
  int64_t numel() const;
};

// Accepts little-endian <f2/<f4/<f8 (or '='), |u1, |b1; C order only. Fortran order, big-endian data,
// other dtypes, a bad magic, a truncated header or payload, a shape/size mismatch, or a shape no array can have (an
// empty one whose other dimensions span over 2^63 bytes, as numpy refuses) throw Error(bad_file) naming the path and
// the problem.
Array read(const std::string& path);
// The same checks and messages over a file's bytes already in memory (the fuzz targets); `path` names them in
// messages.
Array parse(const std::string& path, const uint8_t* bytes, size_t size);

// Writes a little-endian float32 C-order array. Throws Error(bad_file) if the file cannot be written.
void write_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
// Whether write_f32 may write to `path` (links followed; an existing path that is not a regular file, a link to a
// missing file, or a missing directory refused with Error(bad_file), as write_f32 would): for a check before any
// work is done. write_f32 checks again.
void check_write_target(const std::string& path);

}  // namespace gpt2attn::npy
