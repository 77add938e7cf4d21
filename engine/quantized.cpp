// engine/quantized.cpp: QuantizedWeights (quantize, validate, dequantized) and LayerWeights. The quantization rule
// itself is kernels/linear.hpp's quantize_row, which decode's and prefill's packings read the codes of.
#include "engine/quantized.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "engine/convert.hpp"
#include "engine/util.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn {

namespace detail {

int64_t quant_groups(WeightFormat f, int64_t cols) {
  return cols == 0 ? 0 : ceil_div(cols, kernels::quant_group(f, cols));
}

QuantizedMatrix quantize_matrix(const TensorView& w, WeightFormat f, const char* name) {
  if (w.rank != 2 || (w.dtype != DType::f32 && w.dtype != DType::bf16 && w.dtype != DType::f16)) {
    invalid(std::string("QuantizedWeights::quantize: ") + name + " is not a rank-2 f32, bf16 or f16 view (rank " +
            str(w.rank) + ", " + to_string(w.dtype) + ")");
  }
  QuantizedMatrix m;
  m.rows = w.shape[0], m.cols = w.shape[1];
  const int64_t G = quant_groups(f, m.cols);
  m.codes.resize(static_cast<size_t>(checked_mul(m.rows, m.cols, "QuantizedWeights::quantize")));
  m.scales.resize(static_cast<size_t>(m.rows * G));
  std::vector<float> row(static_cast<size_t>(m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    copy_rows(w, r, 1, DType::f32, row.data());
    kernels::quantize_row(f, row.data(), m.cols, m.codes.data() + r * m.cols, m.scales.data() + r * G);
  }
  return m;
}

namespace {

void check_matrix(const QuantizedMatrix& m, WeightFormat f, const char* name, int64_t rows, int64_t cols) {
  const std::string where = std::string("quantized weights: ") + name;
  if (m.rows != rows || m.cols != cols) {
    invalid(where + " is (" + str(m.rows) + ", " + str(m.cols) + "), expected (" + str(rows) + ", " + str(cols) +
            ")");
  }
  const int64_t G = quant_groups(f, cols);
  if (static_cast<int64_t>(m.codes.size()) != rows * cols) {
    invalid(where + " has " + str(m.codes.size()) + " codes, expected " + str(rows * cols));
  }
  if (static_cast<int64_t>(m.scales.size()) != rows * G) {
    invalid(where + " has " + str(m.scales.size()) + " scales, expected (" + str(rows) + ", " + str(G) + ") for " +
            to_string(f));
  }
  const int lo = f == WeightFormat::int4 ? -8 : -127, hi = f == WeightFormat::int4 ? 7 : 127;
  for (size_t i = 0; i < m.codes.size(); ++i) {
    if (m.codes[i] < lo || m.codes[i] > hi) {
      invalid(where + " holds code " + str(m.codes[i]) + " at (" + str(static_cast<int64_t>(i) / cols) + ", " +
              str(static_cast<int64_t>(i) % cols) + "), outside " + to_string(f) + "'s [" + str(lo) + ", " + str(hi) +
              "]");
    }
  }
  for (size_t i = 0; i < m.scales.size(); ++i) {
    if (!std::isfinite(m.scales[i])) {
      invalid(where + "'s scale " + str(i) + " is " + (std::isnan(m.scales[i]) ? "NaN" : "infinite") +
              "; scales must be finite");
    }
  }
}

void check_bias(const std::vector<float>& b, const char* name, bool present, int64_t n) {
  const std::string where = std::string("quantized weights: ") + name;
  if (!present) {
    if (!b.empty()) invalid(where + " given but the config has no such bias");
    return;
  }
  if (static_cast<int64_t>(b.size()) != n) invalid(where + " has " + str(b.size()) + " values, expected " + str(n));
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(b[i])) invalid(where + " is not finite at " + str(i) + "; biases must be finite");
  }
}

TensorView bias_view(const std::vector<float>& b) {
  return b.empty() ? TensorView{} : TensorView::f32(b.data(), {static_cast<int64_t>(b.size())});
}

}  // namespace

void validate_quantized(const QuantizedWeights& q, const Config& c, int64_t out_width) {
  if (q.format != WeightFormat::int8 && q.format != WeightFormat::int4) {
    invalid(std::string("quantized weights: format ") + to_string(q.format) + " is not a quantized format (int8, int4)");
  }
  const int64_t E = c.d_model, KW = c.kv_width();
  check_matrix(q.w_q, q.format, "w_q", E, c.query_width());
  check_matrix(q.w_k, q.format, "w_k", KW, c.key_width());
  check_matrix(q.w_v, q.format, "w_v", KW, c.value_width());
  check_matrix(q.w_o, q.format, "w_o", out_width, E);
  check_bias(q.b_q, "b_q", c.qkv_bias, E);
  check_bias(q.b_k, "b_k", c.qkv_bias, KW);
  check_bias(q.b_v, "b_v", c.qkv_bias, KW);
  check_bias(q.b_o, "b_o", c.out_bias, out_width);
}

void dequantize_rows(const QuantizedMatrix& m, WeightFormat f, int64_t r0, int64_t n, float* dst) {
  const int64_t K = m.cols, group = kernels::quant_group(f, K), G = quant_groups(f, K);
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* codes = m.codes.data() + (r0 + r) * K;
    const float* scales = m.scales.data() + (r0 + r) * G;
    for (int64_t k = 0; k < K; ++k) dst[r * K + k] = static_cast<float>(codes[k]) * scales[k / group];
  }
}

std::vector<float> dequantized_values(const TensorView& w, WeightFormat f) {
  if (f == WeightFormat::compute) return f32_values(w);
  const QuantizedMatrix m = quantize_matrix(w, f, "a matrix");
  std::vector<float> out(m.codes.size());
  dequantize_rows(m, f, 0, m.rows, out.data());
  return out;
}

LayerWeights::LayerWeights(const WeightsView& w, WeightFormat f) : format_(f) {
  if (f == WeightFormat::compute) {
    views_ = w;
    return;
  }
  own_ = QuantizedWeights::quantize(w, f);
  q_ = &*own_;
  view_biases(*q_);
}

LayerWeights::LayerWeights(const QuantizedWeights& q) : format_(q.format), q_(&q) { view_biases(q); }

void LayerWeights::view_biases(const QuantizedWeights& q) {
  views_.b_q = bias_view(q.b_q), views_.b_k = bias_view(q.b_k), views_.b_v = bias_view(q.b_v);
  views_.b_o = bias_view(q.b_o);
}

}  // namespace detail

QuantizedWeights QuantizedWeights::quantize(const WeightsView& w, WeightFormat f) {
  if (f != WeightFormat::int8 && f != WeightFormat::int4) {
    invalid(std::string("QuantizedWeights::quantize: format ") + to_string(f) + " is not int8 or int4");
  }
  QuantizedWeights q;
  q.format = f;
  q.w_q = detail::quantize_matrix(w.w_q, f, "w_q");
  q.w_k = detail::quantize_matrix(w.w_k, f, "w_k");
  q.w_v = detail::quantize_matrix(w.w_v, f, "w_v");
  q.w_o = detail::quantize_matrix(w.w_o, f, "w_o");
  q.b_q = detail::f32_values(w.b_q), q.b_k = detail::f32_values(w.b_k), q.b_v = detail::f32_values(w.b_v);
  q.b_o = detail::f32_values(w.b_o);
  return q;
}

void QuantizedWeights::validate(const Config& c) const { detail::validate_quantized(*this, c, c.d_model); }

Weights QuantizedWeights::dequantized() const {
  Weights w;
  for (auto [dst, src] : {std::pair{&w.w_q, &w_q}, {&w.w_k, &w_k}, {&w.w_v, &w_v}, {&w.w_o, &w_o}}) {
    dst->resize(src->codes.size());
    detail::dequantize_rows(*src, format, 0, src->rows, dst->data());
  }
  w.b_q = b_q, w.b_k = b_k, w.b_v = b_v, w.b_o = b_o;
  return w;
}

Weights dequantized(const WeightsView& v, WeightFormat f) {
  if (f == WeightFormat::compute) return Weights::copy_of(v);
  return QuantizedWeights::quantize(v, f).dequantized();
}

}  // namespace gpt2attn
