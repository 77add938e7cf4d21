// engine/config.cpp: Config validation, JSON (de)serialisation and the compiled-in presets.
// The preset text comes from configs/*.json through CMake (generated/presets.cpp); nothing is duplicated here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "gpt2attn/config.hpp"
#include "gpt2attn/error.hpp"
#include "support/file_io.hpp"

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
// A config file's text as a JSON object, or Error(bad_file) naming the file. Refused besides text that is not JSON:
// a NUL byte (nlohmann would stop there as at the end of the input and accept "{...}\0garbage"), a key given
// twice in one object (nlohmann keeps the last one, so {"num_heads": 4, "num_heads": 2} would silently mean 2),
// and a leading UTF-8 byte-order mark (nlohmann skips it; the safetensors reader's rule, io::refuse_byte_order_mark).
nlohmann::json parse_object(const std::string& json_text, const std::string& origin) {
  io::refuse_byte_order_mark(json_text, origin, "config");
  if (const size_t nul = json_text.find('\0'); nul != std::string::npos) {
    fail(ErrorCode::bad_file, origin + ": not valid JSON: NUL byte at offset " + std::to_string(nul));
  }
  // The keys seen so far in each open object, innermost last (arrays hold no keys and take no entry). A key
  // event always belongs to the innermost open object, since everything opened inside it has closed by then.
  struct OpenObject {
    std::set<std::string> keys;
    std::string last;  // the latest key: it names the value being parsed, for a message about a key inside it
  };
  std::vector<OpenObject> open;
  using Event = nlohmann::json::parse_event_t;
  const auto on_event = [&](int /*depth*/, Event event, nlohmann::json& parsed) {
    if (event == Event::object_start) {
      open.emplace_back();
    } else if (event == Event::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == Event::key && !open.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open.back().keys.insert(key).second) {
        std::string where;
        for (size_t i = 0; i + 1 < open.size(); ++i) where += (i ? "." : "") + open[i].last;
        fail(ErrorCode::bad_file, origin + ": key '" + key + "' given twice" +
                                      (where.empty() ? std::string() : " (in '" + where + "')"));
      }
      open.back().last = key;
    }
    return true;  // keep everything: the callback only watches
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text, on_event);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::bad_file, origin + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) fail(ErrorCode::bad_file, origin + ": expected a JSON object");
  return j;
}

// An integer field. An integer past int64 (nlohmann holds one up to 2^64 - 1 as unsigned, and a larger one as a
// double) is out of range, reported as written rather than as the value a conversion would wrap it to.
int64_t integer_field(const nlohmann::json& v, const std::string& origin, const std::string& key) {
  const bool too_large_unsigned =
      v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const bool whole_float_past_int64 = v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>() &&
                                      std::fabs(v.get<double>()) >= 0x1p63;
  if (too_large_unsigned || whole_float_past_int64) {
    fail(ErrorCode::bad_file, origin + ": '" + key + "' is out of range: " + v.dump() +
                                  " does not fit a 64-bit signed integer");
  }
  if (!v.is_number_integer()) fail(ErrorCode::bad_file, origin + ": '" + key + "' must be an integer");
  return v.get<int64_t>();
}

Config config_from_object(const nlohmann::json& j, const std::string& origin) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(kKeys.begin(), kKeys.end(), it.key()) == kKeys.end()) {
      fail(ErrorCode::bad_file, origin + ": unknown config key '" + it.key() + "'");
    }
  }
  Config c;
  auto get_int = [&](const char* k, int64_t& dst) {
    if (!j.contains(k)) return;
    dst = integer_field(j[k], origin, k);
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
    // The range is checked on the double as written, before it is narrowed: 1e300 would become inf and -1e-50
    // would become -0.0f, and the message would show the float rather than what the file says.
    const nlohmann::json& v = j["dropout"];
    if (!v.is_number()) fail(ErrorCode::bad_file, origin + ": 'dropout' must be a number");
    const double p = v.get<double>();
    if (!(p >= 0.0 && p < 1.0)) fail(ErrorCode::bad_file, origin + ": 'dropout' must be in [0, 1), got " + v.dump());
    c.dropout = static_cast<float>(p);
    if (!(c.dropout < 1.0f)) {  // from 1 - 2^-25 up the nearest float is 1, which drops every weight
      fail(ErrorCode::bad_file, origin + ": 'dropout' " + v.dump() +
                                    " rounds to 1 as a float (the largest float below 1 is 0.99999994)");
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail(ErrorCode::bad_file, origin + ": " + e.what());
  }
  return c;
}
}  // namespace

Config config_from_json(const std::string& json_text, const std::string& origin) {
  return config_from_object(parse_object(json_text, origin), origin);
}

namespace {
// Far above any real config (ours are ~150 bytes, a Hugging Face GPT-2 config.json ~1 KB).
constexpr std::uintmax_t kMaxConfigFileBytes = std::uintmax_t{1} << 20;

// A config file's bytes. Only a regular file (or a link to one) is read, and only up to kMaxConfigFileBytes: the
// descriptor's type is checked (io::ReadFile), so a FIFO does not block, /dev/zero is not read until memory runs
// out, and a directory is not reported as invalid JSON.
std::string read_config_file(const std::string& path) {
  const io::ReadFile f(path, "config file");
  const std::string limit = "the " + std::to_string(kMaxConfigFileBytes) + "-byte (1 MiB) limit on a config file";
  if (f.size() > kMaxConfigFileBytes) {
    fail(ErrorCode::bad_file, path + ": " + std::to_string(f.size()) + " bytes, over " + limit);
  }
  std::string text(f.size(), '\0');
  f.read_at(0, text.data(), text.size());
  // A file that grew after it was measured would be parsed cut short: refuse it rather than guess.
  if (f.grew()) {
    fail(ErrorCode::bad_file, path + ": cannot read config file: it holds more than the " + std::to_string(f.size()) +
                                  " bytes it reported (it grew while being read, or is a /proc-like file)");
  }
  return text;
}
}  // namespace

Config load_config(const std::string& path) { return config_from_json(read_config_file(path), path); }

namespace {
// Hugging Face GPT-2 config keys that change what attention computes. gpt2attn computes causal self-attention with
// scores scaled by 1/sqrt(D) and nothing else, which is what each key means at its default value (`computes`);
// any other value describes a different model, refused rather than silently computed wrong. Numerics-only keys
// (reorder_and_upcast_attn: fp32 scores under fp16 autocast) and training-only ones (attn_pdrop) are not here.
struct HfComputationKey {
  const char* key;
  bool computes;    // the value gpt2attn's attention computes (Hugging Face's default)
  const char* why;  // what the other value means
};
constexpr HfComputationKey kHfComputationKeys[] = {
    {"scale_attn_weights", true,
     "the model's attention scores are not scaled by 1/sqrt(head_dim); gpt2attn always scales them"},
    {"scale_attn_by_inverse_layer_idx", false,
     "the model scales each layer's attention scores by 1/(layer index + 1); gpt2attn does not"},
    {"add_cross_attention", false,
     "the model's blocks add cross-attention over encoder states; gpt2attn computes causal self-attention only"},
};

Config hf_gpt2_config_from_object(const nlohmann::json& j, const std::string& origin) {
  auto get = [&](std::initializer_list<const char*> keys) -> int64_t {
    for (const char* k : keys) {
      if (!j.contains(k)) continue;
      return integer_field(j[k], origin, k);
    }
    fail(ErrorCode::bad_file, origin + ": no '" + *keys.begin() + "' (a Hugging Face GPT-2 config.json has it)");
  };
  for (const HfComputationKey& h : kHfComputationKeys) {
    if (!j.contains(h.key)) continue;
    const nlohmann::json& v = j[h.key];
    if (!v.is_boolean()) fail(ErrorCode::bad_file, origin + ": '" + h.key + "' must be true or false");
    if (v.get<bool>() != h.computes) {
      fail(ErrorCode::bad_file, origin + ": '" + h.key + "' is " + (h.computes ? "false" : "true") + ": " + h.why);
    }
  }
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
}  // namespace

Config hf_gpt2_config_from_json(const std::string& json_text, const std::string& origin) {
  return hf_gpt2_config_from_object(parse_object(json_text, origin), origin);
}

namespace {
// The Hugging Face GPT-2 keys that size the attention (the ones hf_gpt2_config_from_object reads).
constexpr const char* kHfSizeKeys[] = {"n_embd", "n_head", "n_positions", "n_ctx"};
}  // namespace

Config load_any_config(const std::string& path) {
  const nlohmann::json j = parse_object(read_config_file(path), path);
  // A file with keys of both kinds is refused: reading either kind alone would silently drop the other's sizes
  // (a d_model next to n_embd, a context_length next to n_positions), and which one the writer meant is unknowable.
  const char* hf_key = nullptr;
  const std::string* native_key = nullptr;
  for (const char* k : kHfSizeKeys) {
    if (j.contains(k)) {
      hf_key = k;
      break;
    }
  }
  for (const std::string& k : kKeys) {
    if (j.contains(k)) {
      native_key = &k;
      break;
    }
  }
  if (hf_key != nullptr && native_key != nullptr) {
    fail(ErrorCode::bad_file, path + ": holds both Hugging Face GPT-2 keys ('" + hf_key + "') and gpt2attn keys ('" +
                                  *native_key + "'); a config is one kind or the other, so remove one set");
  }
  if (hf_key != nullptr) return hf_gpt2_config_from_object(j, path);
  return config_from_object(j, path);
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
