// gpt2attn/weights.hpp: the layer's parameters in torch layout ([out, in], y = x W^T + b) and their loaders.
// Loading converts once (HF Conv1D transposes, f16/bf16 widen to f32); the engine repacks for oneDNN.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpt2attn/config.hpp"

namespace gpt2attn {

struct Weights {
  std::vector<float> w_q;  // (E, d_in)
  std::vector<float> w_k;  // (E, kdim)
  std::vector<float> w_v;  // (E, vdim)
  std::vector<float> b_q, b_k, b_v;  // (E) each, or all empty when the config has qkv_bias = false
  std::vector<float> w_o;  // (E, E)
  std::vector<float> b_o;  // (E), or empty when out_bias = false

  // Throws invalid_argument naming the tensor whose size disagrees with the config.
  void validate(const Config& c) const;

  // Random weights (uniform +-1/sqrt(fan_in), like torch's default init), reproducible from the seed.
  static Weights random(const Config& c, uint64_t seed);
};

// What a safetensors file held for one attention layer: its weights and the sizes read from the shapes.
struct LoadedLayer {
  Weights weights;
  int64_t d_model = 0, d_in = 0, kdim = 0, vdim = 0;
  bool qkv_bias = false, out_bias = false;
  std::string naming;  // "torch" (nn.MultiheadAttention state_dict) or "hf-gpt2" (Conv1D c_attn/c_proj)
};

// Reads one layer from a safetensors file. Accepts both namings after `prefix` (e.g. "h.3.attn."):
//   torch:   in_proj_weight (3E, d_in) | q_proj_weight/k_proj_weight/v_proj_weight, in_proj_bias (3E),
//            out_proj.weight (E, E), out_proj.bias (E)
//   hf-gpt2: c_attn.weight (d_in, 3E) [Conv1D: x @ W + b], c_attn.bias (3E), c_proj.weight (E, E),
//            c_proj.bias (E)
// F32, F16 and BF16 load. Other tensors are ignored. Every header field, offset and size is checked;
// a bad file throws Error(bad_file) naming the file and the problem.
LoadedLayer load_safetensors_layer(const std::string& path, const std::string& prefix = "");

// Completes `c` from what the file said (d_model, d_in, kdim, vdim, biases); heads etc. stay the caller's.
Config apply_loaded_shapes(Config c, const LoadedLayer& l);

}  // namespace gpt2attn
