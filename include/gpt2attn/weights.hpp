// gpt2attn/weights.hpp: the layer's parameters in torch layout ([out, in], y = x W^T + b) and their loaders.
// A layer is built from a WeightsView: views of f32, bf16 or f16 tensors with any strides, which it converts once
// into its own packed copies in the compute type. Weights (owned f32 vectors) give one; a safetensors file gives
// one over its bytes as stored (open_safetensors_layer), so a BF16 file reaches a bf16 layer without an f32 copy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/tensor.hpp"

namespace gpt2attn {

// Views of one layer's parameters, in memory the caller owns until the layer is constructed (the layer keeps its
// own converted copies, nothing of the views). Matrices rank 2 in torch layout, (outputs, inputs), any strides (a
// Hugging Face Conv1D weight is the transposed view, strides (1, outputs)); biases rank 1 (empty views when the
// config has none). Element types f32, bf16 or f16: a bf16 layer takes bf16 as it is, rounds f32 and f16 to
// nearest even once; an f32 layer widens bf16 and f16 exactly.
struct GPT2ATTN_API WeightsView {
  TensorView w_q;  // (E, d_in)
  TensorView w_k;  // (H_kv * D, kdim)
  TensorView w_v;  // (H_kv * D, vdim)
  TensorView w_o;  // (E, E)
  TensorView b_q, b_k, b_v;  // (E), (H_kv * D), (H_kv * D), or all empty when qkv_bias = false
  TensorView b_o;            // (E), or empty when out_bias = false

  // Throws invalid_argument naming the tensor whose rank, shape or dtype disagrees with the config, or the first
  // element (by the view's indices) that is NaN or infinite: a layer built from it would answer NaN or Inf.
  void validate(const Config& c) const;
};

struct GPT2ATTN_API Weights {
  std::vector<float> w_q;  // (E, d_in)
  std::vector<float> w_k;  // (H_kv * D, kdim): E rows unless the config groups K/V heads
  std::vector<float> w_v;  // (H_kv * D, vdim)
  std::vector<float> b_q, b_k, b_v;  // (E), (H_kv * D), (H_kv * D), or all empty when qkv_bias = false
  std::vector<float> w_o;  // (E, E)
  std::vector<float> b_o;  // (E), or empty when out_bias = false

  // Throws invalid_argument naming the tensor whose size disagrees with the config, or the first element that is
  // NaN or infinite.
  void validate(const Config& c) const;

  // Random weights (uniform +-1/sqrt(fan_in), like torch's default init), reproducible from the seed.
  static Weights random(const Config& c, uint64_t seed);

  // Contiguous f32 views of these vectors with the config's shapes (validate(c) first).
  WeightsView view(const Config& c) const;
  // Contiguous f32 copies of what `v` views, each in row-major order of its view's shape (widened exactly from
  // bf16 and f16); an empty view gives an empty vector.
  static Weights copy_of(const WeightsView& v);
};

// The weights a layer built with EngineOptions::weights = f computes with, as f32 (widened exactly): for int8 and
// int4 each matrix row quantized (gpt2attn/dtype.hpp, WeightFormat) and dequantized, code x scale; the biases, and
// every tensor for WeightFormat::compute, as given. For measuring a format's error, and for references.
GPT2ATTN_API Weights dequantized(const WeightsView& w, WeightFormat f);

// One (rows, cols) matrix in a quantized WeightFormat (gpt2attn/dtype.hpp), one int8_t code per weight, row-major:
//   value(r, c) = codes[r * cols + c] * scales[r * groups + c / group]
// with group = cols (int8: one scale a row, codes in [-127, 127]) or kWeightGroup (int4: the last group of a row
// shorter when cols is not a multiple; codes in [-8, 7]), groups = ceil(cols / group).
struct GPT2ATTN_API QuantizedMatrix {
  int64_t rows = 0, cols = 0;
  std::vector<int8_t> codes;  // rows * cols
  std::vector<float> scales;  // rows * groups
};

// A layer's projection weights quantized: what a layer built with EngineOptions::weights = format holds. Quantize once
// (quantize(), the rule of gpt2attn/dtype.hpp) and save (save_quantized), and a server loads the codes at every start
// (load_quantized) instead of quantizing: a layer built from either computes bit for bit the same.
struct GPT2ATTN_API QuantizedWeights {
  WeightFormat format = WeightFormat::int8;  // int8 or int4
  QuantizedMatrix w_q, w_k, w_v, w_o;        // the shapes of WeightsView's matrices
  std::vector<float> b_q, b_k, b_v, b_o;     // f32, as given (empty when the config has none)

  // Quantizes each matrix row of `w` in format f (int8 or int4; WeightFormat::compute is refused). The biases are
  // copied as f32. Throws invalid_argument for a view that is not a rank-2 matrix (rank-1 bias) of f32, bf16 or f16.
  static QuantizedWeights quantize(const WeightsView& w, WeightFormat f);
  // Throws invalid_argument naming the tensor whose shape, size or contents disagree with the config or the format:
  // a code outside the format's range, a scale or bias that is NaN or infinite.
  void validate(const Config& c) const;
  // code x scale as f32 (exact: a code times a float is a float), the biases as they are.
  Weights dequantized() const;
};

// Writes `q` (validated against c first: invalid_argument as validate() throws) as a safetensors file, atomically (a
// temporary file renamed over `path`). Per matrix <name> (q_proj, k_proj, v_proj, out_proj: w_q, w_k, w_v, w_o):
//   "<name>.codes"   int8: I8 (rows, cols), the codes as they are;
//                    int4: U8 (rows, ceil(cols / 2)), input 2i in the low nibble of byte i and 2i + 1 in the high
//                    one, each a 4-bit two's complement code; an odd width's last high nibble is 0
//   "<name>.scales"  F32 (rows, groups)
//   "<name>.bias"    F32 (rows), only when the config has the bias (qkv_bias: q/k/v_proj; out_bias: out_proj)
// and in its "__metadata__": "gpt2attn.weights" "int8" | "int4", "gpt2attn.group" the inputs per scale ("32" for
// int4, kWeightGroup; "row" for int8's one scale a row), and "<name>.cols" each matrix's width in decimal (an int4
// row of ceil(cols / 2) bytes does not say it).
GPT2ATTN_API void save_quantized(const std::string& path, const Config& c, const QuantizedWeights& q);
// Reads what save_quantized wrote, for a layer of config c (its widths, K/V width and biases must be the file's),
// with the strict safetensors reader (a file cut short is refused). Checked: the metadata; every tensor's presence,
// dtype and shape against the metadata, the other tensors and c; no tensor the format lacks; the codes in the
// format's range (int8's -128 refused); an odd int4 width's padding nibbles 0; every scale and bias finite. A failed
// check throws Error(bad_file) naming the file and the tensor (or the metadata key); an invalid c, invalid_argument.
GPT2ATTN_API QuantizedWeights load_quantized(const std::string& path, const Config& c);

// The sizes one attention layer of a file has, read from its tensors' shapes.
struct LayerShapes {
  int64_t d_model = 0, d_in = 0, kdim = 0, vdim = 0;
  int64_t kv_width = 0;  // rows of the K and V projections: d_model, or H_kv * D with grouped K/V heads
  bool qkv_bias = false, out_bias = false;
  std::string naming;  // "torch" (nn.MultiheadAttention state_dict) or "hf-gpt2" (Conv1D c_attn/c_proj)
};

// The layer a file of save_quantized's holds, from its header alone (no tensor is read): its format, and its shapes
// from the codes (d_model and kv_width their rows, d_in, kdim and vdim their "<name>.cols") and the biases present;
// naming "gpt2attn-quantized". apply_loaded_shapes(c, shapes) completes the Config load_quantized takes.
struct QuantizedLayerShapes : LayerShapes {
  WeightFormat format = WeightFormat::int8;
};
// std::nullopt for a safetensors file without "gpt2attn.weights" metadata (a float checkpoint:
// open_safetensors_layer reads it). Error(bad_file) naming the file for one that is not safetensors, and for a
// quantized one whose metadata or tensors' shapes disagree with one another, naming the tensor or key.
GPT2ATTN_API std::optional<QuantizedLayerShapes> quantized_layer_shapes(const std::string& path);

// What a safetensors file held for one attention layer, converted to f32.
struct LoadedLayer : LayerShapes {
  Weights weights;
};

// One attention layer of a safetensors file as the file stores it: views of its tensors in their own dtypes
// (F32, F16, BF16) and layouts (fused Q/K/V split by offset, Conv1D weights as transposed views) over the file's
// bytes, which `storage` holds in memory; nothing is converted. Give `weights` to a layer constructor.
struct StoredLayer : LayerShapes {
  WeightsView weights;
  std::shared_ptr<const void> storage;  // the views point into it: keep it until the layer is constructed
};

// Reads one layer from a safetensors file. Accepts both namings after `prefix` (e.g. "h.3.attn."):
//   torch:   in_proj_weight (3E, d_in) | q_proj_weight/k_proj_weight/v_proj_weight, in_proj_bias (3E),
//            out_proj.weight (E, E), out_proj.bias (E)
//   hf-gpt2: c_attn.weight (d_in, 3E) [Conv1D: x @ W + b], c_attn.bias (3E), c_proj.weight (E, E),
//            c_proj.bias (E)
// With grouped K/V heads, K and V have KW = H_kv * D rows instead of E: in_proj (E + 2 KW, d_in), k/v_proj_weight
// (KW, kdim/vdim), c_attn (d_in, E + 2 KW), biases (E + 2 KW); E comes from the output projection.
// F32, F16 and BF16 load. Other tensors are ignored. Every header field, offset and size is checked;
// a bad file throws Error(bad_file) naming the file and the problem.
GPT2ATTN_API StoredLayer open_safetensors_layer(const std::string& path, const std::string& prefix = "");
// The same layer converted to f32 Weights (exact for every stored dtype).
GPT2ATTN_API LoadedLayer load_safetensors_layer(const std::string& path, const std::string& prefix = "");

// Completes `c` from what the file said (d_model, d_in, kdim, vdim, biases, and num_kv_heads when it is 0: the K/V
// width over the head size); num_heads etc. stay the caller's. Throws invalid_argument when the result is not a
// valid config or the file's K/V width is not c.kv_heads() x the head size.
GPT2ATTN_API Config apply_loaded_shapes(Config c, const LayerShapes& l);

}  // namespace gpt2attn
