// engine/tensor.cpp: TensorView helpers, and the names of dtypes and mask kinds. Only copy_to_f32 copies data.
#include "gpt2attn/tensor.hpp"

#include "engine/convert.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

std::string TensorView::shape_str() const {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (rank == 1 ? ",)" : ")");
}

namespace {
// The row-major view of dims[0..n): no allocation (decode builds views on its hot path).
TensorView contiguous_view(const void* data, DType dtype, const int64_t* dims, size_t n) {
  if (n > 4) invalid("TensorView: rank " + std::to_string(n) + " > 4");
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(n);
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = dims[d];
    v.strides[d] = stride;
    // The outermost stride is not needed past the last dimension; every inner one must exist.
    if (d > 0 && (dims[d] < 0 || __builtin_mul_overflow(stride, dims[d], &stride))) {
      v.shape[0] = dims[0];
      invalid("TensorView: shape " + v.shape_str() + " has strides past int64");
    }
  }
  return v;
}
}  // namespace

TensorView TensorView::contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return contiguous_view(data, dtype, shape.begin(), shape.size());
}

TensorView TensorView::contiguous(const void* data, DType dtype, const std::vector<int64_t>& shape) {
  return contiguous_view(data, dtype, shape.data(), shape.size());
}

TensorView TensorView::with_strides(std::initializer_list<int64_t> strides) const {
  if (static_cast<int>(strides.size()) != rank) {
    invalid("TensorView: " + std::to_string(strides.size()) + " strides for rank " + std::to_string(rank));
  }
  TensorView v = *this;
  int i = 0;
  for (int64_t s : strides) v.strides[i++] = s;
  return v;
}

TensorView torch_mask_view(TensorView m, int64_t B, int64_t H) {
  // torch's (B * H, T, Tk): row b * H + h. B and H are the caller's, not yet validated: a product that overflows
  // matches no mask.
  int64_t BH = 0;
  if (m.rank == 3 && !__builtin_mul_overflow(B, H, &BH) && m.shape[0] == BH && BH != B) {
    m.rank = 4;
    m.shape = {B, H, m.shape[1], m.shape[2]};
    m.strides = {H * m.strides[0], m.strides[0], m.strides[1], m.strides[2]};
    return m;
  }
  if (m.rank == 3 || m.rank == 4) {
    const int64_t want[2] = {B, H};
    for (int d = 0; d < m.rank - 2; ++d) {
      if (m.shape[d] == 1 && want[d] != 1) m.shape[d] = want[d], m.strides[d] = 0;
    }
  }
  return m;
}

MaskKind torch_mask_kind(DType mask_dtype) { return mask_dtype == DType::f32 ? MaskKind::additive : MaskKind::block; }

namespace {
constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::i8, DType::u8, DType::fp8};
}

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::fp8: return "fp8";
  }
  return "?";
}

DType dtype_from_string(const std::string& s) {
  if (s == "int8") return DType::i8;  // the name the CLI and the Python module use for an int8 KV cache
  std::string known;
  for (DType t : kDTypes) {
    if (s == to_string(t)) return t;
    known += (known.empty() ? "" : ", ") + std::string(to_string(t));
  }
  invalid("unknown dtype '" + s + "' (known: " + known + ")");
}

const char* to_string(WeightFormat f) {
  switch (f) {
    case WeightFormat::compute: return "compute";
    case WeightFormat::int8: return "int8";
    case WeightFormat::int4: return "int4";
  }
  return "?";
}

WeightFormat weight_format_from_string(const std::string& s) {
  for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
    if (s == to_string(f)) return f;
  }
  invalid("unknown weight format '" + s + "' (known: compute, int8, int4)");
}

const char* to_string(MaskKind k) {
  switch (k) {
    case MaskKind::keep: return "keep";
    case MaskKind::block: return "block";
    case MaskKind::additive: return "additive";
  }
  return "?";
}

MaskKind mask_kind_from_string(const std::string& s) {
  if (s == "keep") return MaskKind::keep;
  if (s == "block") return MaskKind::block;
  if (s == "additive") return MaskKind::additive;
  invalid("unknown mask kind '" + s + "' (expected keep, block or additive)");
}

void copy_to_f32(const TensorView& v, float* dst) {
  if (v.empty()) return;
  if (v.rank < 1 || v.rank > 3 || (v.dtype != DType::f32 && v.dtype != DType::bf16 && v.dtype != DType::f16)) {
    invalid("copy_to_f32: expected a rank 1-3 f32, bf16 or f16 view, got rank " + std::to_string(v.rank) + " " +
            to_string(v.dtype));
  }
  if (!dst && v.numel() > 0) invalid("copy_to_f32: dst must not be null");
  detail::convert(v, DType::f32, dst);
}

}  // namespace gpt2attn
