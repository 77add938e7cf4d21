// gpt2attn/tensor.hpp: non-owning strided views of the caller's arrays (rank <= 4, strides in elements).
// The library never copies an input to make it contiguous; it reads through the strides given here.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/export.h"

namespace gpt2attn {

struct GPT2ATTN_API TensorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> strides{};  // elements, not bytes; 0 broadcasts

  bool empty() const { return data == nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
  std::string shape_str() const;  // "(2, 7, 768)"

  // A row-major contiguous view. Rank <= 4, and a shape whose strides would overflow int64 is refused
  // (invalid_argument).
  static TensorView contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape);
  static TensorView contiguous(const void* data, DType dtype, const std::vector<int64_t>& shape);
  static TensorView f32(const float* data, std::initializer_list<int64_t> shape) {
    return contiguous(data, DType::f32, shape);
  }
  static TensorView u8(const uint8_t* data, std::initializer_list<int64_t> shape) {
    return contiguous(data, DType::u8, shape);
  }
  // The same data with explicit strides (elements), e.g. a slice of a larger buffer.
  TensorView with_strides(std::initializer_list<int64_t> strides) const;
};

// The elements of v (rank 1 to 3; f32, bf16 or f16; any strides and alignment) as f32 at dst, contiguous in row-major
// order of its shape: exact (bf16 and f16 widen exactly). For a program reading a checkpoint's tensors as stored (the
// model runner's embeddings). invalid_argument for another rank or dtype, or a null dst with elements to write.
GPT2ATTN_API void copy_to_f32(const TensorView& v, float* dst);

// A mask laid out as torch and numpy users give it, as the exact shapes forward() reads ((T, Tk), (B, T, Tk) or
// (B, H, T, Tk)), without copying: a size-1 B or H axis of a rank-3/4 mask is broadcast (stride 0), and a rank-3
// mask of B * H rows (torch's (B * num_heads, T, Tk) attn_mask, batch-major) becomes (B, H, T, Tk). Anything else
// is returned as it is, for forward() to accept or refuse with its own message. Used by the CLI and the Python
// module.
GPT2ATTN_API TensorView torch_mask_view(TensorView mask, int64_t B, int64_t H);

// How a user mask is read. Each is broadcast from (T, Tk), (B, T, Tk) or (B, H, T, Tk).
enum class MaskKind : uint8_t {
  keep,      // nonzero may attend (torch's scores.masked_fill(mask == 0, -inf))
  block,     // nonzero may not attend (torch.nn.MultiheadAttention's bool attn_mask)
  additive,  // float added to the scaled scores (torch's float attn_mask; -inf blocks)
};

GPT2ATTN_API const char* to_string(MaskKind k);
// How torch reads a mask given without a kind, by its dtype: a float mask is added (additive), a bool or uint8 one
// blocks where nonzero (block). The CLI and the Python module use it when no kind is named.
GPT2ATTN_API MaskKind torch_mask_kind(DType mask_dtype);
GPT2ATTN_API MaskKind mask_kind_from_string(const std::string& s);  // "keep" | "block" | "additive"

}  // namespace gpt2attn
