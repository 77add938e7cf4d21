// engine/quantized.hpp: quantized weights inside the engine: their checks against a config, and LayerWeights, the one
// source a layer is built from (views as given, or quantized codes), so quantizing at construction and loading saved
// codes build the same layer.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// Scales a row of `cols` inputs has in format f: 1 (int8) or ceil(cols / kWeightGroup) (int4).
int64_t quant_groups(WeightFormat f, int64_t cols);

// The rank-2 view w (f32, bf16 or f16) quantized row by row in format f (int8 or int4): QuantizedWeights::quantize's
// rule for one matrix. invalid_argument naming `name` for another rank or dtype.
QuantizedMatrix quantize_matrix(const TensorView& w, WeightFormat f, const char* name);

// QuantizedWeights::validate for a layer whose output projection is (out_width, E) (a tensor-parallel shard's).
void validate_quantized(const QuantizedWeights& q, const Config& c, int64_t out_width);

// The rank-2 matrix w (N, K) as a layer holding it in format f computes with, f32 row-major: each row quantized
// (QuantizedWeights::quantize's rule) and dequantized; for WeightFormat::compute, its values.
std::vector<float> dequantized_values(const TensorView& w, WeightFormat f);

// Rows [r0, r0 + n) of m dequantized (code x scale) into dst (n, m.cols) f32.
void dequantize_rows(const QuantizedMatrix& m, WeightFormat f, int64_t r0, int64_t n, float* dst);

// What a layer is built from. For WeightFormat::compute, the caller's views; for int8 and int4, codes: quantized
// here once from views, or the caller's (a file's). views().b_* are f32 views of the biases either way. Holds
// references to what it was given: keep that alive while it lives.
class LayerWeights {
 public:
  LayerWeights(const WeightsView& w, WeightFormat f);
  explicit LayerWeights(const QuantizedWeights& q);
  LayerWeights(const LayerWeights&) = delete;
  LayerWeights& operator=(const LayerWeights&) = delete;

  WeightFormat format() const { return format_; }
  // The matrices (WeightFormat::compute only; empty views otherwise) and the biases.
  const WeightsView& views() const { return views_; }
  // The codes (int8 and int4 only).
  const QuantizedWeights& quantized() const { return *q_; }

 private:
  void view_biases(const QuantizedWeights& q);

  WeightFormat format_;
  WeightsView views_;
  std::optional<QuantizedWeights> own_;
  const QuantizedWeights* q_ = nullptr;
};

}  // namespace gpt2attn::detail
