// tests/fuzz/fuzz_layer.cpp: the layer loader (engine/io/weights_io.cpp) on arbitrary bytes, under several prefixes:
// open_safetensors_layer, apply_loaded_shapes for a few head counts, WeightsView::validate and Weights::copy_of. A
// layer it accepts is checked value for value against the file's tensors, so a wrong split or transpose is a
// finding too, not only a crash.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "engine/io/weights_io.hpp"
#include "gpt2attn/weights.hpp"
#include "tests/fuzz/fuzz_targets.hpp"

namespace gpt2attn::fuzz {
namespace {

const std::string kPath = "fuzz-input.safetensors";

std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return all;
}

// The (cols, rows) transpose of a row-major (rows, cols) matrix.
std::vector<float> transpose(const std::vector<float>& m, int64_t rows, int64_t cols) {
  check(static_cast<int64_t>(m.size()) == rows * cols, "a tensor's value count disagrees with the loaded shapes");
  std::vector<float> t(m.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = m[r * cols + c];
  return t;
}

// The loaded layer against the tensors it came from, read independently with File::to_f32.
void check_values(const safetensors::File& f, const std::string& p, const StoredLayer& l, const Weights& w) {
  const int64_t E = l.d_model, KW = l.kv_width;
  check(E > 0 && KW > 0 && l.d_in > 0 && l.kdim > 0 && l.vdim > 0, "a layer with an empty dimension loaded");
  check(static_cast<int64_t>(w.w_q.size()) == E * l.d_in && static_cast<int64_t>(w.w_k.size()) == KW * l.kdim &&
            static_cast<int64_t>(w.w_v.size()) == KW * l.vdim && static_cast<int64_t>(w.w_o.size()) == E * E,
        "weight sizes disagree with the loaded shapes");
  check(l.qkv_bias == !w.b_q.empty() && l.out_bias == !w.b_o.empty(), "bias flags disagree with the biases");
  const auto t = [&](const char* name) { return f.to_f32(p + name); };
  if (l.naming == "torch") {
    if (f.has(p + "in_proj_weight")) {
      check(same_bits(concat({&w.w_q, &w.w_k, &w.w_v}), t("in_proj_weight")), "in_proj_weight split wrongly");
    } else {
      check(same_bits(w.w_q, t("q_proj_weight")) && same_bits(w.w_k, t("k_proj_weight")) &&
                same_bits(w.w_v, t("v_proj_weight")),
            "q/k/v_proj_weight loaded wrongly");
    }
    if (l.qkv_bias) check(same_bits(concat({&w.b_q, &w.b_k, &w.b_v}), t("in_proj_bias")), "in_proj_bias split wrongly");
    check(same_bits(w.w_o, t("out_proj.weight")), "out_proj.weight loaded wrongly");
    if (l.out_bias) check(same_bits(w.b_o, t("out_proj.bias")), "out_proj.bias loaded wrongly");
  } else {
    check(l.naming == "hf-gpt2", "unknown naming '" + l.naming + "'");
    // Conv1D stores (in, out): the torch-layout [W_q; W_k; W_v] is the transpose of c_attn.weight.
    check(same_bits(concat({&w.w_q, &w.w_k, &w.w_v}), transpose(t("c_attn.weight"), l.d_in, E + 2 * KW)),
          "c_attn.weight split or transposed wrongly");
    if (l.qkv_bias) check(same_bits(concat({&w.b_q, &w.b_k, &w.b_v}), t("c_attn.bias")), "c_attn.bias split wrongly");
    check(same_bits(w.w_o, transpose(t("c_proj.weight"), E, E)), "c_proj.weight transposed wrongly");
    if (l.out_bias) check(same_bits(w.b_o, t("c_proj.bias")), "c_proj.bias loaded wrongly");
  }
}

void check_layer(const std::shared_ptr<const safetensors::File>& f, const std::string& prefix) {
  StoredLayer l;
  if (!returns({ErrorCode::bad_file}, kPath, [&] { l = detail::open_safetensors_layer(f, prefix); })) return;
  check(l.storage == f, "the layer does not keep the file's bytes alive");
  // The loader tries the prefix as given, then with a '.' appended; so does this check.
  const bool exact = f->has(prefix + "out_proj.weight") || f->has(prefix + "c_proj.weight") ||
                     f->has(prefix + "in_proj_weight") || f->has(prefix + "c_attn.weight") ||
                     f->has(prefix + "q_proj_weight") || f->has(prefix + "k_proj_weight") ||
                     f->has(prefix + "v_proj_weight");
  const Weights w = Weights::copy_of(l.weights);
  check_values(*f, exact ? prefix : prefix + ".", l, w);

  // A config completed from the file's shapes must accept the file's weights: whatever apply_loaded_shapes
  // returns, validate() passes, unless a weight is NaN or infinite, which is refused (invalid_argument, "must be
  // finite"), and only then.
  bool finite = true;
  for (const std::vector<float>* t : {&w.w_q, &w.w_k, &w.w_v, &w.w_o, &w.b_q, &w.b_k, &w.b_v, &w.b_o}) {
    for (float x : *t) finite = finite && std::isfinite(x);
  }
  const auto refused_as_nonfinite = [&](auto&& validate) {
    try {
      validate();
    } catch (const Error& e) {
      const bool finite_named = std::string(e.what()).find("must be finite") != std::string::npos;
      return e.code() == ErrorCode::invalid_argument && finite_named;
    }
    return false;
  };
  for (int64_t heads : {1, 2, 3, 4, 8}) {
    Config c;
    c.num_heads = heads;
    if (!returns({ErrorCode::invalid_argument}, kPath, [&] { c = apply_loaded_shapes(c, l); })) continue;
    returns({}, kPath, [&] { c.validate(); });
    if (finite) {
      returns({}, kPath, [&] {
        l.weights.validate(c);
        w.validate(c);
      });
    } else {
      check(refused_as_nonfinite([&] { l.weights.validate(c); }), "the file's non-finite weights were not refused");
      check(refused_as_nonfinite([&] { w.validate(c); }), "the copied non-finite weights were not refused");
    }
  }
}

}  // namespace

int fuzz_layer(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  std::shared_ptr<const safetensors::File> f;
  if (!returns({ErrorCode::bad_file}, kPath,
               [&] { f = std::make_shared<const safetensors::File>(safetensors::parse(kPath, data, size)); }))
    return 0;
  // "h.0.attn" (no dot) exercises the loader's retry with a '.' appended.
  for (const char* prefix : {"", "h.0.attn.", "h.0.attn", "layer0."}) check_layer(f, prefix);
  return 0;
}

}  // namespace gpt2attn::fuzz
