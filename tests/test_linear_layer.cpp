// The public Linear (gpt2attn/linear.hpp) against a double loop over the weights it computes with, at every compiled
// instruction set, weight format, compute type and path; its errors; its results across thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/quantized.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/linear.hpp"
#include "gpt2attn/tolerance.hpp"
#include "tests/isa_param.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::IsaTest;

struct Case {
  int64_t M, N, K;
};

// y = x W^T + b in double over W's values as a layer of format f holds them.
std::vector<double> reference(const std::vector<float>& x, int64_t M, int64_t ldx, const std::vector<float>& w,
                              const std::vector<float>& b, int64_t N, int64_t K) {
  std::vector<double> y(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t n = 0; n < N; ++n) {
      double s = b.empty() ? 0.0 : b[static_cast<size_t>(n)];
      for (int64_t k = 0; k < K; ++k) {
        s += static_cast<double>(x[static_cast<size_t>(i * ldx + k)]) * w[static_cast<size_t>(n * K + k)];
      }
      y[static_cast<size_t>(i * N + n)] = s;
    }
  }
  return y;
}

class LinearLayer : public IsaTest {};

TEST_P(LinearLayer, MatchesReferenceForEveryFormatComputeAndPath) {
  std::mt19937_64 rng(0x11ea2 + static_cast<int>(isa()));
  // Rows on both sides of kFewRows and of the GEMMs' 512-row blocks; widths on both sides of the panels (16 outputs,
  // 64-column GEMMs) and of int4's 32-input groups, odd ones included.
  const Case cases[] = {{1, 1, 1}, {3, 17, 31}, {64, 64, 33}, {65, 100, 64}, {200, 257, 96}, {600, 40, 130}};
  for (const Case& c : cases) {
    const int64_t ldx = c.K + 3, ldy = c.N + 5;
    const std::vector<float> w = test::random_uniform(static_cast<size_t>(c.N * c.K), rng);
    const std::vector<float> b = test::random_uniform(static_cast<size_t>(c.N), rng);
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(c.M * ldx), rng);
    const TensorView wv = TensorView::f32(w.data(), {c.N, c.K}), bv = TensorView::f32(b.data(), {c.N});
    for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
      const std::vector<float> held = detail::dequantized_values(wv, f);
      const std::vector<double> want = reference(x, c.M, ldx, held, b, c.N, c.K);
      double max_ref = 0.0;
      for (double v : want) max_ref = std::max(max_ref, std::fabs(v));
      for (DType compute : {DType::f32, DType::bf16}) {
        for (LinearPaths paths : {LinearPaths::both, LinearPaths::few_rows}) {
          EngineOptions o;
          o.isa = isa(), o.compute = compute, o.weights = f, o.threads = 2;
          Linear lin(wv, bv, o, paths);
          std::vector<float> y(static_cast<size_t>(c.M * ldy), -7.0f);
          lin.forward(x.data(), c.M, ldx, y.data(), ldy);
          const Tolerance tol = linear_tolerance(f, compute, c.K, max_ref);
          const std::string where = "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" +
                                    std::to_string(c.K) + " " + to_string(f) + " " + to_string(compute) +
                                    (paths == LinearPaths::both ? " both " : " few_rows ") + lin.implementation();
          int bad = 0;
          for (int64_t i = 0; i < c.M && bad < 3; ++i) {
            for (int64_t n = 0; n < ldy; ++n) {
              const float got = y[static_cast<size_t>(i * ldy + n)];
              if (n >= c.N) {  // past N: untouched
                if (got != -7.0f && bad++ < 3) ADD_FAILURE() << where << ": wrote past N at (" << i << ", " << n << ")";
                continue;
              }
              const double e = want[static_cast<size_t>(i * c.N + n)];
              if (!tol.accepts(got, e) && bad++ < 3) {
                ADD_FAILURE() << where << " at (" << i << ", " << n << "): got " << got << ", expected " << e;
              }
            }
          }
        }
      }
    }
  }
}

// The cut of the panels among threads changes which thread computes a column, never how: every output is the same
// bits at any thread count (a server's results must not depend on its thread count).
TEST_P(LinearLayer, SameBitsAtEveryThreadCount) {
  std::mt19937_64 rng(7);
  const int64_t N = 300, K = 200;
  const std::vector<float> w = test::random_uniform(static_cast<size_t>(N * K), rng);
  const std::vector<float> b = test::random_uniform(static_cast<size_t>(N), rng);
  for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
    for (int64_t M : {int64_t{1}, int64_t{9}, int64_t{64}, int64_t{130}}) {
      const std::vector<float> x = test::random_uniform(static_cast<size_t>(M * K), rng);
      EngineOptions o;
      o.isa = isa(), o.weights = f;
      Linear lin(TensorView::f32(w.data(), {N, K}), TensorView::f32(b.data(), {N}), o);
      std::vector<float> y1(static_cast<size_t>(M * N)), y2(y1.size()), y3(y1.size());
      RunOptions r;
      r.threads = 1;
      lin.forward(x.data(), M, y1.data(), r);
      r.threads = 2;
      lin.forward(x.data(), M, y2.data(), r);
      r.threads = 3;
      lin.forward(x.data(), M, y3.data(), r);
      EXPECT_EQ(y1, y2) << to_string(f) << " M=" << M;
      EXPECT_EQ(y1, y3) << to_string(f) << " M=" << M;
    }
  }
}

GPT2ATTN_INSTANTIATE_ISAS(Isa, LinearLayer);

// A Hugging Face Conv1D weight (K, N) read as its transposed view gives the same layer as its contiguous transpose.
TEST(LinearLayerViews, TransposedViewEqualsContiguousCopy) {
  std::mt19937_64 rng(3);
  const int64_t N = 48, K = 40, M = 70;
  const std::vector<float> conv = test::random_uniform(static_cast<size_t>(K * N), rng);  // (K, N)
  std::vector<float> t(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) t[static_cast<size_t>(n * K + k)] = conv[static_cast<size_t>(k * N + n)];
  }
  const std::vector<float> x = test::random_uniform(static_cast<size_t>(M * K), rng);
  Linear a(TensorView::f32(conv.data(), {N, K}).with_strides({1, N}), {});
  Linear b(TensorView::f32(t.data(), {N, K}), {});
  std::vector<float> ya(static_cast<size_t>(M * N)), yb(ya.size());
  a.forward(x.data(), M, ya.data());
  b.forward(x.data(), M, yb.data());
  EXPECT_EQ(ya, yb);
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LinearLayerErrors, BadWeightsAndCallsAreNamedAndWriteNothing) {
  std::vector<float> w(12, 0.5f), b(3, 0.0f), x(8, 1.0f), y(6, -1.0f);
  const TensorView wv = TensorView::f32(w.data(), {3, 4});
  expect_invalid([&] { Linear(TensorView::f32(w.data(), {12}), {}); }, "rank-2");
  expect_invalid([&] { Linear(TensorView::u8(reinterpret_cast<const uint8_t*>(w.data()), {3, 4}), {}); }, "u8");
  expect_invalid([&] { Linear(wv, TensorView::f32(b.data(), {2})); }, "bias");
  std::vector<float> nan_w = w;
  nan_w[6] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid([&] { Linear(TensorView::f32(nan_w.data(), {3, 4}), {}); }, "NaN at (1, 2)");
  EngineOptions bad;
  bad.compute = DType::f16;
  expect_invalid([&] { Linear(wv, {}, bad); }, "compute");

  Linear lin(wv, TensorView::f32(b.data(), {3}));
  expect_invalid([&] { lin.forward(x.data(), 0, y.data()); }, "M >= 1");
  expect_invalid([&] { lin.forward(nullptr, 2, y.data()); }, "null");
  expect_invalid([&] { lin.forward(x.data(), 2, 3, y.data(), 3); }, "ldx 3");
  RunOptions many;
  many.threads = max_threads() + 1;
  expect_invalid([&] { lin.forward(x.data(), 2, y.data(), many); }, "RunOptions.threads");
  x[5] = std::numeric_limits<float>::infinity();
  expect_invalid([&] { lin.forward(x.data(), 2, y.data()); }, "Linear::forward: x contains +Inf at");
  EXPECT_EQ(y, std::vector<float>(6, -1.0f));  // every refused call left y as it was
  // An output past float's range is named, not returned as Inf.
  std::vector<float> big(12, 3e38f), ones(4, 2.0f), out(3);
  Linear huge(TensorView::f32(big.data(), {3, 4}), {});
  expect_invalid([&] { huge.forward(ones.data(), 1, out.data()); }, "Linear: the output");
}

TEST(LinearLayerErrors, ReserveSizesTheWorkspace) {
  std::mt19937_64 rng(5);
  const int64_t N = 130, K = 70;
  const std::vector<float> w = test::random_uniform(static_cast<size_t>(N * K), rng);
  EngineOptions o;
  o.weights = WeightFormat::int8;
  Linear lin(TensorView::f32(w.data(), {N, K}), {}, o);
  Workspace ws;
  lin.reserve(700, 2, &ws);
  EXPECT_GE(ws.bytes(), lin.workspace_bytes(700, 2));
  const size_t held = ws.bytes();
  for (int64_t M : {int64_t{1}, int64_t{64}, int64_t{65}, int64_t{700}}) {
    const std::vector<float> x = test::random_uniform(static_cast<size_t>(M * K), rng);
    std::vector<float> y(static_cast<size_t>(M * N));
    RunOptions r;
    r.threads = 2;
    lin.forward(x.data(), M, y.data(), r, &ws);
    EXPECT_EQ(ws.bytes(), held) << "M=" << M << ": the workspace grew after reserve()";
  }
  expect_invalid([&] { lin.reserve(0); }, "max_rows");
}

}  // namespace
}  // namespace gpt2attn
