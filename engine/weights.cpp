// engine/weights.cpp: Weights and WeightsView checks against a Config, reproducible random initialisation, and
// the typed, strided reads a layer packs its weights from. File loading lives in io/weights_io.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "engine/weights_copy.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/weights.hpp"
#include "kernels/bf16.hpp"
#include "kernels/dropout.hpp"
#include "support/file_io.hpp"

namespace gpt2attn {

namespace detail {
namespace {

// Element i of type S at p, as f32 (exact for all three), read with memcpy: a file's tensor may be unaligned.
template <DType S>
float load(const std::byte* p) {
  if constexpr (S == DType::f32) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return S == DType::bf16 ? kernels::widen(kernels::bf16{h}) : io::f16_to_f32(h);
  }
}

template <DType S, class Dst>
void copy_rows_as(const TensorView& w, int64_t r0, int64_t n, Dst* dst) {
  const int64_t cols = w.shape[1], stride_r = w.strides[0], stride_c = w.strides[1];
  const auto* base = static_cast<const std::byte*>(w.data);
  constexpr int64_t bytes = static_cast<int64_t>(size_of(S)), tile = 64;
  for (int64_t rt = 0; rt < n; rt += tile) {
    for (int64_t ct = 0; ct < cols; ct += tile) {
      for (int64_t r = rt; r < std::min(n, rt + tile); ++r) {
        for (int64_t c = ct; c < std::min(cols, ct + tile); ++c) {
          dst[r * cols + c] = kernels::narrow<Dst>(load<S>(base + ((r0 + r) * stride_r + c * stride_c) * bytes));
        }
      }
    }
  }
}

template <class Dst>
void copy_rows_to(const TensorView& w, int64_t r0, int64_t n, Dst* dst) {
  switch (w.dtype) {
    case DType::f32: return copy_rows_as<DType::f32>(w, r0, n, dst);
    case DType::bf16: return copy_rows_as<DType::bf16>(w, r0, n, dst);
    case DType::f16: return copy_rows_as<DType::f16>(w, r0, n, dst);
    default: fail(ErrorCode::internal, std::string("weights: cannot read ") + to_string(w.dtype) + " weights");
  }
}

// A rank-1 view (N) as the (1, N) matrix copy_rows reads.
TensorView as_matrix(const TensorView& v) {
  if (v.rank == 2) return v;
  TensorView m = v;
  m.rank = 2;
  m.shape = {1, v.shape[0], 0, 0};
  m.strides = {0, v.strides[0], 0, 0};
  return m;
}

// Refuses a weight matrix (or a rank-1 bias as one row) holding NaN or +-Inf, naming the first such element: a
// layer built from it would return NaN or Inf for every input, with no error at forward.
template <DType S>
void check_finite_as(const TensorView& m, const char* name, bool vector) {
  const auto* base = static_cast<const std::byte*>(m.data);
  const int64_t bytes = static_cast<int64_t>(size_of(S));
  for (int64_t r = 0; r < m.shape[0]; ++r) {
    const std::byte* row = base + r * m.strides[0] * bytes;
    if (!any_nonfinite<S>(row, 0, m.shape[1], m.strides[1])) continue;
    for (int64_t c = 0; c < m.shape[1]; ++c) {
      const float x = load<S>(row + c * m.strides[1] * bytes);
      if (std::isfinite(x)) continue;
      std::string msg = std::string("weights: ") + name + " contains ";
      msg += std::isnan(x) ? "NaN" : x > 0 ? "+Inf" : "-Inf";
      msg += " at (";  // appended piecewise, as check() below does (GCC 12's -Wrestrict)
      if (!vector) msg += str(r) + ", ";
      msg += str(c);
      msg += "); weights must be finite";
      invalid(msg);
    }
  }
}

}  // namespace

TensorView slice(const TensorView& v, int dim, int64_t i0, int64_t n) {
  if (v.empty()) return v;
  TensorView s = v;
  s.data = static_cast<const std::byte*>(v.data) + i0 * v.strides[dim] * static_cast<int64_t>(size_of(v.dtype));
  s.shape[dim] = n;
  return s;
}

void copy_rows(const TensorView& w, int64_t r0, int64_t n, DType to, void* dst) {
  if (to == DType::bf16) {
    copy_rows_to(w, r0, n, static_cast<kernels::bf16*>(dst));
  } else if (to == DType::f32) {
    copy_rows_to(w, r0, n, static_cast<float*>(dst));
  } else {
    fail(ErrorCode::internal, std::string("weights: no layer keeps weights in ") + to_string(to));
  }
}

std::vector<float> f32_values(const TensorView& v) {
  std::vector<float> out;
  if (v.empty()) return out;
  const TensorView m = as_matrix(v);
  out.resize(static_cast<size_t>(m.shape[0] * m.shape[1]));
  copy_rows(m, 0, m.shape[0], DType::f32, out.data());
  return out;
}

}  // namespace detail

void WeightsView::validate(const Config& c) const { detail::validate_weights(*this, c, c.d_model); }

void detail::validate_weights(const WeightsView& w, const Config& c, int64_t out_width, bool values) {
  const auto& [w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o] = w;
  const int64_t E = c.d_model, KW = c.kv_width();
  auto check = [values](const char* name, const TensorView& t, int64_t rows, int64_t cols) {
    std::string want("(");  // appended piecewise: GCC 12 warns (-Wrestrict) on "(" + std::to_string(...)
    want += std::to_string(rows);
    if (cols != 0) want += ", " + std::to_string(cols);
    want += ")";
    const int rank = cols == 0 ? 1 : 2;
    if (t.empty()) invalid(std::string("weights: ") + name + " is missing (expected " + want + ")");
    if (t.rank != rank || t.shape[0] != rows || (rank == 2 && t.shape[1] != cols)) {
      invalid(std::string("weights: ") + name + " has shape " + t.shape_str() + ", expected " + want);
    }
    if (t.dtype != DType::f32 && t.dtype != DType::bf16 && t.dtype != DType::f16) {
      invalid(std::string("weights: ") + name + " has dtype " + to_string(t.dtype) + "; weights are f32, bf16 or f16");
    }
    if (!values) return;
    const TensorView m = as_matrix(t);  // a bias as one row, its elements still named by one index
    switch (t.dtype) {
      case DType::f32: return check_finite_as<DType::f32>(m, name, rank == 1);
      case DType::bf16: return check_finite_as<DType::bf16>(m, name, rank == 1);
      default: return check_finite_as<DType::f16>(m, name, rank == 1);
    }
  };
  check("w_q", w_q, E, c.query_width());
  check("w_k", w_k, KW, c.key_width());
  check("w_v", w_v, KW, c.value_width());
  check("w_o", w_o, out_width, E);
  if (c.qkv_bias) {
    check("b_q", b_q, E, 0);
    check("b_k", b_k, KW, 0);
    check("b_v", b_v, KW, 0);
  } else if (!b_q.empty() || !b_k.empty() || !b_v.empty()) {
    invalid("weights: Q/K/V biases given but config.qkv_bias is false");
  }
  if (c.out_bias) {
    check("b_o", b_o, out_width, 0);
  } else if (!b_o.empty()) {
    invalid("weights: output bias given but config.out_bias is false");
  }
}

WeightsView Weights::view(const Config& c) const {
  const int64_t E = c.d_model, KW = c.kv_width();
  auto bias = [](const std::vector<float>& b) {
    return b.empty() ? TensorView{} : TensorView::f32(b.data(), {static_cast<int64_t>(b.size())});
  };
  WeightsView v;
  v.w_q = TensorView::f32(w_q.data(), {E, c.query_width()});
  v.w_k = TensorView::f32(w_k.data(), {KW, c.key_width()});
  v.w_v = TensorView::f32(w_v.data(), {KW, c.value_width()});
  v.w_o = TensorView::f32(w_o.data(), {E, E});
  v.b_q = bias(b_q), v.b_k = bias(b_k), v.b_v = bias(b_v), v.b_o = bias(b_o);
  return v;
}

Weights Weights::copy_of(const WeightsView& v) {
  Weights w;
  for (auto [dst, src] : {std::pair{&w.w_q, &v.w_q}, {&w.w_k, &v.w_k}, {&w.w_v, &v.w_v}, {&w.w_o, &v.w_o},
                          {&w.b_q, &v.b_q}, {&w.b_k, &v.b_k}, {&w.b_v, &v.b_v}, {&w.b_o, &v.b_o}}) {
    *dst = detail::f32_values(*src);
  }
  return w;
}

void detail::check_weight_sizes(const Weights& w, const Config& c) {
  const int64_t E = c.d_model, KW = c.kv_width();
  auto check = [](const char* name, const std::vector<float>& t, int64_t rows, int64_t cols) {
    if (static_cast<int64_t>(t.size()) != rows * cols) {
      invalid(std::string("weights: ") + name + " has " + std::to_string(t.size()) + " values, expected (" +
              std::to_string(rows) + (cols == 1 ? ",)" : ", " + std::to_string(cols) + ")") + " = " +
              std::to_string(rows * cols));
    }
  };
  check("w_q", w.w_q, E, c.query_width());
  check("w_k", w.w_k, KW, c.key_width());
  check("w_v", w.w_v, KW, c.value_width());
  check("w_o", w.w_o, E, E);
  if (c.qkv_bias) {
    check("b_q", w.b_q, E, 1);
    check("b_k", w.b_k, KW, 1);
    check("b_v", w.b_v, KW, 1);
  } else if (!w.b_q.empty() || !w.b_k.empty() || !w.b_v.empty()) {
    invalid("weights: Q/K/V biases given but config.qkv_bias is false");
  }
  if (c.out_bias) {
    check("b_o", w.b_o, E, 1);
  } else if (!w.b_o.empty()) {
    invalid("weights: output bias given but config.out_bias is false");
  }
}

void Weights::validate(const Config& c) const {
  detail::check_weight_sizes(*this, c);
  view(c).validate(c);  // the sizes fit the views now; this adds the values' finiteness
}

namespace detail {

namespace {

enum class RandomTensor : uint64_t { w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o };

// Rows [r0, r0 + rows) x columns [c0, c0 + width) of tensor `tensor` ((R, cols) row major; a bias is one row),
// uniform in +-1/sqrt(fan_in), into w (rows, width) contiguous. The values come from a counter, not a stream:
// element i of a tensor is a function of (seed, tensor, i) alone, so a slice is generated without the rest and the
// whole tensor is the same values in any order.
void random_block(std::vector<float>& w, uint64_t seed, RandomTensor tensor, int64_t cols, int64_t fan_in, int64_t r0,
                  int64_t rows, int64_t c0, int64_t width) {
  w.resize(static_cast<size_t>(rows * width));
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  const uint64_t key = static_cast<uint64_t>(tensor) << 56;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const uint64_t i = static_cast<uint64_t>((r0 + r) * cols + c0 + c);
      w[static_cast<size_t>(r * width + c)] = bound * (2.0f * kernels::dropout_uniform(seed, key | i) - 1.0f);
    }
  }
}

}  // namespace

Weights random_weights(const Config& c, uint64_t seed, const RandomSlice& s, const char* what) {
  c.validate();
  const int64_t E = c.d_model, KW = c.kv_width(), d_in = c.query_width(), kdim = c.key_width();
  const int64_t vdim = c.value_width();
  // Refused before anything is allocated when the matrices cannot fit (widths go up to 2^20).
  const int64_t floats = checked_add(
      checked_product({s.q_rows, d_in + E}, what), checked_product({s.kv_rows, kdim + vdim}, what), what);
  check_fits_in_memory(checked_mul(floats, 4, what), what);
  using T = RandomTensor;
  Weights w;
  random_block(w.w_q, seed, T::w_q, d_in, d_in, s.q0, s.q_rows, 0, d_in);
  random_block(w.w_k, seed, T::w_k, kdim, kdim, s.kv0, s.kv_rows, 0, kdim);
  random_block(w.w_v, seed, T::w_v, vdim, vdim, s.kv0, s.kv_rows, 0, vdim);
  random_block(w.w_o, seed, T::w_o, E, E, 0, E, s.q0, s.q_rows);  // W_o's columns
  if (c.qkv_bias) {
    random_block(w.b_q, seed, T::b_q, E, d_in, 0, 1, s.q0, s.q_rows);
    random_block(w.b_k, seed, T::b_k, KW, kdim, 0, 1, s.kv0, s.kv_rows);
    random_block(w.b_v, seed, T::b_v, KW, vdim, 0, 1, s.kv0, s.kv_rows);
  }
  if (c.out_bias && s.out_bias) random_block(w.b_o, seed, T::b_o, E, E, 0, 1, 0, E);
  return w;
}

}  // namespace detail

Weights Weights::random(const Config& c, uint64_t seed) {
  c.validate();  // before kv_width(), whose product an invalid config (num_kv_heads = INT64_MAX) can overflow
  return detail::random_weights(c, seed, {0, c.d_model, 0, c.kv_width(), true}, "Weights::random");
}

}  // namespace gpt2attn
