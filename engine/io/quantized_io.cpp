// engine/io/quantized_io.cpp: QuantizedWeights as a safetensors file (save_quantized, load_quantized,
// quantized_layer_shapes; the format is documented at save_quantized in gpt2attn/weights.hpp). The byte-level parsing
// is safetensors.cpp's; here every tensor is checked against the metadata, the others and the layer's config before a
// code is trusted. It does not quantize (engine/quantized.cpp does).
#include "engine/io/quantized_io.hpp"

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "engine/quantized.hpp"
#include "gpt2attn/error.hpp"
#include "support/file_io.hpp"

namespace gpt2attn {
namespace {

using safetensors::File;
using safetensors::Tensor;

const std::string kFormatKey = "gpt2attn.weights";
const std::string kGroupKey = "gpt2attn.group";

// The four matrices by the names the file gives them, beside QuantizedWeights' members and what the config calls
// their shapes (for messages).
struct Slot {
  const char* name;
  QuantizedMatrix QuantizedWeights::*matrix;
  std::vector<float> QuantizedWeights::*bias;
  const char* shape;
};
const Slot kSlots[] = {
    {"q_proj", &QuantizedWeights::w_q, &QuantizedWeights::b_q, "(d_model, d_in)"},
    {"k_proj", &QuantizedWeights::w_k, &QuantizedWeights::b_k, "(kv_width, kdim)"},
    {"v_proj", &QuantizedWeights::w_v, &QuantizedWeights::b_v, "(kv_width, vdim)"},
    {"out_proj", &QuantizedWeights::w_o, &QuantizedWeights::b_o, "(d_model, d_model)"},
};
enum { kQ, kK, kV, kO };

std::string codes_name(const Slot& s) { return std::string(s.name) + ".codes"; }
std::string scales_name(const Slot& s) { return std::string(s.name) + ".scales"; }
std::string bias_name(const Slot& s) { return std::string(s.name) + ".bias"; }
std::string cols_key(const Slot& s) { return std::string(s.name) + ".cols"; }

// "gpt2attn.group": the inputs one scale covers. int8 has one scale a whole row, whatever its width.
std::string group_text(WeightFormat f) { return f == WeightFormat::int4 ? std::to_string(kWeightGroup) : "row"; }

// Bytes a row of `cols` codes takes in the file: one a code, or two int4 codes a byte.
int64_t row_bytes(WeightFormat f, int64_t cols) { return f == WeightFormat::int4 ? (cols + 1) / 2 : cols; }

std::string dims(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

[[noreturn]] void bad_tensor(const File& f, const std::string& name, const std::string& what) {
  io::file_error(f.path, "tensor '" + name + "' " + what);
}
[[noreturn]] void bad_key(const File& f, const std::string& key, const std::string& what) {
  io::file_error(f.path, "metadata '" + key + "' " + what);
}

// The tensor `name`, which must be there with `dtype` and `shape`.
const Tensor& expect(const File& f, const std::string& name, const char* dtype, const std::vector<int64_t>& shape,
                     const std::string& meaning) {
  const auto it = f.tensors.find(name);
  if (it == f.tensors.end()) bad_tensor(f, name, "is missing (" + std::string(dtype) + " " + meaning + ")");
  const Tensor& t = it->second;
  if (t.dtype != dtype) bad_tensor(f, name, "has dtype " + t.dtype + ", expected " + dtype + " " + meaning);
  if (t.shape != shape) bad_tensor(f, name, "has shape " + dims(t.shape) + ", expected " + dims(shape) + " " + meaning);
  return t;
}

// A "<name>.cols" value: a positive decimal integer as std::to_string writes it (no sign, no leading zero), small
// enough that a row of it fits the header's sizes.
int64_t parse_cols(const File& f, const std::string& key) {
  const auto it = f.metadata.find(key);
  if (it == f.metadata.end()) bad_key(f, key, "is missing (the matrix's width, in decimal)");
  const std::string& s = it->second;
  if (s.empty() || s.size() > 18 || s[0] == '0' || s.find_first_not_of("0123456789") != std::string::npos) {
    bad_key(f, key, "is '" + (s.size() <= 40 ? s : s.substr(0, 40) + "...") +
                        "', expected the matrix's width as a positive decimal integer");
  }
  return std::stoll(s);
}

// What the header says of one matrix, checked against the metadata but not yet against a config.
struct MatrixLayout {
  int64_t rows = 0, cols = 0;
  bool bias = false;
};
struct Layout {
  WeightFormat format = WeightFormat::int8;
  MatrixLayout m[4];
};

// The format named by the metadata, or nullopt when the file has no "gpt2attn.weights" (not one of ours).
std::optional<WeightFormat> format_of(const File& f) {
  const auto it = f.metadata.find(kFormatKey);
  if (it == f.metadata.end()) return std::nullopt;
  if (it->second == "int8") return WeightFormat::int8;
  if (it->second == "int4") return WeightFormat::int4;
  bad_key(f, kFormatKey, "is '" + (it->second.size() <= 40 ? it->second : it->second.substr(0, 40) + "...") +
                             "', expected int8 or int4");
}

// The header's tensors and metadata against one another: every dtype and shape the format requires, no tensor it
// lacks, the layer's matrices fitting together (q_proj and out_proj E rows, out_proj E inputs, k_proj and v_proj the
// same rows, the three q/k/v biases together). Reads no tensor's bytes.
Layout read_layout(const File& f, WeightFormat format) {
  Layout L;
  L.format = format;
  const auto group = f.metadata.find(kGroupKey);
  if (group == f.metadata.end()) bad_key(f, kGroupKey, "is missing (" + group_text(format) + " for " +
                                                           to_string(format) + ")");
  if (group->second != group_text(format)) {
    bad_key(f, kGroupKey, "is '" + group->second.substr(0, 40) + "', but " + to_string(format) + " weights have " +
                              group_text(format) + " (inputs per scale)");
  }
  std::set<std::string> known;
  for (const Slot& s : kSlots) known.insert({codes_name(s), scales_name(s), bias_name(s)});
  for (const auto& [name, t] : f.tensors) {
    if (known.count(name) == 0) {
      bad_tensor(f, name, "is not part of a quantized layer (q_proj, k_proj, v_proj, out_proj: .codes, .scales, "
                          ".bias)");
    }
  }

  const bool int4 = format == WeightFormat::int4;
  for (int i = 0; i < 4; ++i) {
    const Slot& s = kSlots[i];
    MatrixLayout& m = L.m[i];
    m.cols = parse_cols(f, cols_key(s));
    const std::string codes = codes_name(s);
    const auto it = f.tensors.find(codes);
    if (it == f.tensors.end()) bad_tensor(f, codes, "is missing (the " + std::string(s.name) + " codes)");
    const Tensor& t = it->second;
    const char* dtype = int4 ? "U8" : "I8";
    if (t.dtype != dtype) {
      bad_tensor(f, codes, "has dtype " + t.dtype + ", expected " + dtype + " for " + to_string(format) + " codes");
    }
    const int64_t width = row_bytes(format, m.cols);
    if (t.shape.size() != 2 || t.shape[0] == 0 || t.shape[1] != width) {
      bad_tensor(f, codes, "has shape " + dims(t.shape) + ", expected (rows, " + std::to_string(width) + ") for " +
                               cols_key(s) + " = " + std::to_string(m.cols) +
                               (int4 ? " (two int4 codes a byte)" : "") + ", rows at least 1");
    }
    m.rows = t.shape[0];
    expect(f, scales_name(s), "F32", {m.rows, detail::quant_groups(format, m.cols)},
           "(rows, groups): one scale per " + std::string(int4 ? std::to_string(kWeightGroup) + " inputs" : "row"));
    m.bias = f.has(bias_name(s));
    if (m.bias) expect(f, bias_name(s), "F32", {m.rows}, "(rows)");
  }

  const MatrixLayout &q = L.m[kQ], &k = L.m[kK], &v = L.m[kV], &o = L.m[kO];
  const auto mismatch = [&](int i, const std::string& want) {
    bad_tensor(f, codes_name(kSlots[i]), "holds a (" + std::to_string(L.m[i].rows) + ", " +
                                             std::to_string(L.m[i].cols) + ") matrix but " + want);
  };
  if (o.cols != o.rows) mismatch(kO, "out_proj is (d_model, d_model)");
  if (q.rows != o.rows) mismatch(kQ, "q_proj has d_model = " + std::to_string(o.rows) + " rows, as out_proj");
  if (v.rows != k.rows) mismatch(kV, "v_proj has as many rows as k_proj (" + std::to_string(k.rows) + ")");
  for (int i : {kK, kV}) {
    if (L.m[i].bias != q.bias) {
      bad_tensor(f, bias_name(kSlots[q.bias ? i : kQ]), "is missing while " + bias_name(kSlots[q.bias ? kQ : i]) +
                                                            " is there: q, k and v have biases or none");
    }
  }
  return L;
}

std::vector<float> f32_of(const File& f, const std::string& name) {
  const Tensor& t = f.tensors.at(name);
  std::vector<float> v((t.end - t.begin) / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), f.data.data() + t.begin, v.size() * sizeof(float));  // any alignment
  return v;
}

// Scales or a bias (cols 0: rank 1) must be finite: a layer built from them would answer NaN or Inf.
void check_finite(const File& f, const std::string& name, const std::vector<float>& v, int64_t cols) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isfinite(v[i])) continue;
    const int64_t at = static_cast<int64_t>(i);
    // Built by appending: GCC 12 warns falsely (-Wrestrict) on "(" + std::to_string(...).
    std::string where = std::isnan(v[i]) ? "is NaN at " : "is infinite at ";
    if (cols > 0) {
      where += "(";
      where += std::to_string(at / cols) + ", " + std::to_string(at % cols) + ")";
    } else {
      where += std::to_string(at);
    }
    bad_tensor(f, name, where + "; it must be finite");
  }
}

// The codes of one matrix, each checked: int8's -128 is outside its symmetric range; every nibble is an int4 code,
// but an odd width's padding nibble must be 0 (a writer that put a code there meant another width).
std::vector<int8_t> decode_codes(const File& f, const std::string& name, WeightFormat format, int64_t rows,
                                 int64_t cols) {
  const uint8_t* bytes = f.data.data() + f.tensors.at(name).begin;
  std::vector<int8_t> codes(static_cast<size_t>(rows * cols));
  const auto nibble = [](unsigned n) { return static_cast<int8_t>(n >= 8 ? static_cast<int>(n) - 16 : n); };
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* dst = codes.data() + r * cols;
    if (format == WeightFormat::int8) {
      std::memcpy(dst, bytes + r * cols, static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c) {
        if (dst[c] == -128) {
          bad_tensor(f, name, "holds code -128 at (" + std::to_string(r) + ", " + std::to_string(c) +
                                  "), outside int8's [-127, 127]");
        }
      }
      continue;
    }
    const int64_t width = (cols + 1) / 2;
    const uint8_t* row = bytes + r * width;
    for (int64_t i = 0; i < width; ++i) {
      dst[2 * i] = nibble(row[i] & 0xFu);
      if (2 * i + 1 < cols) {
        dst[2 * i + 1] = nibble(row[i] >> 4);
      } else if (row[i] >> 4 != 0) {
        bad_tensor(f, name, "byte (" + std::to_string(r) + ", " + std::to_string(i) + ") has high nibble " +
                                std::to_string(row[i] >> 4) + " past the row's " + std::to_string(cols) +
                                " codes; the padding of an odd width must be 0");
      }
    }
  }
  return codes;
}

}  // namespace

namespace detail {

std::optional<QuantizedLayerShapes> quantized_layer_shapes(const File& f) {
  const std::optional<WeightFormat> format = format_of(f);
  if (!format) return std::nullopt;
  const Layout L = read_layout(f, *format);
  QuantizedLayerShapes s;
  s.format = *format;
  s.d_model = L.m[kO].rows;
  s.d_in = L.m[kQ].cols;
  s.kdim = L.m[kK].cols;
  s.vdim = L.m[kV].cols;
  s.kv_width = L.m[kK].rows;
  s.qkv_bias = L.m[kQ].bias;
  s.out_bias = L.m[kO].bias;
  s.naming = "gpt2attn-quantized";
  return s;
}

QuantizedWeights load_quantized(const File& f, const Config& c) {
  c.validate();
  const std::optional<WeightFormat> format = format_of(f);
  if (!format) {
    bad_key(f, kFormatKey, "is missing: not a file of save_quantized's (a float checkpoint loads with "
                           "open_safetensors_layer)");
  }
  const Layout L = read_layout(f, *format);
  const int64_t want[4][2] = {{c.d_model, c.query_width()},
                              {c.kv_width(), c.key_width()},
                              {c.kv_width(), c.value_width()},
                              {c.d_model, c.d_model}};
  const bool bias_wanted[4] = {c.qkv_bias, c.qkv_bias, c.qkv_bias, c.out_bias};
  QuantizedWeights q;
  q.format = *format;
  for (int i = 0; i < 4; ++i) {
    const Slot& s = kSlots[i];
    const MatrixLayout& m = L.m[i];
    if (m.rows != want[i][0] || m.cols != want[i][1]) {
      bad_tensor(f, codes_name(s), "holds a (" + std::to_string(m.rows) + ", " + std::to_string(m.cols) +
                                       ") matrix but the config's layer needs " + s.shape + " = (" +
                                       std::to_string(want[i][0]) + ", " + std::to_string(want[i][1]) + ")");
    }
    if (m.bias != bias_wanted[i]) {
      const char* flag = i == kO ? "out_bias" : "qkv_bias";
      bad_tensor(f, bias_name(s), m.bias ? std::string("is there but the config has ") + flag + " = false"
                                         : std::string("is missing but the config has ") + flag + " = true");
    }
  }
  // Only now, every shape known good, are the bytes read.
  for (int i = 0; i < 4; ++i) {
    const Slot& s = kSlots[i];
    const MatrixLayout& m = L.m[i];
    QuantizedMatrix& dst = q.*s.matrix;
    dst.rows = m.rows, dst.cols = m.cols;
    dst.codes = decode_codes(f, codes_name(s), *format, m.rows, m.cols);
    dst.scales = f32_of(f, scales_name(s));
    check_finite(f, scales_name(s), dst.scales, quant_groups(*format, m.cols));
    if (m.bias) {
      q.*s.bias = f32_of(f, bias_name(s));
      check_finite(f, bias_name(s), q.*s.bias, 0);
    }
  }
  return q;
}

}  // namespace detail

void save_quantized(const std::string& path, const Config& c, const QuantizedWeights& q) {
  q.validate(c);
  const bool int4 = q.format == WeightFormat::int4;
  std::map<std::string, std::string> metadata = {{kFormatKey, to_string(q.format)}, {kGroupKey, group_text(q.format)}};
  std::vector<safetensors::TensorBytes> tensors;
  std::vector<std::vector<uint8_t>> packed;  // int4's bytes, which `tensors` points into
  packed.reserve(4);
  for (const Slot& s : kSlots) {
    const QuantizedMatrix& m = q.*s.matrix;
    metadata[cols_key(s)] = std::to_string(m.cols);
    if (int4) {
      // byte i of a row: code 2i in the low nibble, 2i + 1 in the high one (0 past an odd width)
      const int64_t width = row_bytes(q.format, m.cols);
      std::vector<uint8_t>& b = packed.emplace_back(static_cast<size_t>(m.rows * width), uint8_t{0});
      for (int64_t r = 0; r < m.rows; ++r) {
        for (int64_t k = 0; k < m.cols; ++k) {
          const auto code = static_cast<uint8_t>(m.codes[static_cast<size_t>(r * m.cols + k)] & 0xF);
          b[static_cast<size_t>(r * width + k / 2)] |= static_cast<uint8_t>(k % 2 ? code << 4 : code);
        }
      }
      tensors.push_back({codes_name(s), "U8", {m.rows, width}, b.data(), b.size()});
    } else {
      tensors.push_back({codes_name(s), "I8", {m.rows, m.cols}, m.codes.data(), m.codes.size()});
    }
    const int64_t groups = detail::quant_groups(q.format, m.cols);
    tensors.push_back({scales_name(s), "F32", {m.rows, groups}, m.scales.data(), m.scales.size() * sizeof(float)});
    const std::vector<float>& bias = q.*s.bias;
    if (!bias.empty()) {
      tensors.push_back({bias_name(s), "F32", {static_cast<int64_t>(bias.size())}, bias.data(),
                         bias.size() * sizeof(float)});
    }
  }
  safetensors::write(path, tensors, metadata);
}

QuantizedWeights load_quantized(const std::string& path, const Config& c) {
  return detail::load_quantized(safetensors::read(path), c);
}

std::optional<QuantizedLayerShapes> quantized_layer_shapes(const std::string& path) {
  // Mapped, not read: only the header is looked at.
  return detail::quantized_layer_shapes(safetensors::map(path));
}

}  // namespace gpt2attn
