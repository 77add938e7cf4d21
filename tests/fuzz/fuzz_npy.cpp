// tests/fuzz/fuzz_npy.cpp: the .npy reader (tools/npy.cpp, the CLI's input format) on arbitrary bytes: parse(), and
// the array it accepts is consistent with its header.
#include "tests/fuzz/fuzz_targets.hpp"
#include "tools/npy.hpp"

namespace gpt2attn::fuzz {

int fuzz_npy(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  const std::string path = "fuzz-input.npy";
  npy::Array a;
  if (!returns({ErrorCode::bad_file}, path, [&] { a = npy::parse(path, data, size); })) return 0;

  uint64_t numel = 1;
  for (int64_t d : a.shape) {
    check(d >= 0, "negative dimension accepted");
    check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel), "shape overflowed uint64");
  }
  check(numel == static_cast<uint64_t>(a.numel()), "numel() differs from the shape's product");
  // Consumers (the CLI) make row-major views of the array: the products of its trailing dimensions (the strides, as
  // TensorView::contiguous computes them) must fit int64, an empty array's too.
  int64_t stride = 1;
  for (size_t i = a.shape.size(); i-- > 0;)
    check(!__builtin_mul_overflow(stride, a.shape[i], &stride), "the row-major strides of the shape overflow int64");
  const bool is_f32 = a.kind == npy::Kind::f32;
  check((is_f32 ? a.f32.size() : a.u8.size()) == numel, "the value count differs from the shape");
  check((is_f32 ? a.u8.size() : a.f32.size()) == 0, "values filled for the other kind");
  check(a.descr.size() == 3, "accepted descr '" + a.descr + "'");
  if (a.descr[1] == 'b')
    for (uint8_t v : a.u8) check(v <= 1, "a bool value is not 0 or 1");
  if (a.descr[1] == 'f') check(is_f32, "a float descr did not give f32 values");
  return 0;
}

}  // namespace gpt2attn::fuzz
