// gpt2attn/gpt2_checkpoint.hpp: a whole GPT-2's sizes and parameters, as a Hugging Face checkpoint directory stores
// them (config.json + model.safetensors, or model-0000k-of-0000n.safetensors shards + model.safetensors.index.json),
// read as stored: views of F32, F16 or BF16 tensors over the files' mapped bytes, nothing converted. The model runner
// (gpt2attn/gpt2.hpp) is built from them. Part of the model library (gpt2attn::model).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpt2attn/config.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {

// A GPT-2's hyper-parameters, in Hugging Face's GPT2Config names.
struct GPT2ATTN_API GPT2Config {
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;  // the longest sequence (prompt + generated tokens)
  int64_t n_embd = 768;        // E
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_inner = 0;         // the MLP's hidden width; 0 = 4 n_embd
  float layer_norm_epsilon = 1e-5f;

  int64_t inner() const { return n_inner ? n_inner : 4 * n_embd; }
  // Throws invalid_argument naming the first bad field (a size below 1, heads that do not divide n_embd, an epsilon
  // not finite and above 0, a width or length past config.hpp's bounds).
  void validate() const;
  // The attention layers' Config: causal self-attention with biases, context n_positions.
  Config attention() const;
};

// The GPT-2 sizes of a preset name (gpt2-small: 768/12/12, gpt2-medium: 1024/16/24, gpt2-large: 1280/20/36, gpt2-xl:
// 1600/25/48; vocabulary 50257, 1024 positions); invalid_argument listing them for another name.
GPT2ATTN_API GPT2Config gpt2_preset(const std::string& name);

// One transformer block's parameters, torch layout ((outputs, inputs); a Conv1D weight is the transposed view).
struct GPT2ATTN_API GPT2BlockWeights {
  TensorView ln_1_weight, ln_1_bias;  // (E)
  WeightsView attn;                   // c_attn split into Q, K, V (E rows each) and c_proj, as attention takes them
  TensorView ln_2_weight, ln_2_bias;  // (E)
  TensorView fc_weight, fc_bias;      // (inner, E), (inner): mlp.c_fc
  TensorView proj_weight, proj_bias;  // (E, inner), (E): mlp.c_proj
};

struct GPT2ATTN_API GPT2Weights {
  TensorView wte;  // (vocab_size, E): the token embeddings, and the LM head tied to them
  TensorView wpe;  // (n_positions, E)
  std::vector<GPT2BlockWeights> blocks;  // n_layer
  TensorView ln_f_weight, ln_f_bias;     // (E)

  // Throws invalid_argument for an invalid c, a block count other than n_layer, and naming the tensor
  // ("h.3.mlp.c_fc.weight"; c_attn's parts also by field, "(w_k)") whose rank, shape or dtype disagrees with c, or
  // the first element found NaN or infinite, at its index in the checkpoint's layout (a Conv1D weight's [in, out]).
  void validate(const GPT2Config& c) const;
};

// What a checkpoint holds: the config, views of its tensors, and the bytes they point into.
struct GPT2ATTN_API GPT2Checkpoint {
  GPT2Config config;
  GPT2Weights weights;
  std::shared_ptr<const void> storage;  // the mapped files (or the random weights): keep it while the views are used
};

// A Hugging Face GPT-2 config.json (vocab_size, n_positions or n_ctx, n_embd, n_layer, n_head: integers; n_inner (null
// or absent: 4 n_embd; 0 refused, which Hugging Face would read as a width of 0), layer_norm_epsilon (a number; absent:
// 1e-5)). Keys that would make the model compute something else are refused unless at GPT-2's values, naming the key:
// activation_function ("gelu_new", "gelu_pytorch_tanh"), scale_attn_weights (true), scale_attn_by_inverse_layer_idx,
// add_cross_attention (false), tie_word_embeddings (true); the attention keys as hf_gpt2_config_from_json
// (gpt2attn/config.hpp) reads them. reorder_and_upcast_attn is read at either value (a boolean): it computes the same
// scores, in f32 under fp16 autocast. Other keys are ignored. Error(bad_file) naming `origin` and the key, also for
// text config_from_json refuses (a byte-order mark, a NUL byte, a key given twice) and sizes GPT2Config::validate
// refuses.
GPT2ATTN_API GPT2Config gpt2_config_from_json(const std::string& json_text, const std::string& origin = "<json>");

// Opens a checkpoint directory: config.json, and model.safetensors or else the shards model.safetensors.index.json
// lists in its "weight_map" (tensor name -> file name beside it), as transformers' from_pretrained picks them (each
// file mapped read-only). Tensor names with or without the "transformer." prefix (not both for one tensor); a stored
// "lm_head.weight" must equal wte value for value (GPT-2 ties them) and is otherwise ignored, as is any tensor that is
// not a GPT-2 parameter (".attn.bias" / ".attn.masked_bias" buffers). F32, F16 and BF16 as stored, mixed or not.
// Every tensor is then checked as GPT2Weights::validate checks it, each element finite, so every byte is read once:
// at gpt2-xl in F32, 6.2 GB. Error(bad_file) naming the file (config.json, the safetensors file, or the index) and
// the tensor for a missing, misshapen, non-float or non-finite tensor (and the element), a block past config.json's
// n_layer, an index naming a file that is missing or outside the directory; what the safetensors reader checks.
GPT2ATTN_API GPT2Checkpoint open_gpt2_checkpoint(const std::string& dir);

// Random weights at config c, GPT-2's initialization (every matrix and embedding N(0, 0.02), the residual projections
// attn.c_proj and mlp.c_proj N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1 and biases 0), stored as
// `dtype` (f32, bf16 or f16), reproducible from the seed: what `gpt2attn bench --preset` runs. Not the numbers
// scripts/make_gpt2_checkpoint.py writes (torch's generator), the same distribution; the numbers do not depend on the
// thread count. bf16 and f16 round the f32 draws to nearest even. Drawn on `threads` threads (run_on_threads; 1 to
// max_threads()). invalid_argument for an invalid c, another dtype or thread count; out_of_memory when the weights do
// not fit.
GPT2ATTN_API GPT2Checkpoint random_gpt2(const GPT2Config& c, uint64_t seed, DType dtype = DType::f32, int threads = 1);

}  // namespace gpt2attn
