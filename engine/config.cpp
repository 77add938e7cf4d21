// engine/config.cpp: Config validation, JSON (de)serialisation and the compiled-in presets.
// The preset text comes from configs/*.json through CMake (generated/presets.cpp); nothing is duplicated here.
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "gpt2attn/config.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {
namespace detail {
extern const std::pair<std::string_view, std::string_view> kPresetJson[];
extern const int kPresetCount;
}  // namespace detail

void Config::validate() const {
  auto in_range = [](const char* field, int64_t v, int64_t lo, int64_t hi, const char* note) {
    if (v < lo || v > hi) {
      invalid(std::string("config: ") + field + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
              "]" + note + ", got " + std::to_string(v));
    }
  };
  in_range("d_model", d_model, 1, kMaxWidth, "");
  in_range("num_heads", num_heads, 1, kMaxWidth, "");
  in_range("context_length", context_length, 1, kMaxContextLength, "");
  for (auto [field, v] : {std::pair{"d_in", d_in}, {"kdim", kdim}, {"vdim", vdim}}) {
    in_range(field, v, 0, kMaxWidth, " (0 = the default)");
  }
  if (d_model % num_heads != 0) {
    invalid("config: num_heads=" + std::to_string(num_heads) + " does not divide d_model=" + std::to_string(d_model));
  }
  in_range("num_kv_heads", num_kv_heads, 0, num_heads, " (0 = num_heads)");
  if (num_heads % kv_heads() != 0) {
    invalid("config: num_kv_heads=" + std::to_string(num_kv_heads) + " does not divide num_heads=" +
            std::to_string(num_heads));
  }
  if (!(dropout >= 0.0f && dropout < 1.0f)) {
    invalid("config: dropout must be in [0, 1), got " + std::to_string(dropout));
  }
}

static const std::vector<std::string> kKeys = {"d_model", "num_heads", "num_kv_heads", "d_in", "kdim", "vdim",
                                               "context_length", "qkv_bias", "out_bias", "causal", "dropout"};

namespace {
// A config file's text as a JSON object, or Error(bad_file) naming the file.
nlohmann::json parse_object(const std::string& json_text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::bad_file, origin + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) fail(ErrorCode::bad_file, origin + ": expected a JSON object");
  return j;
}
}  // namespace

Config config_from_json(const std::string& json_text, const std::string& origin) {
  nlohmann::json j = parse_object(json_text, origin);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(kKeys.begin(), kKeys.end(), it.key()) == kKeys.end()) {
      fail(ErrorCode::bad_file, origin + ": unknown config key '" + it.key() + "'");
    }
  }
  Config c;
  auto get_int = [&](const char* k, int64_t& dst) {
    if (!j.contains(k)) return;
    if (!j[k].is_number_integer()) fail(ErrorCode::bad_file, origin + ": '" + k + "' must be an integer");
    dst = j[k].get<int64_t>();
  };
  auto get_bool = [&](const char* k, bool& dst) {
    if (!j.contains(k)) return;
    if (!j[k].is_boolean()) fail(ErrorCode::bad_file, origin + ": '" + k + "' must be true or false");
    dst = j[k].get<bool>();
  };
  get_int("d_model", c.d_model);
  get_int("num_heads", c.num_heads);
  get_int("num_kv_heads", c.num_kv_heads);
  get_int("d_in", c.d_in);
  get_int("kdim", c.kdim);
  get_int("vdim", c.vdim);
  get_int("context_length", c.context_length);
  get_bool("qkv_bias", c.qkv_bias);
  get_bool("out_bias", c.out_bias);
  get_bool("causal", c.causal);
  if (j.contains("dropout")) {
    if (!j["dropout"].is_number()) fail(ErrorCode::bad_file, origin + ": 'dropout' must be a number");
    c.dropout = j["dropout"].get<float>();
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail(ErrorCode::bad_file, origin + ": " + e.what());
  }
  return c;
}

namespace {
std::string read_config_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(ErrorCode::bad_file, path + ": cannot open config file");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

Config load_config(const std::string& path) { return config_from_json(read_config_file(path), path); }

Config hf_gpt2_config_from_json(const std::string& json_text, const std::string& origin) {
  const nlohmann::json j = parse_object(json_text, origin);
  auto get = [&](std::initializer_list<const char*> keys) -> int64_t {
    for (const char* k : keys) {
      if (!j.contains(k)) continue;
      if (!j[k].is_number_integer()) fail(ErrorCode::bad_file, origin + ": '" + k + "' must be an integer");
      return j[k].get<int64_t>();
    }
    fail(ErrorCode::bad_file, origin + ": no '" + *keys.begin() + "' (a Hugging Face GPT-2 config.json has it)");
  };
  Config c;
  c.d_model = get({"n_embd"});
  c.num_heads = get({"n_head"});
  c.context_length = get({"n_positions", "n_ctx"});
  c.causal = true;
  try {
    c.validate();
  } catch (const Error& e) {
    fail(ErrorCode::bad_file, origin + ": " + e.what());
  }
  return c;
}

Config load_any_config(const std::string& path) {
  const std::string text = read_config_file(path);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_object() && j.contains("n_embd")) return hf_gpt2_config_from_json(text, path);
  return config_from_json(text, path);
}

std::string to_json(const Config& c) {
  nlohmann::json j = {{"d_model", c.d_model}, {"num_heads", c.num_heads}, {"num_kv_heads", c.kv_heads()},
                      {"d_in", c.query_width()},
                      {"kdim", c.key_width()}, {"vdim", c.value_width()}, {"context_length", c.context_length},
                      {"qkv_bias", c.qkv_bias}, {"out_bias", c.out_bias}, {"causal", c.causal},
                      {"dropout", c.dropout}};
  return j.dump();
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (int i = 0; i < detail::kPresetCount; ++i) names.emplace_back(detail::kPresetJson[i].first);
  return names;
}

Config preset(const std::string& name) {
  for (int i = 0; i < detail::kPresetCount; ++i) {
    if (detail::kPresetJson[i].first == name) {
      return config_from_json(std::string(detail::kPresetJson[i].second), "preset " + name);
    }
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  invalid("unknown preset '" + name + "' (known: " + known + ")");
}

}  // namespace gpt2attn
