// engine/io/weights_io.cpp: maps one attention layer of a safetensors file (torch or Hugging Face GPT-2 naming)
// onto Weights in torch layout. Byte-level checks are safetensors.cpp's; checks against a Config are validate()'s.
#include <string>
#include <vector>

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

  std::vector<float> load(const std::string& name) const { return f_.to_f32(p_ + name); }

  const std::string& prefix() const { return p_; }

 private:
  const File& f_;
  std::string p_;
};

// Splits a (3E) bias into the three per-projection biases.
void split_qkv_bias(const std::vector<float>& b, int64_t E, Weights& w) {
  w.b_q.assign(b.begin(), b.begin() + E);
  w.b_k.assign(b.begin() + E, b.begin() + 2 * E);
  w.b_v.assign(b.begin() + 2 * E, b.begin() + 3 * E);
}

const char* const kTorchNames[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                   "out_proj.weight"};
const char* const kHfNames[] = {"c_attn.weight", "c_proj.weight"};

// torch.nn.MultiheadAttention.state_dict(): in_proj_weight (3E, d_in) when q, k and v share a width,
// otherwise q_proj_weight (E, d_in), k_proj_weight (E, kdim), v_proj_weight (E, vdim).
LoadedLayer load_torch(const Layer& L) {
  // add_bias_kv appends learned rows to K and V; silently dropping them would give wrong outputs.
  if (L.has("bias_k") || L.has("bias_v"))
    L.bad("'" + L.prefix() + "bias_k'/'bias_v' present: add_bias_kv=True layers are not supported");
  const bool separate = L.has("q_proj_weight") || L.has("k_proj_weight") || L.has("v_proj_weight");
  if (separate && L.has("in_proj_weight"))
    L.bad("both '" + L.prefix() + "in_proj_weight' and separate q/k/v_proj_weight present; which one applies is ambiguous");

  LoadedLayer l;
  l.naming = "torch";
  Weights& w = l.weights;
  int64_t E = 0;
  if (!separate) {
    const auto& s = L.matrix("in_proj_weight", "(3E, d_in)");
    if (s[0] % 3 != 0)
      L.bad("tensor '" + L.prefix() + "in_proj_weight' has shape " + shape_text(s) +
            ", expected (3E, d_in): its row count is not divisible by 3");
    E = s[0] / 3;
    l.d_in = l.kdim = l.vdim = s[1];
    const std::vector<float> in = L.load("in_proj_weight");
    const int64_t n = E * l.d_in;
    w.w_q.assign(in.begin(), in.begin() + n);
    w.w_k.assign(in.begin() + n, in.begin() + 2 * n);
    w.w_v.assign(in.begin() + 2 * n, in.begin() + 3 * n);
  } else {
    const auto& sq = L.matrix("q_proj_weight", "(E, d_in)");
    E = sq[0];
    l.d_in = sq[1];
    const auto& sk = L.matrix("k_proj_weight", "(E, kdim)");
    const auto& sv = L.matrix("v_proj_weight", "(E, vdim)");
    if (sk[0] != E) L.expect("k_proj_weight", {E, sk[1]}, "(E, kdim) with E from q_proj_weight");
    if (sv[0] != E) L.expect("v_proj_weight", {E, sv[1]}, "(E, vdim) with E from q_proj_weight");
    l.kdim = sk[1];
    l.vdim = sv[1];
    w.w_q = L.load("q_proj_weight");
    w.w_k = L.load("k_proj_weight");
    w.w_v = L.load("v_proj_weight");
  }
  l.d_model = E;

  l.qkv_bias = L.has("in_proj_bias");
  if (l.qkv_bias) {
    L.expect("in_proj_bias", {3 * E}, "(3E)");
    split_qkv_bias(L.load("in_proj_bias"), E, w);
  }
  L.expect("out_proj.weight", {E, E}, "(E, E)");
  w.w_o = L.load("out_proj.weight");
  l.out_bias = L.has("out_proj.bias");
  if (l.out_bias) {
    L.expect("out_proj.bias", {E}, "(E)");
    w.b_o = L.load("out_proj.bias");
  }
  return l;
}

// Hugging Face GPT-2: Conv1D computes y = x @ W + b with W stored (in, out), the transpose of torch's
// Linear, so both projections are transposed here once.
LoadedLayer load_hf_gpt2(const Layer& L) {
  LoadedLayer l;
  l.naming = "hf-gpt2";
  Weights& w = l.weights;
  const auto& s = L.matrix("c_attn.weight", "(d_in, 3E) Conv1D weight");
  if (s[1] % 3 != 0)
    L.bad("tensor '" + L.prefix() + "c_attn.weight' has shape " + shape_text(s) +
          ", expected (d_in, 3E): its column count is not divisible by 3");
  const int64_t E = s[1] / 3, d_in = s[0];
  l.d_model = E;
  l.d_in = l.kdim = l.vdim = d_in;

  const std::vector<float> W = L.load("c_attn.weight");  // (d_in, 3E)
  const int64_t ld = 3 * E;
  w.w_q.resize(E * d_in);
  w.w_k.resize(E * d_in);
  w.w_v.resize(E * d_in);
  for (int64_t i = 0; i < d_in; ++i)
    for (int64_t e = 0; e < E; ++e) {
      w.w_q[e * d_in + i] = W[i * ld + e];
      w.w_k[e * d_in + i] = W[i * ld + E + e];
      w.w_v[e * d_in + i] = W[i * ld + 2 * E + e];
    }
  l.qkv_bias = L.has("c_attn.bias");
  if (l.qkv_bias) {
    L.expect("c_attn.bias", {3 * E}, "(3E)");
    split_qkv_bias(L.load("c_attn.bias"), E, w);
  }

  L.expect("c_proj.weight", {E, E}, "(E, E) Conv1D weight");
  const std::vector<float> P = L.load("c_proj.weight");  // (E in, E out)
  w.w_o.resize(E * E);
  for (int64_t i = 0; i < E; ++i)
    for (int64_t o = 0; o < E; ++o) w.w_o[o * E + i] = P[i * E + o];
  l.out_bias = L.has("c_proj.bias");
  if (l.out_bias) {
    L.expect("c_proj.bias", {E}, "(E)");
    w.b_o = L.load("c_proj.bias");
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

LoadedLayer load_safetensors_layer(const std::string& path, const std::string& prefix) {
  const File f = safetensors::read(path);
  // "h.3.attn" and "h.3.attn." both name the same module; the exact prefix is tried first.
  std::vector<std::string> prefixes{prefix};
  if (!prefix.empty() && prefix.back() != '.') prefixes.push_back(prefix + ".");
  for (const std::string& p : prefixes) {
    const Layer L(f, p);
    const bool torch = has_any(L, kTorchNames), hf = has_any(L, kHfNames);
    if (torch && hf)
      L.bad("both torch (in_proj_weight/out_proj.weight) and Hugging Face (c_attn/c_proj) names under prefix '" + p +
            "'; which layer to load is ambiguous");
    if (torch) return load_torch(L);
    if (hf) return load_hf_gpt2(L);
  }
  fail(ErrorCode::bad_file,
       path + ": no attention layer under prefix '" + prefix +
           "': looked for in_proj_weight or q/k/v_proj_weight with out_proj.weight (torch) and c_attn.weight with "
           "c_proj.weight (hf-gpt2); " + sample_names(f));
}

Config apply_loaded_shapes(Config c, const LoadedLayer& l) {
  c.d_model = l.d_model;
  c.d_in = l.d_in;
  c.kdim = l.kdim;
  c.vdim = l.vdim;
  c.qkv_bias = l.qkv_bias;
  c.out_bias = l.out_bias;
  return c;
}

}  // namespace gpt2attn
