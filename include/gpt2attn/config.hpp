// gpt2attn/config.hpp: the attention layer's hyper-parameters, their validation, and the GPT-2/GPT-3 presets.
// Sizes only; weights live in weights.hpp and run-time choices (threads, ISA) in attention.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpt2attn/export.h"

namespace gpt2attn {

// Upper bounds Config::validate() enforces on every size a file, a flag or a C struct can set. They keep every
// element and byte count the library derives from a config (weights, workspaces,
// KV blocks) far inside int64, and they are beyond any model that exists: GPT-3 175B is 12288 wide, 96 heads.
inline constexpr int64_t kMaxWidth = int64_t{1} << 20;          // d_model, d_in, kdim, vdim (and so num_heads)
inline constexpr int64_t kMaxContextLength = int64_t{1} << 24;  // 16,777,216 tokens

// Vocabulary used at every boundary: B batch, T query length, Tk key length, E model width (d_model),
// H heads, H_kv K/V heads, D = E / H head size. Input widths: d_in (query), kdim (key), vdim (value).
struct GPT2ATTN_API Config {
  int64_t d_model = 0;          // E: width of Q, K, V after projection and of the output
  int64_t num_heads = 0;        // H; must divide E
  int64_t num_kv_heads = 0;     // H_kv: K/V heads, shared by groups of H / H_kv query heads (grouped-query
                                // attention; 1 = multi-query); must divide H; 0 means H (plain multi-head)
  int64_t d_in = 0;             // query input width; 0 means E (set it for a layer whose input width
                                // differs from its output width, torch's Linear(d_in, d_out) projections)
  int64_t kdim = 0;             // key input width; 0 means d_in (torch.nn.MultiheadAttention's kdim)
  int64_t vdim = 0;             // value input width; 0 means d_in
  int64_t context_length = 1024;  // longest T and Tk accepted (<= kMaxContextLength); the causal mask is
                                  // registered for it
  bool qkv_bias = true;         // biases on the Q/K/V projections
  bool out_bias = true;         // bias on the output projection
  bool causal = false;          // bottom-right aligned causal mask (top-left when T == Tk)
  float dropout = 0.0f;         // probability of zeroing an attention weight, training mode only

  int64_t head_dim() const { return num_heads > 0 ? d_model / num_heads : 0; }
  int64_t kv_heads() const { return num_kv_heads ? num_kv_heads : num_heads; }
  int64_t kv_width() const { return kv_heads() * head_dim(); }  // width of K and V after projection: H_kv * D
  int64_t query_width() const { return d_in ? d_in : d_model; }
  int64_t key_width() const { return kdim ? kdim : query_width(); }
  int64_t value_width() const { return vdim ? vdim : query_width(); }
  // True when one fused [3E, d_in] projection applies (query, key and value share a width).
  bool same_input_widths() const { return key_width() == query_width() && value_width() == query_width(); }

  // Throws Error(invalid_argument) naming the first bad field: a size <= 0 (or < 0 where 0 means the default),
  // above its bound (kMaxWidth, kMaxContextLength), heads that do not divide d_model, K/V heads that do not
  // divide num_heads, dropout outside [0, 1).
  void validate() const;
};

// Presets compiled into the library from configs/*.json: gpt2-small (768/12), gpt2-medium (1024/16),
// gpt2-large (1280/20), gpt2-xl (1600/25), the GPT-3 family up to gpt3-175b (12288/96).
// All presets are causal self-attention with biases, dropout 0.
GPT2ATTN_API std::vector<std::string> preset_names();
GPT2ATTN_API Config preset(const std::string& name);  // throws invalid_argument listing the known names

// Parses a config JSON object ({"d_model": 768, "num_heads": 12, ...}); unknown keys are an error. Both JSON readers
// throw Error(bad_file) naming `origin` for text that is not one JSON object, starts with a UTF-8 byte-order mark (as
// a safetensors header may not), holds a NUL byte (its offset is named), or gives a key twice in one object (at any
// depth); for an integer past int64 (reported as written); and for a dropout outside [0, 1) as written, or one
// below 1 that rounds to 1.0f.
GPT2ATTN_API Config config_from_json(const std::string& json_text, const std::string& origin = "<json>");
// Reads only a regular file (or a link to one) of at most 1 MiB: a missing or unreadable file, a directory, FIFO or
// device, or a larger file is Error(bad_file) naming the path, and nothing is read from a non-regular file.
GPT2ATTN_API Config load_config(const std::string& path);
// A Hugging Face GPT-2 config.json (n_embd, n_head, n_positions or n_ctx) as a causal Config with biases. Its other
// keys are not ours and are ignored, except those that would make attention compute something else, refused unless
// boolean and at their default: scale_attn_weights (true), scale_attn_by_inverse_layer_idx (false),
// add_cross_attention (false). Throws Error(bad_file) naming the file and the missing or bad key.
GPT2ATTN_API Config hf_gpt2_config_from_json(const std::string& json_text, const std::string& origin = "<json>");
// A config file in either format: a Hugging Face GPT-2 config.json (it has n_embd, n_head, n_positions or n_ctx)
// or ours (configs/*.json). The file is read as by load_config. A file holding keys of both formats is refused
// (Error(bad_file) naming one key of each), since reading either alone would silently drop the other's sizes.
GPT2ATTN_API Config load_any_config(const std::string& path);
GPT2ATTN_API std::string to_json(const Config& c);

}  // namespace gpt2attn
