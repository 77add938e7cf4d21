// tests/test_quantized_io.cpp: save_quantized / load_quantized (engine/io/quantized_io.cpp): the file's bytes as
// gpt2attn/weights.hpp documents them, a round trip bit for bit, layers built from a loaded file computing bit for bit
// what layers quantizing the float weights compute (forward, a chunked extend, decode steps), and one refusal per
// kind of damage or disagreement, each Error(bad_file) naming the file and the tensor (or metadata key).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/gpt2attn.hpp"
#include "tests/file_test_util.hpp"
#include "tests/kv_harness.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::serving_config;
using testutil::ThrowsError;

constexpr WeightFormat kFormats[] = {WeightFormat::int8, WeightFormat::int4};

Config grouped(Config c, int64_t kv_heads) {
  c.num_kv_heads = kv_heads;
  return c;
}

// The layers of the round trips: plain heads; grouped K/V heads without q/k/v biases; an odd d_in (37: one int4 group
// of 32 and one of 5, and a padding nibble per row) without an output bias.
std::vector<Config> layer_configs() {
  return {serving_config(64, 4, 0, 64), grouped(serving_config(64, 4, 0, 64, /*qkv_bias=*/false), 2),
          serving_config(48, 2, 37, 64, true, /*out_bias=*/false)};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

::testing::AssertionResult same_matrix(const QuantizedMatrix& a, const QuantizedMatrix& b, const char* name) {
  if (a.rows != b.rows || a.cols != b.cols) {
    return ::testing::AssertionFailure() << name << ": (" << b.rows << ", " << b.cols << "), expected (" << a.rows
                                         << ", " << a.cols << ")";
  }
  if (a.codes != b.codes) return ::testing::AssertionFailure() << name << ": codes differ";
  if (!same_bits(a.scales, b.scales)) return ::testing::AssertionFailure() << name << ": scales differ";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_weights(const QuantizedWeights& a, const QuantizedWeights& b) {
  if (a.format != b.format) return ::testing::AssertionFailure() << "format " << to_string(b.format);
  for (auto r : {same_matrix(a.w_q, b.w_q, "w_q"), same_matrix(a.w_k, b.w_k, "w_k"), same_matrix(a.w_v, b.w_v, "w_v"),
                 same_matrix(a.w_o, b.w_o, "w_o")}) {
    if (!r) return r;
  }
  if (!same_bits(a.b_q, b.b_q) || !same_bits(a.b_k, b.b_k) || !same_bits(a.b_v, b.b_v) || !same_bits(a.b_o, b.b_o)) {
    return ::testing::AssertionFailure() << "biases differ";
  }
  return ::testing::AssertionSuccess();
}

// Everything one block outputs serving two sequences: forward (B = 2, T = 9); sequence 0 extended in two chunks
// (7 + 5), sequence 1 in one (4); two decode steps over both. Inputs from `seed`.
std::vector<float> serve(CausalSelfAttention& block, uint64_t seed) {
  const Config& c = block.config();
  const int64_t W = c.query_width(), E = c.d_model;
  std::mt19937_64 rng(seed);
  std::vector<float> all;
  const auto run = [&](int64_t rows, auto&& f) {
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(rows * W), rng, -2.0f, 2.0f);
    std::vector<float> y(static_cast<size_t>(rows * E), test::kNaN);
    f(x.data(), y.data());
    all.insert(all.end(), y.begin(), y.end());
  };
  run(2 * 9, [&](const float* x, float* y) { block.forward(x, 2, 9, y); });
  KvCache cache(c, test::pool(16, 64));
  const SequenceId ids[2] = {cache.create(), cache.create()};
  run(7, [&](const float* x, float* y) { block.extend(cache, ids[0], x, 7, y); });
  run(5, [&](const float* x, float* y) { block.extend(cache, ids[0], x, 5, y); });
  run(4, [&](const float* x, float* y) { block.extend(cache, ids[1], x, 4, y); });
  for (int step = 0; step < 2; ++step) run(2, [&](const float* x, float* y) { block.decode(cache, ids, 2, x, y); });
  return all;
}

class QuantizedIo : public testutil::TempDirTest {};

// quantize -> save -> load gives the same codes, scales and biases, bit for bit, and a block built from the loaded
// weights computes bit for bit what a block quantizing the float weights itself computes, in f32 and bf16.
TEST_F(QuantizedIo, RoundTripIsBitIdenticalAndLayersAgree) {
  uint64_t seed = 100;
  for (const Config& c : layer_configs()) {
    for (WeightFormat f : kFormats) {
      const std::string ctx = std::string(to_string(f)) + " | " + test::describe(c);
      const Weights w = Weights::random(c, ++seed);
      const QuantizedWeights q = QuantizedWeights::quantize(w.view(c), f);
      const std::string p = path("q.safetensors");
      save_quantized(p, c, q);
      const QuantizedWeights loaded = load_quantized(p, c);
      EXPECT_TRUE(same_weights(q, loaded)) << ctx;

      // The header alone gives the shapes, which complete a config of the heads alone.
      const std::optional<QuantizedLayerShapes> shapes = quantized_layer_shapes(p);
      ASSERT_TRUE(shapes.has_value()) << ctx;
      EXPECT_EQ(shapes->format, f);
      EXPECT_EQ(shapes->naming, "gpt2attn-quantized");
      Config heads_only;
      heads_only.num_heads = c.num_heads;
      heads_only.context_length = c.context_length;
      heads_only.causal = true;
      const Config completed = apply_loaded_shapes(heads_only, *shapes);
      EXPECT_EQ(completed.d_model, c.d_model) << ctx;
      EXPECT_EQ(completed.query_width(), c.query_width()) << ctx;
      EXPECT_EQ(completed.kv_width(), c.kv_width()) << ctx;
      EXPECT_EQ(completed.qkv_bias, c.qkv_bias) << ctx;
      EXPECT_EQ(completed.out_bias, c.out_bias) << ctx;
      EXPECT_TRUE(same_weights(q, load_quantized(p, completed))) << ctx;

      for (DType compute : {DType::f32, DType::bf16}) {
        CausalSelfAttention from_floats(c, w, EngineOptions{.threads = 2, .compute = compute, .weights = f});
        CausalSelfAttention from_file(c, loaded, EngineOptions{.threads = 2, .compute = compute});
        const std::vector<float> want = serve(from_floats, seed), got = serve(from_file, seed);
        EXPECT_TRUE(same_bits(want, got)) << ctx << ", " << to_string(compute) << " compute";
      }
    }
  }
}

// A MultiHeadAttention whose three input widths differ and are odd (d_in 37, kdim 13, vdim 45): each matrix's width
// and padding is its own, and cross-attention over the loaded weights matches the float-built layer bit for bit.
TEST_F(QuantizedIo, OddAndUnequalInputWidthsRoundTrip) {
  Config c;
  c.d_model = 32, c.num_heads = 4, c.d_in = 37, c.kdim = 13, c.vdim = 45, c.context_length = 32;
  for (WeightFormat f : kFormats) {
    const Weights w = Weights::random(c, 7);
    const QuantizedWeights q = QuantizedWeights::quantize(w.view(c), f);
    save_quantized(path("mha.safetensors"), c, q);
    const QuantizedWeights loaded = load_quantized(path("mha.safetensors"), c);
    ASSERT_TRUE(same_weights(q, loaded)) << to_string(f);
    MultiHeadAttention a(c, w, EngineOptions{.threads = 2, .weights = f});
    MultiHeadAttention b(c, loaded, EngineOptions{.threads = 2, .weights = f});  // naming the format: accepted too
    std::mt19937_64 rng(8);
    const int64_t B = 2, T = 5, Tk = 7;
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(B * T * 37), rng);
    const std::vector<float> k = test::random_uniform(static_cast<size_t>(B * Tk * 13), rng);
    const std::vector<float> v = test::random_uniform(static_cast<size_t>(B * Tk * 45), rng);
    AttentionInputs in;
    in.query = TensorView::f32(x.data(), {B, T, 37});
    in.key = TensorView::f32(k.data(), {B, Tk, 13});
    in.value = TensorView::f32(v.data(), {B, Tk, 45});
    std::vector<float> ya(static_cast<size_t>(B * T * 32), test::kNaN), yb = ya;
    a.forward(in, ya.data());
    b.forward(in, yb.data());
    EXPECT_TRUE(same_bits(ya, yb)) << to_string(f);
  }
}

// The bytes themselves, read with the plain safetensors reader, are what weights.hpp documents: I8 codes as they are;
// U8 int4 codes two a byte, 2i low and 2i + 1 high, 0 in an odd width's last high nibble; F32 scales (rows, groups);
// the metadata.
TEST_F(QuantizedIo, FileHoldsTheDocumentedLayout) {
  const Config c = serving_config(48, 2, 37, 64);
  for (WeightFormat f : kFormats) {
    const QuantizedWeights q = QuantizedWeights::quantize(Weights::random(c, 3).view(c), f);
    save_quantized(path("q.safetensors"), c, q);
    const safetensors::File file = safetensors::read(path("q.safetensors"));
    const bool int4 = f == WeightFormat::int4;
    EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"gpt2attn.weights", to_string(f)},
                                                                  {"gpt2attn.group", int4 ? "32" : "row"},
                                                                  {"q_proj.cols", "37"},
                                                                  {"k_proj.cols", "37"},
                                                                  {"v_proj.cols", "37"},
                                                                  {"out_proj.cols", "48"}}));
    EXPECT_EQ(file.tensors.size(), 12u);
    const safetensors::Tensor& codes = file.tensors.at("q_proj.codes");
    EXPECT_EQ(codes.dtype, int4 ? "U8" : "I8");
    EXPECT_EQ(codes.shape, (std::vector<int64_t>{48, int4 ? 19 : 37}));
    const uint8_t* b = file.data.data() + codes.begin;
    for (int64_t r = 0; r < 48; ++r) {
      for (int64_t k = 0; k < 37; ++k) {
        const int8_t code = q.w_q.codes[static_cast<size_t>(r * 37 + k)];
        const int got = int4 ? ((b[r * 19 + k / 2] >> (k % 2 ? 4 : 0)) & 0xF) : b[r * 37 + k];
        ASSERT_EQ(got, static_cast<uint8_t>(code) & (int4 ? 0xF : 0xFF)) << to_string(f) << " (" << r << ", " << k
                                                                          << ")";
      }
      if (int4) {
        ASSERT_EQ(b[r * 19 + 18] >> 4, 0) << "row " << r << ": the padding nibble";
      }
    }
    const safetensors::Tensor& scales = file.tensors.at("q_proj.scales");
    EXPECT_EQ(scales.dtype, "F32");
    EXPECT_EQ(scales.shape, (std::vector<int64_t>{48, int4 ? 2 : 1}));
    EXPECT_TRUE(same_bits(file.to_f32("q_proj.scales"), q.w_q.scales));
    EXPECT_TRUE(same_bits(file.to_f32("out_proj.bias"), q.b_o));
  }
}

// A safetensors file as a test edits it: tensors in file order with their bytes, and the metadata.
struct Editable {
  struct T {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  std::vector<T> tensors;
  std::map<std::string, std::string> metadata;

  static Editable of(const std::string& path) {
    const safetensors::File f = safetensors::read(path);
    Editable e;
    e.metadata = f.metadata;
    for (const auto& [name, t] : f.tensors) {
      e.tensors.push_back({name, t.dtype, t.shape,
                           std::string(reinterpret_cast<const char*>(f.data.data()) + t.begin, t.end - t.begin)});
    }
    return e;
  }
  T& at(const std::string& name) {
    for (T& t : tensors) {
      if (t.name == name) return t;
    }
    throw std::logic_error("no tensor " + name);
  }
  void erase(const std::string& name) { std::erase_if(tensors, [&](const T& t) { return t.name == name; }); }
  void set_f32(const std::string& name, size_t i, float v) { std::memcpy(at(name).bytes.data() + 4 * i, &v, 4); }
  void write(const std::string& path) const {
    std::vector<safetensors::TensorBytes> all;
    for (const T& t : tensors) all.push_back({t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
    safetensors::write(path, all, metadata);
  }
};

// A file cut anywhere is refused with the file named; cut in a tensor's bytes (or where they should start), with that
// tensor named. Cut in the header there is no tensor to name yet.
TEST_F(QuantizedIo, RefusesTruncatedFilesNamingTheTensor) {
  const Config c = serving_config(48, 2, 37, 64);
  for (WeightFormat f : kFormats) {
    const std::string good = path("good.safetensors");
    save_quantized(good, c, QuantizedWeights::quantize(Weights::random(c, 4).view(c), f));
    const std::string bytes = testutil::read_bytes(good);
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    const std::string cut_path = path("cut.safetensors");
    const auto cut_at = [&](size_t n) {
      testutil::write_bytes(cut_path, bytes.substr(0, n));
      return cut_path;
    };
    for (size_t n : {size_t{0}, size_t{5}, size_t{8} + header_len / 2, size_t{8} + header_len - 1}) {
      EXPECT_TRUE(ThrowsError([&] { load_quantized(cut_at(n), c); }, ErrorCode::bad_file, cut_path + ": "))
          << to_string(f) << ", cut at " << n;
    }
    const safetensors::File file = safetensors::read(good);
    EXPECT_EQ(file.tensors.size(), 12u);
    for (const auto& [name, t] : file.tensors) {
      const size_t start = 8 + header_len + t.begin;
      for (size_t n : {start, start + (t.end - t.begin) / 2, 8 + header_len + t.end - 1}) {
        EXPECT_TRUE(ThrowsError([&] { load_quantized(cut_at(n), c); }, ErrorCode::bad_file, "tensor '" + name + "'"))
            << to_string(f) << ", cut at " << n << " in " << name;
        EXPECT_TRUE(ThrowsError([&] { quantized_layer_shapes(cut_at(n)); }, ErrorCode::bad_file, "truncated"));
      }
    }
  }
}

// Every inconsistency the loader checks, one edit of a good file each: bad_file naming the tensor or metadata key.
TEST_F(QuantizedIo, RefusesInconsistentFilesNamingTheTensor) {
  const Config c = serving_config(48, 2, 37, 64);
  struct Case {
    const char* what;
    WeightFormat format;
    void (*edit)(Editable&);
    const char* name;  // the tensor or key the message must name
    const char* word;  // and a word of the reason
  };
  const Case cases[] = {
      {"missing scales", WeightFormat::int8, [](Editable& e) { e.erase("k_proj.scales"); }, "'k_proj.scales'",
       "missing"},
      {"missing codes", WeightFormat::int4, [](Editable& e) { e.erase("out_proj.codes"); }, "'out_proj.codes'",
       "missing"},
      {"int8 codes stored as U8", WeightFormat::int8, [](Editable& e) { e.at("q_proj.codes").dtype = "U8"; },
       "'q_proj.codes'", "dtype U8, expected I8"},
      {"int4 codes stored as I8", WeightFormat::int4, [](Editable& e) { e.at("v_proj.codes").dtype = "I8"; },
       "'v_proj.codes'", "dtype I8, expected U8"},
      {"scales as I32", WeightFormat::int4, [](Editable& e) { e.at("v_proj.scales").dtype = "I32"; },
       "'v_proj.scales'", "dtype I32"},
      {"bias as I32", WeightFormat::int8, [](Editable& e) { e.at("out_proj.bias").dtype = "I32"; },
       "'out_proj.bias'", "dtype I32"},
      {"codes flattened", WeightFormat::int8,
       [](Editable& e) { e.at("k_proj.codes").shape = {48 * 37}; }, "'k_proj.codes'", "shape (1776,)"},
      {"codes wider than <name>.cols", WeightFormat::int8, [](Editable& e) { e.metadata["q_proj.cols"] = "36"; },
       "'q_proj.codes'", "q_proj.cols = 36"},
      {"int4 codes of another byte width", WeightFormat::int4,
       [](Editable& e) { e.metadata["k_proj.cols"] = "40"; }, "'k_proj.codes'", "k_proj.cols = 40"},
      {"a scale row short", WeightFormat::int4,
       [](Editable& e) {
         auto& s = e.at("q_proj.scales");
         s.shape = {47, 2};
         s.bytes.resize(47 * 2 * 4);
       },
       "'q_proj.scales'", "expected (48, 2)"},
      {"int8 scales per 32 inputs", WeightFormat::int8,
       [](Editable& e) {
         auto& s = e.at("q_proj.scales");
         s.shape = {48, 2};
         s.bytes += s.bytes;
       },
       "'q_proj.scales'", "expected (48, 1)"},
      {"int8 code -128", WeightFormat::int8, [](Editable& e) { e.at("v_proj.codes").bytes[37 * 3 + 5] = '\x80'; },
       "'v_proj.codes'", "-128 at (3, 5)"},
      {"padding nibble set", WeightFormat::int4,
       [](Editable& e) { e.at("q_proj.codes").bytes[19 * 2 + 18] |= '\x10'; }, "'q_proj.codes'", "padding"},
      {"NaN scale", WeightFormat::int8,
       [](Editable& e) { e.set_f32("k_proj.scales", 7, std::numeric_limits<float>::quiet_NaN()); },
       "'k_proj.scales'", "NaN at (7, 0)"},
      {"infinite int4 scale", WeightFormat::int4,
       [](Editable& e) { e.set_f32("out_proj.scales", 5, -std::numeric_limits<float>::infinity()); },
       "'out_proj.scales'", "infinite at (2, 1)"},
      {"NaN bias", WeightFormat::int4,
       [](Editable& e) { e.set_f32("v_proj.bias", 3, std::numeric_limits<float>::quiet_NaN()); }, "'v_proj.bias'",
       "NaN at 3"},
      {"unknown format", WeightFormat::int8, [](Editable& e) { e.metadata["gpt2attn.weights"] = "int3"; },
       "'gpt2attn.weights'", "int3"},
      {"no format", WeightFormat::int4, [](Editable& e) { e.metadata.erase("gpt2attn.weights"); },
       "'gpt2attn.weights'", "missing"},
      {"another group", WeightFormat::int4, [](Editable& e) { e.metadata["gpt2attn.group"] = "64"; },
       "'gpt2attn.group'", "'64'"},
      {"int8 said grouped", WeightFormat::int8, [](Editable& e) { e.metadata["gpt2attn.group"] = "32"; },
       "'gpt2attn.group'", "row"},
      {"no group", WeightFormat::int8, [](Editable& e) { e.metadata.erase("gpt2attn.group"); }, "'gpt2attn.group'",
       "missing"},
      {"no width", WeightFormat::int4, [](Editable& e) { e.metadata.erase("v_proj.cols"); }, "'v_proj.cols'",
       "missing"},
      {"a width that is not a number", WeightFormat::int8, [](Editable& e) { e.metadata["v_proj.cols"] = "037"; },
       "'v_proj.cols'", "positive decimal"},
      {"a tensor the format lacks", WeightFormat::int8,
       [](Editable& e) { e.tensors.push_back({"q_proj.zeros", "F32", {1}, std::string(4, '\0')}); },
       "'q_proj.zeros'", "not part of"},
      {"k bias without q and v ones", WeightFormat::int4,
       [](Editable& e) {
         e.erase("q_proj.bias");
         e.erase("v_proj.bias");
       },
       "'q_proj.bias'", "q, k and v have biases or none"},
  };
  for (const Case& k : cases) {
    const std::string good = path("good.safetensors"), bad = path("bad.safetensors");
    save_quantized(good, c, QuantizedWeights::quantize(Weights::random(c, 5).view(c), k.format));
    Editable e = Editable::of(good);
    k.edit(e);
    e.write(bad);
    EXPECT_TRUE(ThrowsError([&] { load_quantized(bad, c); }, ErrorCode::bad_file, bad + ": ")) << k.what;
    EXPECT_TRUE(ThrowsError([&] { load_quantized(bad, c); }, ErrorCode::bad_file, k.name)) << k.what;
    EXPECT_TRUE(ThrowsError([&] { load_quantized(bad, c); }, ErrorCode::bad_file, k.word)) << k.what;
  }
}

// A config that disagrees with the file: refused as the file's (bad_file naming the tensor), before any code is read;
// an invalid config as the caller's own mistake.
TEST_F(QuantizedIo, RefusesAConfigTheFileDoesNotHold) {
  const Config c = grouped(serving_config(64, 4, 0, 64), 2);  // K/V width 32
  const std::string p = path("q.safetensors");
  save_quantized(p, c, QuantizedWeights::quantize(Weights::random(c, 6).view(c), WeightFormat::int4));
  const auto with = [&](auto&& change) {
    Config d = c;
    change(d);
    return d;
  };
  const std::pair<Config, std::pair<const char*, const char*>> cases[] = {
      {with([](Config& d) { d.d_model = 32; }), {"'q_proj.codes'", "(d_model, d_in) = (32, 32)"}},
      {with([](Config& d) { d.d_in = 40; }), {"'q_proj.codes'", "(64, 40)"}},
      {with([](Config& d) { d.num_kv_heads = 0; }), {"'k_proj.codes'", "(kv_width, kdim) = (64, 64)"}},
      {with([](Config& d) { d.qkv_bias = false; }), {"'q_proj.bias'", "qkv_bias = false"}},
      {with([](Config& d) { d.out_bias = false; }), {"'out_proj.bias'", "out_bias = false"}},
  };
  for (const auto& [d, want] : cases) {
    EXPECT_TRUE(ThrowsError([&] { load_quantized(p, d); }, ErrorCode::bad_file, want.first)) << test::describe(d);
    EXPECT_TRUE(ThrowsError([&] { load_quantized(p, d); }, ErrorCode::bad_file, want.second)) << test::describe(d);
  }
  const std::string no_bias = path("no_bias.safetensors");
  const Config nb = with([](Config& d) { d.out_bias = false; });
  save_quantized(no_bias, nb, QuantizedWeights::quantize(Weights::random(nb, 6).view(nb), WeightFormat::int8));
  EXPECT_TRUE(ThrowsError([&] { load_quantized(no_bias, c); }, ErrorCode::bad_file, "'out_proj.bias' is missing"));
  EXPECT_TRUE(ThrowsError([&] { load_quantized(p, with([](Config& d) { d.num_heads = 5; })); },
                          ErrorCode::invalid_argument, "num_heads"));

  // A float checkpoint is not a quantized file: the shapes say so without an error, the loader with one.
  const std::string floats = path("floats.safetensors");
  safetensors::write_f32(floats, {{"out_proj.weight", {{2, 2}, {1, 2, 3, 4}}}});
  EXPECT_FALSE(quantized_layer_shapes(floats).has_value());
  EXPECT_TRUE(ThrowsError([&] { load_quantized(floats, c); }, ErrorCode::bad_file, "'gpt2attn.weights' is missing"));
}

// save_quantized checks the weights against the config first (the caller's mistake: invalid_argument) and then writes
// nothing; a layer refuses loaded weights of one format asked to run as the other.
TEST_F(QuantizedIo, SaveRefusesWeightsTheConfigDoesNotHoldAndLayersTheOtherFormat) {
  const Config c = serving_config(64, 4, 0, 64);
  QuantizedWeights q = QuantizedWeights::quantize(Weights::random(c, 9).view(c), WeightFormat::int8);
  EXPECT_TRUE(ThrowsError([&] { save_quantized(path("a.safetensors"), grouped(c, 2), q); },
                          ErrorCode::invalid_argument, "w_k"));
  QuantizedWeights bad = q;
  bad.w_o.codes[3] = -128;
  EXPECT_TRUE(ThrowsError([&] { save_quantized(path("a.safetensors"), c, bad); }, ErrorCode::invalid_argument,
                          "-128"));
  EXPECT_TRUE(listing().empty());

  for (WeightFormat f : kFormats) {
    const std::string p = path(std::string(to_string(f)) + ".safetensors");
    save_quantized(p, c, QuantizedWeights::quantize(Weights::random(c, 9).view(c), f));
    const QuantizedWeights loaded = load_quantized(p, c);
    const WeightFormat other = f == WeightFormat::int8 ? WeightFormat::int4 : WeightFormat::int8;
    EXPECT_TRUE(ThrowsError([&] { CausalSelfAttention b(c, loaded, EngineOptions{.weights = other}); },
                            ErrorCode::invalid_argument, "EngineOptions.weights"));
  }
}

}  // namespace
}  // namespace gpt2attn
