// Hugging Face GPT-2 checkpoints (open_gpt2_checkpoint, gpt2_config_from_json) and random_gpt2. The checkpoints are
// written here with the library's safetensors writer and known values, so every view is checked element by element;
// one test also reads what scripts/make_gpt2_checkpoint.py writes, where Python and torch are there.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/gpt2_checkpoint.hpp"
#include "gpt2attn/safetensors.hpp"
#include "kernels/bf16.hpp"
#include "tests/file_test_util.hpp"

namespace gpt2attn {
namespace {

using testutil::ThrowsError;
constexpr int64_t E = 32, V = 100, P = 64, I = 4 * E;

// A tensor as the test writes it: name without prefix, dtype, shape and its values as f32.
struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Value i of tensor t: small multiples of 1/64 with at most 7 significant bits, exact in bf16 and f16 alike.
float known(size_t t, int64_t i) { return static_cast<float>((i * 7 + static_cast<int64_t>(t) * 13) % 251 - 125) / 64; }

std::vector<Entry> gpt2_entries(int64_t layers, const std::string& dtype) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {{"wte.weight", {V, E}}, {"wpe.weight", {P, E}}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    // clang-format off
    for (auto s : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln_1.weight", {E}}, {"ln_1.bias", {E}}, {"attn.c_attn.weight", {E, 3 * E}},
             {"attn.c_attn.bias", {3 * E}}, {"attn.c_proj.weight", {E, E}}, {"attn.c_proj.bias", {E}},
             {"ln_2.weight", {E}}, {"ln_2.bias", {E}},
             {"mlp.c_fc.weight", {E, I}}, {"mlp.c_fc.bias", {I}}, {"mlp.c_proj.weight", {I, E}},
             {"mlp.c_proj.bias", {E}}, {"attn.bias", {1, 1, P, P}}})  // attn.bias: the mask buffer, ignored
      // clang-format on
      specs.emplace_back(h + s.first, s.second);
  }
  specs.push_back({"ln_f.weight", {E}});
  specs.push_back({"ln_f.bias", {E}});
  std::vector<Entry> out;
  for (size_t t = 0; t < specs.size(); ++t) {
    Entry e{specs[t].first, dtype, specs[t].second, {}};
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    for (int64_t i = 0; i < n; ++i) e.values.push_back(known(t, i));
    out.push_back(std::move(e));
  }
  return out;
}

std::string encode(const Entry& e) {
  std::string b;
  for (float x : e.values) {
    if (e.dtype == "F32" || e.dtype == "I32") {
      const int32_t i = static_cast<int32_t>(x);
      b.append(reinterpret_cast<const char*>(e.dtype == "F32" ? static_cast<const void*>(&x) : &i), 4);
    } else {
      const _Float16 f = static_cast<_Float16>(x);
      const uint16_t h = e.dtype == "BF16" ? kernels::to_bf16(x).bits : std::bit_cast<uint16_t>(f);
      b.append(reinterpret_cast<const char*>(&h), 2);
    }
  }
  return b;
}

float widen(const std::byte* p, DType t) {
  if (t == DType::f32) return *reinterpret_cast<const float*>(p);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(p);
  return t == DType::bf16 ? kernels::widen(kernels::bf16{h}) : static_cast<float>(std::bit_cast<_Float16>(h));
}
float at(const TensorView& v, int64_t r, int64_t c = 0) {
  const int64_t off = r * v.strides[0] + (v.rank == 2 ? c * v.strides[1] : 0);
  return widen(static_cast<const std::byte*>(v.data) + off * static_cast<int64_t>(size_of(v.dtype)), v.dtype);
}

void expect_sizes(const GPT2Config& c, int64_t vocab, int64_t positions, int64_t embd, int64_t layers, int64_t heads) {
  EXPECT_EQ(c.vocab_size, vocab);
  EXPECT_EQ(c.n_positions, positions);
  EXPECT_EQ(c.n_embd, embd);
  EXPECT_EQ(c.n_layer, layers);
  EXPECT_EQ(c.n_head, heads);
}

// A checkpoint directory: config.json (`config`, keys mapped to JSON text; "" removes one) and the entries in
// `shards` files (model.safetensors, or model-0000k-of-0000n.safetensors + index).
struct Writer {
  // clang-format off
  std::map<std::string, std::string> config = {
      {"vocab_size", "100"}, {"n_positions", "64"}, {"n_ctx", "64"}, {"n_embd", "32"}, {"n_layer", "2"},
      {"n_head", "4"}, {"n_inner", "null"}, {"layer_norm_epsilon", "1e-05"}, {"activation_function", "\"gelu_new\""},
      {"tie_word_embeddings", "true"}, {"model_type", "\"gpt2\""}};
  // clang-format on
  std::vector<Entry> entries = gpt2_entries(2, "F32");
  int shards = 1;
  bool prefix = true;

  std::string config_text() const {
    std::string s = "{";
    for (const auto& [k, v] : config)
      if (!v.empty()) s += (s.size() > 1 ? ", \"" : "\"") + k + "\": " + v;
    return s + "}";
  }
  void write(const std::string& dir) const {
    std::filesystem::create_directories(dir);
    testutil::write_bytes(dir + "/config.json", config_text());
    std::vector<std::string> bytes;
    for (const Entry& e : entries) bytes.push_back(encode(e));
    std::string index = "{\"metadata\": {}, \"weight_map\": {";
    for (int k = 0; k < shards; ++k) {
      char file[64];
      std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", k + 1, shards);
      const std::string name = shards == 1 ? "model.safetensors" : file;
      std::vector<safetensors::TensorBytes> part;
      for (size_t i = k * entries.size() / shards; i < (k + 1) * entries.size() / shards; ++i) {
        const Entry& e = entries[i];
        const std::string stored = (prefix && e.name != "lm_head.weight" ? "transformer." : "") + e.name;
        part.push_back({stored, e.dtype, e.shape, bytes[i].data(), bytes[i].size()});
        index += (index.back() == '{' ? "\"" : ", \"") + stored + "\": \"" + name + "\"";
      }
      safetensors::write(dir + "/" + name, part, {{"format", "pt"}});
    }
    if (shards > 1) testutil::write_bytes(dir + "/model.safetensors.index.json", index + "}}");
  }
  Entry& entry(const std::string& name) {
    for (Entry& e : entries)
      if (e.name == name) return e;
    throw std::runtime_error("no entry " + name);
  }
};

class GPT2CheckpointOpen : public testutil::TempDirTest {};

TEST_F(GPT2CheckpointOpen, ViewsAreTheStoredValuesInTorchLayout) {
  struct Variant {
    const char* dtype;
    DType type;
    int shards;
    bool prefix;
  };
  for (const Variant& var : {Variant{"F32", DType::f32, 1, true}, Variant{"BF16", DType::bf16, 3, false},
                             Variant{"F16", DType::f16, 3, true}, Variant{"F16", DType::f16, 1, false}}) {
    SCOPED_TRACE(std::string(var.dtype) + " shards=" + std::to_string(var.shards) +
                 " prefix=" + std::to_string(var.prefix));
    Writer w;
    w.entries = gpt2_entries(2, var.dtype);
    w.shards = var.shards;
    w.prefix = var.prefix;
    const std::string dir = path(std::string(var.dtype) + std::to_string(var.shards) + std::to_string(var.prefix));
    w.write(dir);
    GPT2Checkpoint ck = open_gpt2_checkpoint(dir);
    expect_sizes(ck.config, V, P, E, 2, 4);
    EXPECT_EQ(ck.config.inner(), I);
    EXPECT_EQ(ck.config.layer_norm_epsilon, 1e-5f);
    // The views outlive the files' names: storage holds the mappings.
    std::filesystem::remove_all(dir);
    const GPT2Weights& g = ck.weights;
    ASSERT_EQ(g.blocks.size(), 2u);

    std::map<std::string, size_t> t;  // tensor index, as known() numbers them
    for (size_t i = 0; i < w.entries.size(); ++i) t[w.entries[i].name] = i;
    // view element [r, c] against the stored tensor's element flat(r, c); strides as expected.
    const auto check = [&](const TensorView& v, const std::string& name, std::vector<int64_t> shape,
                           std::vector<int64_t> strides, const std::function<int64_t(int64_t, int64_t)>& flat) {
      SCOPED_TRACE(name);
      ASSERT_EQ(v.dtype, var.type);
      ASSERT_EQ(std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.rank), shape);
      ASSERT_EQ(std::vector<int64_t>(v.strides.begin(), v.strides.begin() + v.rank), strides);
      const int64_t cols = v.rank == 2 ? shape[1] : 1;
      for (int64_t r = 0; r < shape[0]; ++r)
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(at(v, r, c), known(t.at(name), flat(r, c))) << "[" << r << ", " << c << "]";
    };
    const auto rows = [](int64_t ld) { return [ld](int64_t r, int64_t c) { return r * ld + c; }; };
    // Conv1D: view [o, i] is stored [i, offset + o] of a (in, ld) tensor.
    const auto conv = [](int64_t ld, int64_t offset) {
      return [=](int64_t o, int64_t i) { return i * ld + offset + o; };
    };
    check(g.wte, "wte.weight", {V, E}, {E, 1}, rows(E));
    check(g.wpe, "wpe.weight", {P, E}, {E, 1}, rows(E));
    check(g.ln_f_weight, "ln_f.weight", {E}, {1}, rows(1));
    check(g.ln_f_bias, "ln_f.bias", {E}, {1}, rows(1));
    for (int64_t l = 0; l < 2; ++l) {
      const GPT2BlockWeights& b = g.blocks[l];
      const std::string h = "h." + std::to_string(l) + ".";
      check(b.ln_1_weight, h + "ln_1.weight", {E}, {1}, rows(1));
      check(b.ln_1_bias, h + "ln_1.bias", {E}, {1}, rows(1));
      check(b.ln_2_weight, h + "ln_2.weight", {E}, {1}, rows(1));
      check(b.ln_2_bias, h + "ln_2.bias", {E}, {1}, rows(1));
      check(b.attn.w_q, h + "attn.c_attn.weight", {E, E}, {1, 3 * E}, conv(3 * E, 0));
      check(b.attn.w_k, h + "attn.c_attn.weight", {E, E}, {1, 3 * E}, conv(3 * E, E));
      check(b.attn.w_v, h + "attn.c_attn.weight", {E, E}, {1, 3 * E}, conv(3 * E, 2 * E));
      check(b.attn.b_q, h + "attn.c_attn.bias", {E}, {1}, rows(1));
      check(b.attn.b_k, h + "attn.c_attn.bias", {E}, {1}, [](int64_t r, int64_t) { return E + r; });
      check(b.attn.b_v, h + "attn.c_attn.bias", {E}, {1}, [](int64_t r, int64_t) { return 2 * E + r; });
      check(b.attn.w_o, h + "attn.c_proj.weight", {E, E}, {1, E}, conv(E, 0));
      check(b.attn.b_o, h + "attn.c_proj.bias", {E}, {1}, rows(1));
      check(b.fc_weight, h + "mlp.c_fc.weight", {I, E}, {1, I}, conv(I, 0));
      check(b.fc_bias, h + "mlp.c_fc.bias", {I}, {1}, rows(1));
      check(b.proj_weight, h + "mlp.c_proj.weight", {E, I}, {1, E}, conv(E, 0));
      check(b.proj_bias, h + "mlp.c_proj.bias", {E}, {1}, rows(1));
    }
    EXPECT_NO_THROW(g.validate(ck.config));
  }
}

TEST_F(GPT2CheckpointOpen, LmHeadEqualToWteIsAcceptedInAnotherDtype) {
  Writer w;
  w.entries = gpt2_entries(2, "BF16");
  Entry head = w.entry("wte.weight");
  head.name = "lm_head.weight";
  head.dtype = "F32";  // the same values, wider
  w.entries.push_back(head);
  w.write(path("ck"));
  EXPECT_NO_THROW(open_gpt2_checkpoint(path("ck")));
}

TEST_F(GPT2CheckpointOpen, ErrorsNameTheFileAndTheTensor) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* what;
    std::function<void(Writer&)> edit;
    std::vector<std::string> needles;  // the first is the file in the checkpoint the message must name ("": the dir)
    std::function<void(const std::string& dir)> after = nullptr;
  };
  const auto set = [](std::string key, std::string json) { return [=](Writer& w) { w.config[key] = json; }; };
  const auto sharded = [](Writer& w) { w.shards = 3; };
  const auto remove = [](std::string file) {
    return [=](const std::string& dir) { std::filesystem::remove(dir + file); };
  };
  const std::vector<Case> cases = {
      {"missing tensor",
       [](Writer& w) { std::erase_if(w.entries, [](const Entry& e) { return e.name == "h.1.mlp.c_fc.weight"; }); },
       {"model.safetensors", "'h.1.mlp.c_fc.weight'"}},
      {"misshapen tensor",
       [](Writer& w) {
         Entry& e = w.entry("h.0.attn.c_attn.weight");
         e.shape = {E, 2 * E};
         e.values.resize(E * 2 * E);
       },
       {"model.safetensors", "'transformer.h.0.attn.c_attn.weight' has shape [32, 64], expected [32, 96]"}},
      {"int dtype",
       [](Writer& w) { w.entry("wpe.weight").dtype = "I32"; },
       {"model.safetensors", "'transformer.wpe.weight' has dtype I32"}},
      {"n_layer past the blocks", set("n_layer", "3"), {"model.safetensors", "'h.2.ln_1.weight'", "n_layer=3"}},
      {"a block past n_layer", set("n_layer", "1"), {"model.safetensors", "'transformer.h.1.", "n_layer=1"}},
      {"lm_head differs",
       [](Writer& w) {
         Entry head = w.entry("wte.weight");
         head.name = "lm_head.weight";
         head.values[3 * E + 5] += 1;
         w.entries.push_back(head);
       },
       {"model.safetensors", "'lm_head.weight' differs from wte at [3, 5]"}},
      {"NaN",
       [&](Writer& w) { w.entry("h.1.mlp.c_proj.weight").values[7 * E + 3] = nan; },
       {"model.safetensors", "'transformer.h.1.mlp.c_proj.weight': element [7, 3] is NaN"}},
      {"infinity in c_attn's K columns",
       [&](Writer& w) {
         w.shards = 3;
         w.entry("h.0.attn.c_attn.weight").values[2 * 3 * E + E + 8] = -inf;  // stored [2, 40]
       },
       {"model-0000", "'transformer.h.0.attn.c_attn.weight' (w_k): element [2, 40] is infinite"}},
      {"a shard missing",
       sharded,
       {"model.safetensors.index.json", "'model-00002-of-00003.safetensors'", "missing"},
       remove("/model-00002-of-00003.safetensors")},
      {"shard outside the directory",
       sharded,
       {"model.safetensors.index.json", "'../x.safetensors'"},
       [](const std::string& dir) {
         std::string text = testutil::read_bytes(dir + "/model.safetensors.index.json");
         text.replace(text.find("model-00001-of-00003.safetensors"), 32, "../x.safetensors");
         testutil::write_bytes(dir + "/model.safetensors.index.json", text);
       }},
      {"config.json missing", nullptr, {"config.json", "no such file"}, remove("/config.json")},
      {"no weights", nullptr, {"", "neither model.safetensors"}, remove("/model.safetensors")},
      {"missing key", set("vocab_size", ""), {"config.json", "'vocab_size'"}},
      {"wrong type", set("n_layer", "\"2\""), {"config.json", "'n_layer' must be an integer"}},
      {"float size", set("n_embd", "32.0"), {"config.json", "'n_embd' must be an integer"}},
      {"relu", set("activation_function", "\"relu\""), {"config.json", "'activation_function'"}},
      {"scaled by layer", set("scale_attn_by_inverse_layer_idx", "true"), {"config.json", "'scale_attn_by_inverse"}},
      {"untied head", set("tie_word_embeddings", "false"), {"config.json", "'tie_word_embeddings'"}},
      {"n_inner 0", set("n_inner", "0"), {"config.json", "'n_inner'"}},
      {"epsilon underflows", set("layer_norm_epsilon", "1e-60"), {"config.json", "layer_norm_epsilon"}},
      {"duplicate key",
       nullptr,
       {"config.json", "'n_layer' given twice"},
       [](const std::string& dir) {
         testutil::write_bytes(dir + "/config.json", "{\"n_layer\": 1, " + Writer().config_text().substr(1));
       }},
  };
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string dir = path("ck" + std::to_string(k++));
    Writer w;
    if (c.edit) c.edit(w);
    w.write(dir);
    if (c.after) c.after(dir);
    EXPECT_TRUE(ThrowsError([&] { open_gpt2_checkpoint(dir); }, ErrorCode::bad_file,
                            c.needles[0].empty() ? dir + ": " : dir + "/" + c.needles[0]));
    for (size_t i = 1; i < c.needles.size(); ++i)
      EXPECT_TRUE(ThrowsError([&] { open_gpt2_checkpoint(dir); }, ErrorCode::bad_file, c.needles[i]));
  }
  EXPECT_TRUE(ThrowsError([&] { open_gpt2_checkpoint(path("nowhere")); }, ErrorCode::bad_file, "nowhere: no such"));
}

TEST(GPT2CheckpointConfig, ReadsTheScriptsConfigJson) {
  // What scripts/make_gpt2_checkpoint.py writes (json.dump, indent 2) for --n-embd 48 --n-head 6 --layers 3.
  const std::string text = R"({
  "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
  "vocab_size": 101, "n_positions": 32, "n_ctx": 32, "n_embd": 48, "n_layer": 3, "n_head": 6, "n_inner": null,
  "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
  "scale_attn_weights": true, "tie_word_embeddings": true, "bos_token_id": 50256, "eos_token_id": 50256,
  "torch_dtype": "bfloat16"})";
  const GPT2Config c = gpt2_config_from_json(text);
  expect_sizes(c, 101, 32, 48, 3, 6);
  EXPECT_EQ(c.n_inner, 0);
  EXPECT_EQ(c.layer_norm_epsilon, 1e-5f);
  // n_ctx alone gives the positions; n_inner and the epsilon as written.
  const GPT2Config d = gpt2_config_from_json(R"({"vocab_size": 7, "n_ctx": 16, "n_embd": 8, "n_layer": 1,
                                                 "n_head": 2, "n_inner": 24, "layer_norm_epsilon": 0.001})");
  EXPECT_EQ(d.n_positions, 16);
  EXPECT_EQ(d.inner(), 24);
  EXPECT_EQ(d.layer_norm_epsilon, 0.001f);
  EXPECT_TRUE(
      ThrowsError([] { gpt2_config_from_json("\xEF\xBB\xBF{}", "cfg"); }, ErrorCode::bad_file, "byte-order mark"));
}

TEST(GPT2CheckpointScript, OpensWhatMakeGpt2CheckpointWrites) {
#ifndef GPT2ATTN_SOURCE_DIR
  GTEST_SKIP() << "GPT2ATTN_SOURCE_DIR is not defined: the script's path is unknown";
#else
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3 to run the script";
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch, which the script needs";
  const std::string dir = testing::TempDir() + "gpt2attn_script_ckpt_" + std::to_string(::getpid());
  const std::string cmd = std::string("/usr/bin/python3 ") + GPT2ATTN_SOURCE_DIR + "/scripts/make_gpt2_checkpoint.py " +
                          dir +
                          " --n-embd 32 --n-head 4 --layers 2 --vocab 100 --n-positions 64 --dtype BF16 --shards 3"
                          " --seed 7 >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const GPT2Config c = gpt2_config_from_json(testutil::read_bytes(dir + "/config.json"));
  expect_sizes(c, V, P, E, 2, 4);
  EXPECT_EQ(c.inner(), I);
  const GPT2Checkpoint ck = open_gpt2_checkpoint(dir);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(ck.weights.wte.dtype, DType::bf16);
  EXPECT_EQ(at(ck.weights.blocks[1].ln_2_weight, 5), 1.0f);
  EXPECT_EQ(at(ck.weights.blocks[1].attn.b_v, 5), 0.0f);
  double sq = 0;
  for (int64_t i = 0; i < V * E; ++i) sq += std::pow(at(ck.weights.wte, i / E, i % E), 2);
  EXPECT_NEAR(std::sqrt(sq / (V * E)), 0.02, 0.002);
#endif
}

GPT2Config small() {
  GPT2Config c;
  c.vocab_size = V, c.n_positions = P, c.n_embd = E, c.n_layer = 2, c.n_head = 4;
  return c;
}

// All of a checkpoint's values as f32, in params order, from the views (widened exactly).
std::vector<float> values(const GPT2Weights& w) {
  std::vector<float> out;
  const auto add = [&](const TensorView& v) {
    for (int64_t r = 0; r < v.shape[0]; ++r)
      for (int64_t c = 0; c < (v.rank == 2 ? v.shape[1] : 1); ++c) out.push_back(at(v, r, c));
  };
  add(w.wte), add(w.wpe), add(w.ln_f_weight), add(w.ln_f_bias);
  for (const GPT2BlockWeights& b : w.blocks)
    for (const TensorView* v : {&b.ln_1_weight, &b.ln_1_bias, &b.attn.w_q, &b.attn.w_k, &b.attn.w_v, &b.attn.b_q,
                                &b.attn.b_k, &b.attn.b_v, &b.attn.w_o, &b.attn.b_o, &b.ln_2_weight, &b.ln_2_bias,
                                &b.fc_weight, &b.fc_bias, &b.proj_weight, &b.proj_bias})
      add(*v);
  return out;
}

double stddev(const TensorView& v) {
  double sq = 0;
  for (int64_t r = 0; r < v.shape[0]; ++r)
    for (int64_t c = 0; c < v.shape[1]; ++c) sq += std::pow(at(v, r, c), 2);
  return std::sqrt(sq / static_cast<double>(v.numel()));
}

TEST(GPT2CheckpointRandom, DeterministicWithGPT2sInitialization) {
  const GPT2Checkpoint a = random_gpt2(small(), 42), b = random_gpt2(small(), 42), other = random_gpt2(small(), 43);
  const std::vector<float> va = values(a.weights);
  EXPECT_EQ(va, values(b.weights));
  EXPECT_NE(va, values(other.weights));
  EXPECT_NO_THROW(a.weights.validate(a.config));
  const GPT2BlockWeights& blk = a.weights.blocks[1];
  EXPECT_NEAR(stddev(a.weights.wte), 0.02, 0.002);  // 3200 draws: 10% is about 8 standard errors
  EXPECT_NEAR(stddev(blk.fc_weight), 0.02, 0.002);
  EXPECT_NEAR(stddev(blk.attn.w_o), 0.01, 0.001);  // 0.02 / sqrt(2 n_layer)
  EXPECT_NEAR(stddev(blk.proj_weight), 0.01, 0.001);
  EXPECT_EQ(at(blk.ln_1_weight, 3), 1.0f);
  EXPECT_EQ(at(blk.attn.b_k, 3), 0.0f);
  EXPECT_EQ(blk.attn.w_k.strides[1], 3 * E);  // laid out as a checkpoint is: Conv1D views
  // bf16 and f16: the f32 draws rounded to nearest even.
  const std::vector<float> vb = values(random_gpt2(small(), 42, DType::bf16).weights);
  const std::vector<float> vh = values(random_gpt2(small(), 42, DType::f16).weights);
  ASSERT_EQ(vb.size(), va.size());
  ASSERT_EQ(vh.size(), va.size());
  int subnormal = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    ASSERT_EQ(vb[i], kernels::widen(kernels::to_bf16(va[i]))) << i;
    ASSERT_EQ(vh[i], static_cast<float>(static_cast<_Float16>(va[i]))) << i << ": " << va[i];
    subnormal += va[i] != 0 && std::fabs(va[i]) < 0x1p-14f;
  }
  EXPECT_GT(subnormal, 0);  // the f16 rounding was tried below its normal range
  EXPECT_EQ(random_gpt2(small(), 42, DType::bf16).weights.wte.dtype, DType::bf16);
  EXPECT_TRUE(ThrowsError([] { random_gpt2(small(), 1, DType::i8); }, ErrorCode::invalid_argument, "i8"));
}

TEST(GPT2CheckpointValidate, NamesTheTensorAndTheElement) {
  const GPT2Checkpoint ck = random_gpt2(small(), 1);
  std::vector<float> bias(I, 0.0f), qkv(E * 3 * E, 0.0f);
  bias[5] = std::numeric_limits<float>::quiet_NaN();
  qkv[2 * 3 * E + E + 8] = std::numeric_limits<float>::infinity();  // stored [2, 40]: w_k's [8, 2]
  GPT2Weights w = ck.weights;
  w.blocks[1].fc_bias = TensorView::f32(bias.data(), {I});
  EXPECT_TRUE(ThrowsError([&] { w.validate(ck.config); }, ErrorCode::invalid_argument,
                          "'h.1.mlp.c_fc.bias': element [5] is NaN"));
  w = ck.weights;
  w.blocks[0].attn.w_k = TensorView::f32(qkv.data(), {E, 3 * E}).with_strides({1, 3 * E});
  w.blocks[0].attn.w_k.data = qkv.data() + E;
  w.blocks[0].attn.w_k.shape = {E, E, 0, 0};
  EXPECT_TRUE(ThrowsError([&] { w.validate(ck.config); }, ErrorCode::invalid_argument,
                          "'h.0.attn.c_attn.weight' (w_k): element [2, 40] is infinite"));
  w = ck.weights;
  w.blocks[1].fc_weight = w.blocks[1].proj_weight;
  EXPECT_TRUE(ThrowsError([&] { w.validate(ck.config); }, ErrorCode::invalid_argument,
                          "'h.1.mlp.c_fc.weight' has shape [32, 128], expected [128, 32]"));
  w = ck.weights;
  w.ln_f_bias.dtype = DType::u8;
  EXPECT_TRUE(ThrowsError([&] { w.validate(ck.config); }, ErrorCode::invalid_argument, "'ln_f.bias' has dtype u8"));
  w = ck.weights;
  w.blocks.pop_back();
  EXPECT_TRUE(ThrowsError([&] { w.validate(ck.config); }, ErrorCode::invalid_argument, "n_layer is 2"));
}

TEST(GPT2CheckpointSafetensorsFile, PublicReaderNamesFileAndTensor) {
  const std::string p = testing::TempDir() + "gpt2attn_sf_" + std::to_string(::getpid()) + ".safetensors";
  const std::vector<int32_t> ints{1, 2, 3};
  const std::vector<float> f{1.5f, -2.0f};
  safetensors::write(p,
                     {{"i", "I32", {3}, ints.data(), 12},
                      {"f", "F32", {2, 1}, f.data(), 8},
                      {"r5", "F32", {1, 1, 1, 1, 2}, f.data(), 8}},
                     {{"format", "pt"}});
  const SafetensorsFile file = SafetensorsFile::open(p);
  std::filesystem::remove(p);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"f", "i", "r5"}));
  EXPECT_EQ(file.shape("r5").size(), 5u);  // any rank is listed; TensorView holds at most 4
  EXPECT_TRUE(ThrowsError([&] { file.view("r5"); }, ErrorCode::bad_file, p + ": tensor 'r5' has rank 5"));
  EXPECT_EQ(file.dtype("i"), "I32");
  EXPECT_EQ(file.shape("f"), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(at(file.view("f"), 1, 0), -2.0f);
  EXPECT_TRUE(ThrowsError([&] { file.view("i"); }, ErrorCode::bad_file, p + ": tensor 'i' has dtype I32"));
  EXPECT_TRUE(ThrowsError([&] { file.shape("g"); }, ErrorCode::bad_file, p + ": no tensor named 'g'"));
  EXPECT_TRUE(ThrowsError([&] { SafetensorsFile::open(p); }, ErrorCode::bad_file, "no such file"));
}

}  // namespace
}  // namespace gpt2attn
