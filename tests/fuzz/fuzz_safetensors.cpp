// tests/fuzz/fuzz_safetensors.cpp: the safetensors reader on arbitrary bytes: parse(), then view() and to_f32() of
// every tensor, checking that what parse() accepted is self-consistent. The layer loader has its own target.
#include <bit>

#include "engine/io/safetensors.hpp"
#include "support/file_io.hpp"
#include "tests/fuzz/fuzz_targets.hpp"

namespace gpt2attn::fuzz {
namespace {

const std::string kPath = "fuzz-input.safetensors";

// Bytes per element of the dtypes the format lists; 0 for any other, which parse() must have refused.
uint64_t itemsize(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

// One tensor parse() accepted: its bytes lie in the data section, its shape accounts for them, and when it loads as
// weights the view covers exactly those bytes and to_f32() gives one exact value per element.
void check_tensor(const safetensors::File& f, const std::string& name, const safetensors::Tensor& t) {
  const std::string where = "tensor '" + name + "': ";
  check(t.begin <= t.end && t.end <= f.data.size(), where + "data_offsets outside the data section");
  const uint64_t bytes = t.end - t.begin, size = itemsize(t.dtype);
  check(size != 0, where + "parse() accepted dtype '" + t.dtype + "'");
  check(bytes % size == 0, where + "byte count is not a whole number of elements");
  uint64_t numel = 1;
  for (int64_t d : t.shape) {
    check(d >= 0, where + "negative dimension");
    check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel), where + "shape overflowed uint64");
  }
  check(numel == bytes / size, where + "shape does not account for its bytes");

  TensorView v;
  // Other dtypes and ranks past 4 are bad_file; a name the file has is never invalid_argument.
  const bool loads = (t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16") && t.shape.size() <= 4;
  if (!returns({ErrorCode::bad_file}, kPath, [&] { v = f.view(name); })) {
    check(!loads, where + "view() refused an F32/F16/BF16 tensor of rank <= 4");
    return;
  }
  check(loads, where + "view() accepted a tensor that cannot load as weights");
  check(v.rank == static_cast<int>(t.shape.size()), where + "view rank differs from the shape");
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    check(v.shape[d] == t.shape[d], where + "view shape differs from the header");
    if (numel != 0) {  // an empty tensor's strides are never used
      check(v.strides[d] == stride, where + "view is not row-major contiguous");
      stride *= v.shape[d];
    }
  }
  check(size_of(v.dtype) == size, where + "view dtype size differs from the header dtype");
  check(bytes == 0 ? v.data == nullptr : v.data == f.data.data() + t.begin, where + "view data pointer is wrong");

  const std::vector<float> x = f.to_f32(name);  // view() accepted it, so no Error is expected here
  check(x.size() == numel, where + "to_f32() gave the wrong number of values");
  const auto* p = f.data.data() + t.begin;
  for (uint64_t i = 0; i < numel; ++i) {
    uint32_t bits = 0;
    if (size == 4) {
      std::memcpy(&bits, p + 4 * i, 4);
    } else {
      uint16_t h = 0;
      std::memcpy(&h, p + 2 * i, 2);
      bits = std::bit_cast<uint32_t>(t.dtype == "BF16" ? io::bf16_to_f32(h) : io::f16_to_f32(h));
    }
    check(std::bit_cast<uint32_t>(x[i]) == bits, where + "to_f32() value " + std::to_string(i) + " is not exact");
  }
}

}  // namespace

int fuzz_safetensors(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  safetensors::File f;
  if (!returns({ErrorCode::bad_file}, kPath, [&] { f = safetensors::parse(kPath, data, size); })) return 0;
  check(f.path == kPath, "File::path is not the path given");
  check(!f.has("__metadata__"), "'__metadata__' was taken for a tensor");
  uint64_t covered = 0;
  for (const auto& [name, t] : f.tensors) {
    check_tensor(f, name, t);
    covered += t.end - t.begin;
  }
  check(covered == f.data.size(), "the tensors do not tile the data section exactly");
  // A missing name is the caller's mistake, not the file's: invalid_argument.
  const std::string missing = f.tensors.empty() ? "w" : f.tensors.rbegin()->first + "~";
  check(!returns({ErrorCode::invalid_argument}, kPath, [&] { f.view(missing); }), "view() of a missing name returned");
  return 0;
}

}  // namespace gpt2attn::fuzz
