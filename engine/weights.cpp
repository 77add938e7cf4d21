// engine/weights.cpp: Weights and WeightsView checks against a Config (engine/weights_check.hpp) and reproducible
// random initialisation (engine/weights_random.hpp). File loading lives in io/weights_io.cpp; reading a view's
// elements, in convert.cpp.
#include <cmath>
#include <string>
#include <utility>

#include "engine/convert.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "engine/weights_check.hpp"
#include "engine/weights_random.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/weights.hpp"
#include "kernels/dropout.hpp"

namespace gpt2attn {

namespace detail {
namespace {

// A rank-1 view (N) as a (1, N) matrix.
TensorView as_matrix(const TensorView& v) {
  if (v.rank == 2) return v;
  TensorView m = v;
  m.rank = 2;
  m.shape = {1, v.shape[0], 0, 0};
  m.strides = {0, v.strides[0], 0, 0};
  return m;
}

// check_finite_weights for element type S over m, a matrix (a rank-1 view as one row: `vector`).
template <DType S>
void check_finite_as(const TensorView& m, const std::string& name, bool vector) {
  const auto* base = static_cast<const std::byte*>(m.data);
  const int64_t bytes = static_cast<int64_t>(size_of(S));
  for (int64_t r = 0; r < m.shape[0]; ++r) {
    const std::byte* row = base + r * m.strides[0] * bytes;
    if (!any_nonfinite<S>(row, 0, m.shape[1], m.strides[1])) continue;
    const std::vector<float> values = f32_values(slice(m, 0, r, 1));
    for (int64_t c = 0; c < m.shape[1]; ++c) {
      const float x = values[static_cast<size_t>(c)];
      if (std::isfinite(x)) continue;
      std::string msg = name + " contains ";
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

void check_finite_weights(const TensorView& t, const std::string& name) {
  const TensorView m = as_matrix(t);  // a bias as one row, its elements still named by one index
  switch (t.dtype) {
    case DType::f32: return check_finite_as<DType::f32>(m, name, t.rank == 1);
    case DType::bf16: return check_finite_as<DType::bf16>(m, name, t.rank == 1);
    default: return check_finite_as<DType::f16>(m, name, t.rank == 1);
  }
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
    if (values) check_finite_weights(t, std::string("weights: ") + name);
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
