// model/gpt2_config.cpp: GPT2Config's checks and the GPT-2 presets.

#include <cmath>
#include <string>
#include <utility>

#include "gpt2attn/error.hpp"
#include "gpt2attn/gpt2_checkpoint.hpp"

namespace gpt2attn {

void GPT2Config::validate() const {
  const std::pair<const char*, int64_t> sizes[] = {{"vocab_size", vocab_size}, {"n_positions", n_positions},
                                                   {"n_embd", n_embd},         {"n_layer", n_layer},
                                                   {"n_head", n_head},         {"n_inner", inner()}};
  for (const auto& [name, v] : sizes) {
    if (v < 1) invalid(std::string("GPT2Config.") + name + " must be at least 1, got " + std::to_string(v));
  }
  // A token id is an int32 wherever ids are passed (the CLI, the C API, numpy); a vocabulary past it is no GPT-2.
  if (vocab_size > (int64_t{1} << 31) - 1) {
    invalid("GPT2Config.vocab_size " + std::to_string(vocab_size) + " exceeds 2^31 - 1");
  }
  if (inner() > kMaxWidth) {
    invalid("GPT2Config.n_inner " + std::to_string(inner()) + " exceeds " + std::to_string(kMaxWidth));
  }
  if (!std::isfinite(layer_norm_epsilon) || layer_norm_epsilon <= 0.0f) {
    invalid("GPT2Config.layer_norm_epsilon must be finite and above 0, got " + std::to_string(layer_norm_epsilon));
  }
  attention().validate();  // n_embd, n_head (dividing n_embd), n_positions against the layer's bounds
}

Config GPT2Config::attention() const {
  Config c;
  c.d_model = n_embd;
  c.num_heads = n_head;
  c.context_length = n_positions;
  c.qkv_bias = c.out_bias = true;
  c.causal = true;
  return c;
}

GPT2Config gpt2_preset(const std::string& name) {
  struct Size {
    const char* name;
    int64_t n_embd, n_head, n_layer;
  };
  static constexpr Size kSizes[] = {
      {"gpt2-small", 768, 12, 12}, {"gpt2-medium", 1024, 16, 24}, {"gpt2-large", 1280, 20, 36},
      {"gpt2-xl", 1600, 25, 48}};
  std::string known;
  for (const Size& s : kSizes) {
    if (name == s.name) {
      GPT2Config c;
      c.n_embd = s.n_embd, c.n_head = s.n_head, c.n_layer = s.n_layer;
      return c;
    }
    known += (known.empty() ? "" : ", ") + std::string(s.name);
  }
  invalid("unknown GPT-2 preset '" + name + "' (known: " + known + ")");
}

}  // namespace gpt2attn
