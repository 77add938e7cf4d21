// tests/test_batch_invariant.cpp: RunOptions::batch_invariant. A ragged step's every token, and a decode step's, the
// same bits as its entry run alone, at another thread count: every instruction set, compute type, weight format and K/V
// format; and a Linear's rows the same bits at any row count. (Without the option, a step past 64 tokens switches to
// GEMMs and the split-KV plan follows the step's total keys and the threads: results then agree within the
// tolerance only, which test_kv_step.cpp checks.)
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpt2attn/linear.hpp"
#include "tests/isa_param.hpp"
#include "tests/kv_harness.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::IsaTest;

class BatchInvariant : public IsaTest {};

TEST_P(BatchInvariant, EveryEntryOfAStepIsItsOwnRunAlone) {
  Config cfg = test::serving_config(64, 4, 0, 700);
  cfg.num_kv_heads = 2;
  std::mt19937_64 rng(17);
  const Weights w = Weights::random(cfg, 5);
  // Cached lengths on both sides of a split range (256 keys) and of a 16-token block; entries of one token (decode),
  // a draft, a short chunk (decode kernel), a long one (tiled kernel), a prompt from nothing.
  const std::vector<int64_t> history = {0, 5, 40, 130, 300, 601};
  const std::vector<int64_t> tokens = {70, 1, 4, 1, 17, 1};
  const int64_t E = cfg.d_model;
  for (DType compute : {DType::f32, DType::bf16}) {
    for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
      for (DType kv : test::kv_formats()) {
        EngineOptions o;
        o.isa = isa(), o.compute = compute, o.weights = f;
        CausalSelfAttention layer(cfg, w, o);
        KvCacheOptions k;
        k.capacity_tokens = 4096, k.block_tokens = 16, k.dtype = kv;
        KvCache batch(cfg, k), alone(cfg, k);
        RunOptions run;
        run.batch_invariant = true;
        const std::string what = std::string(to_string(compute)) + "/" + to_string(f) + " kv " + to_string(kv);
        std::vector<SequenceId> sb, sa;
        for (int64_t len : history) {  // the same history in both caches, by the same calls
          sb.push_back(batch.create()), sa.push_back(alone.create());
          if (len == 0) continue;
          const std::vector<float> x = test::random_uniform(static_cast<size_t>(len * E), rng);
          std::vector<float> y(x.size());
          layer.step(batch, &sb.back(), &len, 1, x.data(), y.data(), run);
          layer.step(alone, &sa.back(), &len, 1, x.data(), y.data(), run);
        }
        // Twice: a ragged step, then a step of one token each (decode()).
        for (int round = 0; round < 2; ++round) {
          std::vector<int64_t> n = tokens;
          if (round == 1) n.assign(tokens.size(), 1);
          int64_t M = 0;
          for (int64_t t : n) M += t;
          const std::vector<float> x = test::random_uniform(static_cast<size_t>(M * E), rng);
          std::vector<float> y(x.size());
          run.threads = 2;
          layer.step(batch, sb.data(), n.data(), static_cast<int64_t>(n.size()), x.data(), y.data(), run);
          int64_t row = 0;
          for (size_t i = 0; i < n.size(); ++i) {
            std::vector<float> one(static_cast<size_t>(n[i] * E));
            run.threads = 1 + static_cast<int>(i % 3);
            layer.step(alone, &sa[i], &n[i], 1, x.data() + row * E, one.data(), run);
            const std::vector<float> in_batch(y.begin() + row * E, y.begin() + (row + n[i]) * E);
            EXPECT_EQ(in_batch, one) << what << ", round " << round << ", entry " << i << " (" << n[i]
                                     << " tokens over " << history[i] << " cached), alone on " << run.threads
                                     << " threads";
            row += n[i];
          }
        }
      }
    }
  }
}

TEST_P(BatchInvariant, LinearRowsAreTheSameBitsAtAnyRowCount) {
  std::mt19937_64 rng(23);
  const int64_t N = 150, K = 96;
  const std::vector<float> w = test::random_uniform(static_cast<size_t>(N * K), rng);
  const std::vector<float> b = test::random_uniform(static_cast<size_t>(N), rng);
  const std::vector<float> x = test::random_uniform(static_cast<size_t>(300 * K), rng);
  for (DType compute : {DType::f32, DType::bf16}) {
    for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
      EngineOptions o;
      o.isa = isa(), o.compute = compute, o.weights = f;
      Linear lin(TensorView::f32(w.data(), {N, K}), TensorView::f32(b.data(), {N}), o);
      RunOptions run;
      run.batch_invariant = true, run.threads = 2;
      std::vector<float> all(static_cast<size_t>(300 * N));
      lin.forward(x.data(), 300, all.data(), run);
      for (int64_t r : {int64_t{0}, int64_t{7}, int64_t{63}, int64_t{64}, int64_t{299}}) {
        std::vector<float> one(static_cast<size_t>(N));
        run.threads = 1;
        lin.forward(x.data() + r * K, 1, one.data(), run);
        EXPECT_EQ(std::vector<float>(all.begin() + r * N, all.begin() + (r + 1) * N), one)
            << to_string(compute) << "/" << to_string(f) << " row " << r;
      }
    }
  }
}

GPT2ATTN_INSTANTIATE_ISAS(Isa, BatchInvariant);

}  // namespace
}  // namespace gpt2attn
