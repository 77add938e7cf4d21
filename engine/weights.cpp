// engine/weights.cpp: Weights size checks against a Config, and reproducible random initialisation.
// File loading lives in weights_io.cpp.
#include <cmath>
#include <random>

#include "gpt2attn/error.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {

void Weights::validate(const Config& c) const {
  const int64_t E = c.d_model, KW = c.kv_width();
  auto check = [](const char* name, const std::vector<float>& w, int64_t rows, int64_t cols) {
    if (static_cast<int64_t>(w.size()) != rows * cols) {
      invalid(std::string("weights: ") + name + " has " + std::to_string(w.size()) + " values, expected (" +
              std::to_string(rows) + (cols == 1 ? ",)" : ", " + std::to_string(cols) + ")") + " = " +
              std::to_string(rows * cols));
    }
  };
  check("w_q", w_q, E, c.query_width());
  check("w_k", w_k, KW, c.key_width());
  check("w_v", w_v, KW, c.value_width());
  check("w_o", w_o, E, E);
  if (c.qkv_bias) {
    check("b_q", b_q, E, 1);
    check("b_k", b_k, KW, 1);
    check("b_v", b_v, KW, 1);
  } else if (!b_q.empty() || !b_k.empty() || !b_v.empty()) {
    invalid("weights: Q/K/V biases given but config.qkv_bias is false");
  }
  if (c.out_bias) {
    check("b_o", b_o, E, 1);
  } else if (!b_o.empty()) {
    invalid("weights: output bias given but config.out_bias is false");
  }
}

Weights Weights::random(const Config& c, uint64_t seed) {
  c.validate();
  std::mt19937_64 rng(seed);
  auto fill = [&](std::vector<float>& w, int64_t n, int64_t fan_in) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    std::uniform_real_distribution<float> u(-bound, bound);
    w.resize(static_cast<size_t>(n));
    for (float& x : w) x = u(rng);
  };
  const int64_t E = c.d_model, KW = c.kv_width();
  Weights w;
  fill(w.w_q, E * c.query_width(), c.query_width());
  fill(w.w_k, KW * c.key_width(), c.key_width());
  fill(w.w_v, KW * c.value_width(), c.value_width());
  fill(w.w_o, E * E, E);
  if (c.qkv_bias) {
    fill(w.b_q, E, c.query_width());
    fill(w.b_k, KW, c.key_width());
    fill(w.b_v, KW, c.value_width());
  }
  if (c.out_bias) fill(w.b_o, E, E);
  return w;
}

}  // namespace gpt2attn
