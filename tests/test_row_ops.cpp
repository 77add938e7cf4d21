// gpt2attn/ops.hpp: LayerNorm and GELU (tanh approximation) against double loops on every instruction set, at GPT-2's
// widths and odd ones (vector tails), rows far from 0, constant rows, NaN rows, and the arguments refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/ops.hpp"
#include "tests/isa_param.hpp"
#include "tests/tolerance.hpp"

namespace gpt2attn {
namespace {

std::vector<double> naive_layer_norm(const std::vector<float>& x, int64_t M, int64_t E, const std::vector<float>& g,
                                     const std::vector<float>& b, double eps) {
  std::vector<double> y(x.size());
  for (int64_t m = 0; m < M; ++m) {
    double mean = 0, var = 0;
    for (int64_t e = 0; e < E; ++e) mean += x[m * E + e];
    mean /= static_cast<double>(E);
    for (int64_t e = 0; e < E; ++e) var += (x[m * E + e] - mean) * (x[m * E + e] - mean);
    var /= static_cast<double>(E);
    for (int64_t e = 0; e < E; ++e) y[m * E + e] = (x[m * E + e] - mean) / std::sqrt(var + eps) * g[e] + b[e];
  }
  return y;
}

double naive_gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

class RowOps : public test::IsaTest {};

TEST_P(RowOps, LayerNormMatchesDoubleLoops) {
  std::mt19937_64 rng(17);
  for (int64_t E : {1, 5, 16, 17, 33, 768, 1600, 12288}) {
    for (int64_t M : {1, 3, 40}) {
      for (float offset : {0.0f, 1000.0f}) {  // a row far from 0 keeps its digits (two passes)
        std::vector<float> x = test::random_uniform(static_cast<size_t>(M * E), rng, -2.0f, 2.0f);
        for (float& v : x) v += offset;
        const std::vector<float> g = test::random_uniform(static_cast<size_t>(E), rng, 0.5f, 1.5f);
        const std::vector<float> b = test::random_uniform(static_cast<size_t>(E), rng, -0.5f, 0.5f);
        std::fill_n(x.begin(), E, 3.25f);  // row 0 constant: variance 0, y = beta
        std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
        layer_norm(x.data(), M, E, g.data(), b.data(), 1e-5f, y.data(), {.threads = 2, .isa = isa()});
        const std::string ctx = std::string("[isa=") + to_string(isa()) + "] layer_norm M=" + std::to_string(M) +
                                " E=" + std::to_string(E) + " offset=" + std::to_string(offset);
        EXPECT_TRUE(test::all_close_within(y, naive_layer_norm(x, M, E, g, b, 1e-5),
                                           [&](double m) { return row_op_tolerance(E, m); }, ctx));
        // In place gives the same values.
        std::vector<float> z = x;
        layer_norm(z.data(), M, E, g.data(), b.data(), 1e-5f, z.data(), {.threads = 1, .isa = isa()});
        EXPECT_EQ(z, y) << ctx << " in place";
      }
    }
  }
}

TEST_P(RowOps, LayerNormNanRowStaysItsOwn) {
  const int64_t M = 3, E = 70;
  std::vector<float> x(static_cast<size_t>(M * E), 0.5f), g(E, 1.0f), b(E, 0.0f), y(x.size());
  for (int64_t e = 0; e < E; ++e) x[E + e] = static_cast<float>(e);
  x[E + 7] = std::numeric_limits<float>::quiet_NaN();
  layer_norm(x.data(), M, E, g.data(), b.data(), 1e-5f, y.data(), {.threads = 2, .isa = isa()});
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_TRUE(std::isnan(y[E + e])) << e;
    EXPECT_EQ(y[e], 0.0f) << e;  // the constant rows beside it: beta
    EXPECT_EQ(y[2 * E + e], 0.0f) << e;
  }
}

TEST_P(RowOps, GeluMatchesDoubleLoops) {
  std::vector<float> x;
  for (int i = -4000; i <= 4000; ++i) x.push_back(static_cast<float>(i) * 0.003f);  // [-12, 12], 0 and near it
  for (float v : {1e-30f, -1e-30f, 1e-8f, -1e-8f, 30.0f, -30.0f, 90.0f, -90.0f, 1e10f, -1e10f, 3e38f, -3e38f}) {
    x.push_back(v);
  }
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  std::vector<double> want;
  for (float v : x) want.push_back(std::isnan(v) ? v : std::fabs(v) > 1e4f ? (v > 0 ? v : 0.0) : naive_gelu(v));
  for (size_t n : {x.size(), size_t{1}, size_t{7}, size_t{17}}) {  // tails shorter than a vector
    std::vector<float> y(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
    const std::vector<double> w(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(n));
    gelu_tanh(y.data(), static_cast<int64_t>(n), {.threads = 2, .isa = isa()});
    // Relative to each value (GELU spans 1e-30 to 3e38 here): the bound's rtol, an absolute floor of its atol.
    EXPECT_TRUE(test::all_close_within(y, w, [](double) { return row_op_tolerance(4, 1.0); },
                                       std::string("[isa=") + to_string(isa()) + "] gelu n=" + std::to_string(n)));
  }
}

// The residual add rounds once an element, as y[i] + x[i] in f32 does: every level gives the plain loop's bits, over
// lengths with vector tails and across the team's items.
TEST_P(RowOps, ResidualAddIsThePlainLoop) {
  std::mt19937_64 rng(11);
  for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{40000}}) {
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(n), rng, -100.0f, 100.0f);
    std::vector<float> y = test::random_uniform(static_cast<size_t>(n), rng, -1.0f, 1.0f), want = y;
    for (size_t i = 0; i < want.size(); ++i) want[i] += x[i];
    residual_add(y.data(), x.data(), n, {.threads = 2, .isa = isa()});
    EXPECT_EQ(y, want) << "[isa=" << to_string(isa()) << "] n=" << n;
  }
}

TEST(RowOps, BadArgumentsAreRefused) {
  std::vector<float> x(8, 1.0f), g(4, 1.0f), b(4, 0.0f), y(8);
  const auto refused = [](auto&& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << what << ": " << e.what();
    }
  };
  refused([&] { layer_norm(x.data(), 0, 4, g.data(), b.data(), 1e-5f, y.data()); }, "M = 0");
  refused([&] { layer_norm(x.data(), 2, 0, g.data(), b.data(), 1e-5f, y.data()); }, "E = 0");
  refused([&] { layer_norm(nullptr, 2, 4, g.data(), b.data(), 1e-5f, y.data()); }, "null x");
  refused([&] { layer_norm(x.data(), 2, 4, g.data(), b.data(), 0.0f, y.data()); }, "eps = 0");
  refused([&] { layer_norm(x.data(), 2, 4, g.data(), b.data(), std::nanf(""), y.data()); }, "eps NaN");
  refused([&] { layer_norm(x.data(), 2, 4, g.data(), b.data(), 1e-5f, y.data(), {.threads = -1}); }, "threads -1");
  refused([&] { gelu_tanh(x.data(), -1); }, "n = -1");
  refused([&] { gelu_tanh(nullptr, 3); }, "null x");
  EXPECT_NO_THROW(gelu_tanh(nullptr, 0));
  refused([&] { residual_add(x.data(), x.data(), -2); }, "n = -2");
  refused([&] { residual_add(x.data(), nullptr, 3); }, "null");
  EXPECT_NO_THROW(residual_add(nullptr, nullptr, 0));
  EXPECT_EQ(y, std::vector<float>(8));  // nothing written by a refused call
}

GPT2ATTN_INSTANTIATE_ISAS(Isa, RowOps);

}  // namespace
}  // namespace gpt2attn
