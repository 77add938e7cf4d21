// tests/fuzz/fuzz_config.cpp: the config JSON readers (engine/config.cpp) on arbitrary text: ours (configs/*.json,
// config_from_json) and a Hugging Face GPT-2 config.json (hf_gpt2_config_from_json), as load_any_config dispatches.
// A config either reader accepts must be valid, and ours must round-trip through to_json().
#include <nlohmann/json.hpp>

#include "gpt2attn/config.hpp"
#include "tests/fuzz/fuzz_targets.hpp"

namespace gpt2attn::fuzz {
namespace {

// The fields a config means (to_json() writes the defaults resolved: num_kv_heads 0 as num_heads, and so on).
bool same_meaning(const Config& a, const Config& b) {
  return a.d_model == b.d_model && a.num_heads == b.num_heads && a.kv_heads() == b.kv_heads() &&
         a.query_width() == b.query_width() && a.key_width() == b.key_width() &&
         a.value_width() == b.value_width() && a.context_length == b.context_length && a.qkv_bias == b.qkv_bias &&
         a.out_bias == b.out_bias && a.causal == b.causal &&
         std::memcmp(&a.dropout, &b.dropout, sizeof a.dropout) == 0;
}

}  // namespace

int fuzz_config(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  const std::string origin = "fuzz-config.json";
  const std::string text(reinterpret_cast<const char*>(data), size);

  Config c;
  const bool ours = returns({ErrorCode::bad_file}, origin, [&] { c = config_from_json(text, origin); });
  if (ours) {
    returns({}, origin, [&] { c.validate(); });  // any Error here is a finding: the reader accepted it
    const std::string json = to_json(c);
    Config back;
    returns({}, origin, [&] { back = config_from_json(json, "round trip"); });
    check(same_meaning(c, back), "config changed through to_json(): " + json);
  }
  Config h;
  const bool hf = returns({ErrorCode::bad_file}, origin, [&] { h = hf_gpt2_config_from_json(text, origin); });
  if (hf) {
    returns({}, origin, [&] { h.validate(); });
    check(h.causal && h.qkv_bias && h.out_bias, "a Hugging Face GPT-2 config is causal with biases");
  }
  // load_any_config's own look at the text (no exceptions), before it picks one of the two readers above: it must
  // agree with them on what is JSON at all.
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) check(!ours && !hf, "a reader accepted text that load_any_config cannot parse");
  if (hf && j.is_object()) check(j.contains("n_embd"), "a Hugging Face config without n_embd was accepted");
  return 0;
}

}  // namespace gpt2attn::fuzz
