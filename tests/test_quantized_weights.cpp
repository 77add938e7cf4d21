// tests/test_quantized_weights.cpp: layers holding int8 or int4 weights (EngineOptions::weights) on every instruction
// set this CPU runs: every path (forward, chunked extend, decode with mixed lengths, a ragged step) against the naive
// reference run on the dequantized weights (dequantized(), the values the layer computes with), for f32 and bf16
// compute, MHA and grouped K/V heads, f32 and int8 caches; the quantization itself (codes, scales, rows of zeros,
// odd widths); and the error the formats add against the f32 weights, beside llama.cpp's q8_0 and q4_0 on the same
// weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/convert.hpp"
#include "gpt2attn/gpt2attn.hpp"
#include "engine/linear.hpp"
#include "engine/quantized.hpp"
#include "kernels/linear.hpp"
#include "kernels/tiles.hpp"
#include "tests/isa_param.hpp"
#include "tests/kv_harness.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerance.hpp"

namespace gpt2attn {
namespace {

using test::pool;
using test::reference_sequence;
using test::serving_config;

constexpr WeightFormat kFormats[] = {WeightFormat::int8, WeightFormat::int4};

// The bound of a layer computing in `compute` over a `kv` cache against the reference on its dequantized weights: the
// weights' quantization is exact there, so what is left is the compute type's and the cache's (layer_tolerance, whose
// bf16 part counts the rounding of the weights to bf16 that prefill's GEMMs make), and int8's integer GEMMs' rounding
// of their inputs (dequantized_tolerance).
Tolerance bound(WeightFormat f, DType compute, DType kv, int64_t D, int64_t K, double m) {
  return dequantized_tolerance(f, compute, kv, D, K, m);
}

Config grouped(Config c, int64_t kv_heads) {
  c.num_kv_heads = kv_heads;
  return c;
}

class QuantizedWeights : public test::IsaTest {};

// forward (B = 2), then two sequences in one cache: chunked extends of different lengths, decode steps over both at
// once, and a ragged step (one token of one, three of the other); each sequence's outputs against the reference over
// its whole history.
TEST_P(QuantizedWeights, EveryPathMatchesReferenceOnDequantizedWeights) {
  // d_in = 40: not a multiple of int4's 32-input groups (the last group of each row holds 8).
  const Config configs[] = {serving_config(96, 3, 40, 256), grouped(serving_config(128, 4, 0, 256), 2)};
  int c_i = 0;
  for (const Config& c : configs) {
    for (DType compute : {DType::f32, DType::bf16}) {
      for (WeightFormat f : kFormats) {
        const uint64_t seed = 700 + 10 * c_i + (compute == DType::bf16 ? 5 : 0) + static_cast<uint64_t>(f);
        const Weights w = Weights::random(c, seed);
        CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .isa = isa(), .compute = compute, .weights = f});
        const Config& cc = block.config();
        const Weights deq = dequantized(w.view(cc), f);
        const int64_t W = cc.query_width(), E = cc.d_model, D = cc.head_dim();
        const std::string ctx = test::label(isa(), 2, std::string(to_string(f)) + " weights, " + to_string(compute) +
                                                           " compute | " + test::describe(cc));
        // int8 prefill runs integer GEMMs wherever oneDNN has VNNI, and says so; int4 never does.
        const bool int8_gemms = f == WeightFormat::int8 && detail::Linear::int8_available();
        EXPECT_EQ(block.layer().implementation().find("u8 x s8") != std::string::npos, int8_gemms)
            << block.layer().implementation();
        std::mt19937_64 rng(seed + 1);

        // forward: two sequences of 37 tokens.
        {
          const int64_t B = 2, T = 37;
          const std::vector<float> x = test::random_uniform(static_cast<size_t>(B * T * W), rng, -2.0f, 2.0f);
          std::vector<float> got(static_cast<size_t>(B * T * E), test::kNaN);
          block.forward(x.data(), B, T, got.data());
          AttentionInputs in;
          in.query = TensorView::f32(x.data(), {B, T, W});
          const std::vector<double> ref = reference_forward(cc, deq, in);
          const int64_t K = test::reduction_length(cc, T);
          EXPECT_TRUE(test::all_close_within(got, ref, [&](double m) { return bound(f, compute, DType::f32, D, K, m); },
                                             ctx + " | forward B=2 T=37"));
        }

        for (DType kv : {DType::f32, DType::i8}) {
          KvCacheOptions opts = pool(16, 256);
          opts.dtype = kv;
          KvCache cache(cc, opts);
          const SequenceId ids[2] = {cache.create(), cache.create()};
          const int64_t first[2] = {23, 6};  // prompt lengths; the first in two chunks (15 + 8)
          const int64_t steps = 3, ragged[2] = {1, kernels::tiles::kStepFewRowTokens + 2};
          const int64_t N[2] = {first[0] + steps + ragged[0], first[1] + steps + ragged[1]};
          std::vector<float> xs[2], outs[2];
          for (int s = 0; s < 2; ++s) {
            xs[s] = test::random_uniform(static_cast<size_t>(N[s] * W), rng, -2.0f, 2.0f);
            outs[s].assign(static_cast<size_t>(N[s] * E), test::kNaN);
          }
          block.extend(cache, ids[0], xs[0].data(), 15, outs[0].data());
          block.extend(cache, ids[0], xs[0].data() + 15 * W, first[0] - 15, outs[0].data() + 15 * E);
          block.extend(cache, ids[1], xs[1].data(), first[1], outs[1].data());
          for (int64_t t = 0; t < steps; ++t) {
            std::vector<float> x2(static_cast<size_t>(2 * W)), y2(static_cast<size_t>(2 * E), test::kNaN);
            for (int s = 0; s < 2; ++s) {
              std::copy_n(xs[s].begin() + (first[s] + t) * W, W, x2.begin() + s * W);
            }
            block.decode(cache, ids, 2, x2.data(), y2.data());
            for (int s = 0; s < 2; ++s) std::copy_n(y2.begin() + s * E, E, outs[s].begin() + (first[s] + t) * E);
          }
          {  // a ragged step: 1 token of the first sequence, ragged[1] of the second (past kStepFewRowTokens: GEMMs)
            const int64_t M = ragged[0] + ragged[1];
            std::vector<float> xm(static_cast<size_t>(M * W)), ym(static_cast<size_t>(M * E), test::kNaN);
            const int64_t at[2] = {first[0] + steps, first[1] + steps};
            std::copy_n(xs[0].begin() + at[0] * W, ragged[0] * W, xm.begin());
            std::copy_n(xs[1].begin() + at[1] * W, ragged[1] * W, xm.begin() + ragged[0] * W);
            block.step(cache, ids, ragged, 2, xm.data(), ym.data());
            std::copy_n(ym.begin(), ragged[0] * E, outs[0].begin() + at[0] * E);
            std::copy_n(ym.begin() + ragged[0] * E, ragged[1] * E, outs[1].begin() + at[1] * E);
          }
          for (int s = 0; s < 2; ++s) {
            const std::vector<double> ref = reference_sequence(cc, deq, xs[s]);
            const int64_t K = test::reduction_length(cc, N[s]);
            EXPECT_TRUE(test::all_close_within(
                outs[s], ref, [&](double m) { return bound(f, compute, kv, D, K, m); },
                ctx + " | " + to_string(kv) + " cache, sequence " + std::to_string(s) +
                    ": extend, 3 decode steps of B=2, a ragged step; index t*E+e"));
          }
        }
      }
    }
    ++c_i;
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, QuantizedWeights);

// The quantization of gpt2attn/dtype.hpp: every dequantized weight within half a step of its value, the step the
// scale of its row (int8) or group (int4); a row's largest magnitude kept to a rounding; rows of zeros zero.
TEST(WeightQuantization, CodesScalesAndEdgeRows) {
  const int64_t N = 5, K = 70;  // 70 = two int4 groups of 32 and one of 6
  std::mt19937_64 rng(11);
  std::vector<float> w = test::random_uniform(static_cast<size_t>(N * K), rng, -3.0f, 3.0f);
  std::fill_n(w.begin() + K, K, 0.0f);           // row 1: zeros
  w[2 * K + 7] = 1e30f;                          // row 2: one huge weight
  std::fill_n(w.begin() + 3 * K + 32, 32, 0.0f);  // row 3: a group of zeros
  w[4 * K + 3] = -std::numeric_limits<float>::max();  // row 4: the largest finite magnitude
  for (WeightFormat f : kFormats) {
    const std::vector<float> d = detail::dequantized_values(TensorView::f32(w.data(), {N, K}), f);
    const int qmax = f == WeightFormat::int8 ? 127 : 8;  // int4: the largest magnitude's code is -8
    const int64_t group = f == WeightFormat::int8 ? K : kWeightGroup;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k0 = 0; k0 < K; k0 += group) {
        const int64_t len = std::min(group, K - k0);
        double amax = 0;
        for (int64_t k = 0; k < len; ++k) amax = std::max(amax, std::fabs(double{w[n * K + k0 + k]}));
        const double step = amax / qmax;
        for (int64_t k = 0; k < len; ++k) {
          const size_t i = static_cast<size_t>(n * K + k0 + k);
          ASSERT_TRUE(std::isfinite(d[i])) << to_string(f) << " row " << n << " k " << k0 + k;
          // int4 clips the other sign's values beyond 7.5 steps to code 7 (as q4_0): up to a whole step there.
          const double clipped = f == WeightFormat::int4 && std::fabs(w[i]) > 7.5 * step ? 1.0 : 0.5;
          EXPECT_LE(std::fabs(double{d[i]} - w[i]), clipped * step * (1 + 1e-6) + 1e-30)
              << to_string(f) << " row " << n << " k " << k0 + k << ": " << w[i] << " -> " << d[i];
          if (amax == 0) {
            EXPECT_EQ(d[i], 0.0f) << to_string(f) << " row " << n << ": a zero group stays zero";
          }
          if (std::fabs(double{w[i]}) == amax && amax > 0) {
            EXPECT_NEAR(std::fabs(double{d[i]}) / amax, 1.0, 1e-6) << to_string(f) << " row " << n << ": the largest";
          }
        }
      }
    }
  }
}

// With check_finite off, a NaN in one token's input spreads through an int8 layer's outputs exactly as through the
// compute-type layer's (the same elements NaN, the others finite; sequence 1 of the batch untouched): int8's integer
// GEMMs give such a row a NaN scale rather than codes of a NaN.
TEST(WeightQuantization, NonFiniteInputsSpreadAsInTheComputeTypeLayer) {
  const Config c = serving_config(64, 2, 0, 64);
  const Weights w = Weights::random(c, 5);
  CausalSelfAttention dense(c, w, EngineOptions{.threads = 2});
  CausalSelfAttention q8(c, w, EngineOptions{.threads = 2, .weights = WeightFormat::int8});
  std::mt19937_64 rng(6);
  std::vector<float> x = test::random_uniform(static_cast<size_t>(2 * 5 * 64), rng, -1.0f, 1.0f);
  x[2 * 64 + 7] = test::kNaN;
  std::vector<float> want(x.size(), 0.0f), got(x.size(), 0.0f);
  dense.forward(x.data(), 2, 5, want.data(), RunOptions{.check_finite = false});
  q8.forward(x.data(), 2, 5, got.data(), RunOptions{.check_finite = false});
  int64_t nan = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    nan += std::isnan(want[i]);
    ASSERT_EQ(std::isnan(got[i]), std::isnan(want[i])) << "element " << i << ": " << q8.layer().implementation();
  }
  EXPECT_GT(nan, 0);
  EXPECT_LE(nan, 5 * 64) << "the second sequence must stay finite";
}

// A weights format that is none of the enumerators is refused, naming the option.
TEST(WeightQuantization, UnknownFormatIsRefused) {
  const Config c = serving_config(32, 2);
  const Weights w = Weights::random(c, 3);
  try {
    CausalSelfAttention b(c, w, EngineOptions{.weights = static_cast<WeightFormat>(9)});
    FAIL() << "accepted weight format 9";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("EngineOptions.weights"), std::string::npos) << e.what();
  }
  EXPECT_THROW(weight_format_from_string("int3"), Error);
  EXPECT_EQ(weight_format_from_string("int4"), WeightFormat::int4);
}

// llama.cpp's q8_0 and q4_0 (ggml-quants.c: blocks of 32 inputs, an f16 scale d each; q8_0 d = amax / 127, q = round(x
// / d); q4_0 d = max / -8 with max the block's value of largest magnitude, q = min(15, trunc(x / d + 8.5)), the value
// (q - 8) d), applied to each row of a weight matrix, as f32.
float f16_round(float x) { return static_cast<float>(static_cast<_Float16>(x)); }
std::vector<float> llama_q(const std::vector<float>& w, int64_t N, int64_t K, bool q4) {
  std::vector<float> out(w.size());
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const int64_t len = std::min<int64_t>(32, K - k0);
      const float* x = w.data() + n * K + k0;
      float amax = 0, max = 0;
      for (int64_t k = 0; k < len; ++k) {
        if (std::fabs(x[k]) > amax) amax = std::fabs(x[k]), max = x[k];
      }
      const float d = q4 ? max / -8.0f : amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f, dh = f16_round(d);
      for (int64_t k = 0; k < len; ++k) {
        const float q = q4 ? std::min(15.0f, std::trunc(x[k] * id + 8.5f)) - 8.0f : std::nearbyint(x[k] * id);
        out[static_cast<size_t>(n * K + k0 + k)] = q * dh;
      }
    }
  }
  return out;
}

struct ErrorStats {
  double max = 0, mean = 0;  // of |got - f32 weights' output|, over the output's rms
  double of_largest = 0;     // the largest error over the output's largest magnitude
};
ErrorStats error_of(const std::vector<double>& got, const std::vector<double>& ref) {
  double ss = 0, max = 0, sum = 0, largest = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ss += ref[i] * ref[i];
    max = std::max(max, std::fabs(got[i] - ref[i]));
    sum += std::fabs(got[i] - ref[i]);
    largest = std::max(largest, std::fabs(ref[i]));
  }
  const double rms = std::sqrt(ss / static_cast<double>(ref.size()));
  return {max / rms, sum / static_cast<double>(ref.size()) / rms, max / largest};
}

// What each format costs in accuracy against the f32 weights, per GPT-2 width (random weights at GPT-2's
// initialization, N(0, 0.02); inputs N(0, 1), as after a LayerNorm; T = 32 causal): the naive reference on the
// dequantized weights against the reference on the f32 weights, so only the weights' rounding is measured. Beside
// ours, llama.cpp's q8_0 and q4_0 on the same weights. Each of ours stays within weights_tolerance.
TEST(WeightQuantization, ErrorAgainstF32WeightsBesideLlamaCppFormats) {
  const int64_t widths[][2] = {{768, 12}, {1024, 16}, {1280, 20}, {1600, 25}};
  std::printf("%-6s %-8s %-22s %-22s %-22s %-22s\n", "E", "", "int8 (ours)", "q8_0", "int4 (ours)", "q4_0");
  for (const auto& [E, H] : widths) {
    const Config c = serving_config(E, H, 0, 64);
    std::mt19937_64 rng(static_cast<uint64_t>(E));
    std::normal_distribution<float> init(0.0f, 0.02f), unit(0.0f, 1.0f);
    Weights w = Weights::random(c, static_cast<uint64_t>(E));
    for (auto* v : {&w.w_q, &w.w_k, &w.w_v, &w.w_o}) {
      for (float& x : *v) x = init(rng);
    }
    const int64_t T = 32;
    std::vector<float> x(static_cast<size_t>(T * E));
    for (float& v : x) v = unit(rng);
    const std::vector<double> ref = reference_sequence(c, w, x);
    const auto llama = [&](bool q4) {
      Weights q = w;
      for (auto* v : {&q.w_q, &q.w_k, &q.w_v, &q.w_o}) *v = llama_q(*v, E, E, q4);
      return error_of(reference_sequence(c, q, x), ref);
    };
    ErrorStats ours[2];
    for (int i = 0; i < 2; ++i) {
      const WeightFormat f = kFormats[i];
      const std::vector<double> got = reference_sequence(c, dequantized(w.view(c), f), x);
      ours[i] = error_of(got, ref);
      double m = 0;
      for (double r : ref) m = std::max(m, std::fabs(r));
      const int64_t K = test::reduction_length(c, T);
      EXPECT_TRUE(test::all_close_within(std::vector<float>(got.begin(), got.end()), ref,
                                         [&](double mm) { return weights_tolerance(f, DType::f32, DType::f32, c.head_dim(), K, mm); },
                                         std::string(to_string(f)) + " weights against f32 ones, E=" + std::to_string(E)));
    }
    const ErrorStats q8 = llama(false), q4 = llama(true);
    std::printf("%-6lld max/mean %8.2e / %8.2e  %8.2e / %8.2e  %8.2e / %8.2e  %8.2e / %8.2e | of the bound's "
                "weights term: int8 %.2f, int4 %.2f\n",
                static_cast<long long>(E), ours[0].max, ours[0].mean, q8.max, q8.mean, ours[1].max, ours[1].mean,
                q4.max, q4.mean, ours[0].of_largest / (kWeightChain * weights_roundoff(WeightFormat::int8, E)),
                ours[1].of_largest / (kWeightChain * weights_roundoff(WeightFormat::int4, E)));
    // q8_0's scale per 32 inputs beats int8's one per row (which the integer GEMMs' per-channel rescale needs): 1.4-1.5x
    // the mean error here. int4 takes q4_0's scale rule per 32 inputs, with an f32 scale where q4_0 rounds its to f16.
    EXPECT_LT(ours[0].mean, 2 * q8.mean) << "E=" << E;
    EXPECT_LE(ours[1].mean, 1.01 * q4.mean) << "E=" << E;
  }
}

}  // namespace
}  // namespace gpt2attn
