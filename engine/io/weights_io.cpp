// engine/io/weights_io.cpp: maps one attention layer of a safetensors file (torch or Hugging Face GPT-2 naming)
// onto a WeightsView in torch layout over the file's bytes: fused tensors are split by offset, Conv1D weights are
// transposed views, nothing is converted. Byte-level checks are safetensors.cpp's; checks against a Config are
// validate()'s.
#include <memory>
#include <string>
#include <vector>

#include "engine/io/weights_io.hpp"

#include "engine/io/safetensors.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {
namespace {

using safetensors::File;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Tensor lookups under one prefix, with shape errors that name the tensor, what was expected and what was found.
class Layer {
 public:
  Layer(const File& f, std::string prefix) : f_(f), p_(std::move(prefix)) {}

  bool has(const std::string& name) const { return f_.has(p_ + name); }

  [[noreturn]] void bad(const std::string& what) const {
    fail(ErrorCode::bad_file, f_.path + ": " + what);
  }

  const std::vector<int64_t>& shape(const std::string& name) const {
    if (!has(name)) bad("missing tensor '" + p_ + name + "'");
    return f_.tensors.at(p_ + name).shape;
  }

  // A weight whose shape defines the layer's sizes: rank 2, no zero dimension.
  const std::vector<int64_t>& matrix(const std::string& name, const char* meaning) const {
    const auto& s = shape(name);
    if (s.size() != 2 || s[0] == 0 || s[1] == 0)
      bad("tensor '" + p_ + name + "' has shape " + shape_text(s) + ", expected a non-empty rank 2 " + meaning);
    return s;
  }

  void expect(const std::string& name, const std::vector<int64_t>& want, const char* meaning) const {
    const auto& s = shape(name);
    if (s != want)
      bad("tensor '" + p_ + name + "' has shape " + shape_text(s) + ", expected " + shape_text(want) + " " + meaning);
  }

  TensorView view(const std::string& name) const { return f_.view(p_ + name); }

  const std::string& prefix() const { return p_; }

 private:
  const File& f_;
  std::string p_;
};

// The (rows, cols) view with strides (stride_r, stride_c) whose first element is element `offset` of t.
TensorView part(const TensorView& t, int64_t offset, int64_t rows, int64_t cols, int64_t stride_r, int64_t stride_c) {
  TensorView v = t;
  v.data = static_cast<const std::byte*>(t.data) + offset * static_cast<int64_t>(size_of(t.dtype));
  v.rank = 2;
  v.shape = {rows, cols, 0, 0};
  v.strides = {stride_r, stride_c, 0, 0};
  return v;
}
// Elements [offset, offset + n) of the rank-1 view t.
TensorView part(const TensorView& t, int64_t offset, int64_t n) {
  TensorView v = t;
  v.data = static_cast<const std::byte*>(t.data) + offset * static_cast<int64_t>(size_of(t.dtype));
  v.shape[0] = n;
  return v;
}

// Splits an (E + 2 KW) bias into the three per-projection biases (KW = H_kv * D, E for plain multi-head).
void split_qkv_bias(const TensorView& b, int64_t E, int64_t KW, WeightsView& w) {
  w.b_q = part(b, 0, E);
  w.b_k = part(b, E, KW);
  w.b_v = part(b, E + KW, KW);
}

// The K/V width KW of a fused [q | k | v] projection with `rows` outputs (E + 2 KW) under an output projection of
// width E: 3E for plain multi-head, less for grouped K/V heads.
int64_t fused_kv_width(const Layer& L, const std::string& name, const std::vector<int64_t>& s, int64_t rows,
                       int64_t E, const char* expected) {
  if (rows <= E || (rows - E) % 2 != 0)
    L.bad("tensor '" + L.prefix() + name + "' has shape " + shape_text(s) + ", expected " + expected + " with E=" +
          std::to_string(E) + " from the output projection: " + std::to_string(rows) +
          " outputs are not E + 2 x a K/V width (3E for multi-head attention)");
  return (rows - E) / 2;
}

const char* const kTorchNames[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                   "out_proj.weight"};
const char* const kHfNames[] = {"c_attn.weight", "c_proj.weight"};

// torch.nn.MultiheadAttention.state_dict(): in_proj_weight (3E, d_in) when q, k and v share a width,
// otherwise q_proj_weight (E, d_in), k_proj_weight (E, kdim), v_proj_weight (E, vdim). Grouped K/V heads
// (KW = H_kv * D < E) give in_proj_weight (E + 2 KW, d_in), or k/v_proj_weight (KW, kdim/vdim).
StoredLayer load_torch(const Layer& L) {
  // add_bias_kv appends learned rows to K and V; silently dropping them would give wrong outputs.
  if (L.has("bias_k") || L.has("bias_v"))
    L.bad("'" + L.prefix() + "bias_k'/'bias_v' present: add_bias_kv=True layers are not supported");
  const bool separate = L.has("q_proj_weight") || L.has("k_proj_weight") || L.has("v_proj_weight");
  if (separate && L.has("in_proj_weight"))
    L.bad("both '" + L.prefix() + "in_proj_weight' and separate q/k/v_proj_weight present; which one applies is ambiguous");

  StoredLayer l;
  l.naming = "torch";
  WeightsView& w = l.weights;
  const int64_t E = L.matrix("out_proj.weight", "(E, E)")[0];
  L.expect("out_proj.weight", {E, E}, "(E, E)");
  int64_t KW = 0;
  if (!separate) {
    const auto& s = L.matrix("in_proj_weight", "(3E, d_in)");
    KW = fused_kv_width(L, "in_proj_weight", s, s[0], E, "(E + 2 KW, d_in)");
    l.d_in = l.kdim = l.vdim = s[1];
    const TensorView in = L.view("in_proj_weight");  // [W_q; W_k; W_v] stacked by rows
    const int64_t d_in = l.d_in;
    w.w_q = part(in, 0, E, d_in, d_in, 1);
    w.w_k = part(in, E * d_in, KW, d_in, d_in, 1);
    w.w_v = part(in, (E + KW) * d_in, KW, d_in, d_in, 1);
  } else {
    const auto& sq = L.matrix("q_proj_weight", "(E, d_in)");
    if (sq[0] != E) L.expect("q_proj_weight", {E, sq[1]}, "(E, d_in) with E from out_proj.weight");
    l.d_in = sq[1];
    const auto& sk = L.matrix("k_proj_weight", "(KW, kdim)");
    const auto& sv = L.matrix("v_proj_weight", "(KW, vdim)");
    KW = sk[0];
    if (sv[0] != KW) L.expect("v_proj_weight", {KW, sv[1]}, "(KW, vdim) with the K/V width KW from k_proj_weight");
    l.kdim = sk[1];
    l.vdim = sv[1];
    w.w_q = L.view("q_proj_weight");
    w.w_k = L.view("k_proj_weight");
    w.w_v = L.view("v_proj_weight");
  }
  l.d_model = E;
  l.kv_width = KW;

  l.qkv_bias = L.has("in_proj_bias");
  if (l.qkv_bias) {
    L.expect("in_proj_bias", {E + 2 * KW}, "(E + 2 KW)");
    split_qkv_bias(L.view("in_proj_bias"), E, KW, w);
  }
  w.w_o = L.view("out_proj.weight");
  l.out_bias = L.has("out_proj.bias");
  if (l.out_bias) {
    L.expect("out_proj.bias", {E}, "(E)");
    w.b_o = L.view("out_proj.bias");
  }
  return l;
}

// Hugging Face GPT-2: Conv1D computes y = x @ W + b with W stored (in, out), the transpose of torch's
// Linear, so both projections are transposed here once.
StoredLayer load_hf_gpt2(const Layer& L) {
  StoredLayer l;
  l.naming = "hf-gpt2";
  WeightsView& w = l.weights;
  const int64_t E = L.matrix("c_proj.weight", "(E, E) Conv1D weight")[0];
  L.expect("c_proj.weight", {E, E}, "(E, E) Conv1D weight");
  const auto& s = L.matrix("c_attn.weight", "(d_in, 3E) Conv1D weight");
  const int64_t KW = fused_kv_width(L, "c_attn.weight", s, s[1], E, "(d_in, E + 2 KW)"), d_in = s[0];
  l.d_model = E;
  l.kv_width = KW;
  l.d_in = l.kdim = l.vdim = d_in;

  // W (d_in, E + 2 KW) row-major: output e of input i at i * ld + e, so W_q is the (E, d_in) view with strides
  // (1, ld) and W_k, W_v start E and E + KW columns in.
  const TensorView W = L.view("c_attn.weight");
  const int64_t ld = E + 2 * KW;
  w.w_q = part(W, 0, E, d_in, 1, ld);
  w.w_k = part(W, E, KW, d_in, 1, ld);
  w.w_v = part(W, E + KW, KW, d_in, 1, ld);
  l.qkv_bias = L.has("c_attn.bias");
  if (l.qkv_bias) {
    L.expect("c_attn.bias", {E + 2 * KW}, "(E + 2 KW)");
    split_qkv_bias(L.view("c_attn.bias"), E, KW, w);
  }

  w.w_o = part(L.view("c_proj.weight"), 0, E, E, 1, E);  // (E in, E out): transposed
  l.out_bias = L.has("c_proj.bias");
  if (l.out_bias) {
    L.expect("c_proj.bias", {E}, "(E)");
    w.b_o = L.view("c_proj.bias");
  }
  return l;
}

template <size_t N>
bool has_any(const Layer& L, const char* const (&names)[N]) {
  for (const char* n : names)
    if (L.has(n)) return true;
  return false;
}

bool ends_with(const std::string& s, const char* suffix) {
  const std::string t(suffix);
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

// Up to 10 names from the file, those that look like attention weights first, so a wrong prefix is easy to fix.
std::string sample_names(const File& f) {
  if (f.tensors.empty()) return "the file holds no tensors";
  std::vector<std::string> likely, other;
  for (const auto& [name, t] : f.tensors) {
    bool attn = false;
    for (const char* n : kTorchNames) attn = attn || ends_with(name, n);
    for (const char* n : kHfNames) attn = attn || ends_with(name, n);
    (attn ? likely : other).push_back(name);
  }
  likely.insert(likely.end(), other.begin(), other.end());
  std::string s = "the file holds " + std::to_string(f.tensors.size()) + " tensors, e.g. ";
  for (size_t i = 0; i < likely.size() && i < 10; ++i) s += (i ? ", " : "") + likely[i];
  return s + (likely.size() > 10 ? ", ..." : "");
}

}  // namespace

StoredLayer detail::open_safetensors_layer(std::shared_ptr<const File> f, const std::string& prefix) {
  const std::string& path = f->path;
  // "h.3.attn" and "h.3.attn." both name the same module; the exact prefix is tried first.
  std::vector<std::string> prefixes{prefix};
  if (!prefix.empty() && prefix.back() != '.') prefixes.push_back(prefix + ".");
  for (const std::string& p : prefixes) {
    const Layer L(*f, p);
    const bool torch = has_any(L, kTorchNames), hf = has_any(L, kHfNames);
    if (torch && hf)
      L.bad("both torch (in_proj_weight/out_proj.weight) and Hugging Face (c_attn/c_proj) names under prefix '" + p +
            "'; which layer to load is ambiguous");
    if (torch || hf) {
      StoredLayer l = torch ? load_torch(L) : load_hf_gpt2(L);
      l.storage = f;
      return l;
    }
  }
  fail(ErrorCode::bad_file,
       path + ": no attention layer under prefix '" + prefix +
           "': looked for in_proj_weight or q/k/v_proj_weight with out_proj.weight (torch) and c_attn.weight with "
           "c_proj.weight (hf-gpt2); " + sample_names(*f));
}

StoredLayer open_safetensors_layer(const std::string& path, const std::string& prefix) {
  // The views point into the file's data; the returned layer's storage keeps it alive.
  return detail::open_safetensors_layer(std::make_shared<const File>(safetensors::read(path)), prefix);
}

LoadedLayer load_safetensors_layer(const std::string& path, const std::string& prefix) {
  const StoredLayer s = open_safetensors_layer(path, prefix);
  LoadedLayer l;
  static_cast<LayerShapes&>(l) = s;
  l.weights = Weights::copy_of(s.weights);
  return l;
}

Config apply_loaded_shapes(Config c, const LayerShapes& l) {
  c.d_model = l.d_model;
  c.d_in = l.d_in;
  c.kdim = l.kdim;
  c.vdim = l.vdim;
  c.qkv_bias = l.qkv_bias;
  c.out_bias = l.out_bias;
  // The config checked again with the file's sizes in it; a failure says which of the file's sizes it came from.
  const auto validate_with = [&](const std::string& what) {
    try {
      c.validate();
    } catch (const Error& e) {
      invalid(what + ": " + e.what());
    }
  };
  validate_with("the file's layer is d_model=" + std::to_string(l.d_model) + " wide");  // against num_heads
  // num_kv_heads = 0 takes the file's K/V width (a grouped-query checkpoint needs no flag); a value must match it.
  if (c.num_kv_heads == 0 && l.kv_width != c.d_model && l.kv_width % c.head_dim() == 0) {
    c.num_kv_heads = l.kv_width / c.head_dim();
    validate_with("the file's K/V projections have " + std::to_string(l.kv_width) + " outputs, " +
                  std::to_string(c.num_kv_heads) + " K/V heads of head size " + std::to_string(c.head_dim()));
  }
  if (l.kv_width != c.kv_width()) {
    invalid("the file's K/V projections have " + std::to_string(l.kv_width) + " outputs but the config asks for " +
            std::to_string(c.kv_heads()) + " K/V heads x head size " + std::to_string(c.head_dim()) + " = " +
            std::to_string(c.kv_width()) + " (set num_kv_heads to " +
            (c.head_dim() > 0 && l.kv_width % c.head_dim() == 0 ? std::to_string(l.kv_width / c.head_dim())
                                                                 : std::string("a K/V head count that fits")) +
            ")");
  }
  return c;
}

}  // namespace gpt2attn
