// The GPT-2 runner (gpt2attn/gpt2.hpp) on random tiny models: the cached paths against the teacher-forced logits,
// batches against sequences alone, generation against the logits it reads, and its errors. Parity with a float64
// PyTorch GPT-2 and with transformers runs in tests/python (test_gpt2_logits.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/tolerance.hpp"

namespace gpt2attn {
namespace {

GPT2Config tiny() {
  GPT2Config c;
  c.vocab_size = 97, c.n_positions = 80, c.n_embd = 32, c.n_head = 4, c.n_layer = 3;
  return c;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& i : ids) i = d(rng);
  return ids;
}

// The runner's paths differ from the teacher-forced forward only in summation order (few-row kernel against GEMMs,
// split-KV decode against the tiled kernel): the model's f32 bound (model_tolerance) relative to the largest logit.
::testing::AssertionResult close(const float* got, const float* want, int64_t n, int64_t layers, int64_t inner,
                                 const std::string& what) {
  double max_ref = 0.0;
  for (int64_t i = 0; i < n; ++i) max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  const Tolerance t = model_tolerance(DType::f32, layers, inner, max_ref);
  for (int64_t i = 0; i < n; ++i) {
    if (!t.accepts(got[i], want[i])) {
      return ::testing::AssertionFailure() << what << ": logit " << i << " is " << got[i] << ", expected " << want[i]
                                           << " (atol " << t.atol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(GPT2Runner, PrefillThenDecodeEqualsTeacherForcedLogits) {
  const GPT2Config c = tiny();
  GPT2 model(random_gpt2(c, 1));
  std::mt19937_64 rng(2);
  const std::vector<int32_t> ids = random_ids(40, c.vocab_size, rng);
  const int64_t V = c.vocab_size, T = 40, P = 13;
  std::vector<float> full(static_cast<size_t>(T * V));
  model.logits(ids.data(), T, full.data());

  KvCacheOptions k;
  k.capacity_tokens = 128;
  k.block_tokens = 8;
  ModelKvCache cache = model.make_cache(k);
  const SequenceId s = cache.create();
  std::vector<float> all(static_cast<size_t>(P * V)), last(static_cast<size_t>(V));
  const int64_t p = P;
  model.step(cache, &s, &p, 1, ids.data(), all.data(), /*all_positions=*/true);
  EXPECT_TRUE(close(all.data(), full.data(), P * V, c.n_layer, c.inner(), "prefill"));
  for (int64_t t = P; t < T; ++t) {  // one token at a time
    const int64_t one = 1;
    model.step(cache, &s, &one, 1, ids.data() + t, last.data());
    ASSERT_TRUE(close(last.data(), full.data() + t * V, V, c.n_layer, c.inner(), "decode t=" + std::to_string(t)));
  }
  EXPECT_EQ(cache.length(s), T);
}

TEST(GPT2Runner, BatchOfSequencesEqualsEachAlone) {
  const GPT2Config c = tiny();
  GPT2 model(random_gpt2(c, 3));
  std::mt19937_64 rng(4);
  const int64_t V = c.vocab_size;
  const std::vector<int64_t> lens = {5, 17, 1, 9};
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : lens) prompts.push_back(random_ids(n + 3, V, rng));
  KvCacheOptions k;
  k.capacity_tokens = 256;
  k.block_tokens = 4;
  ModelKvCache batch = model.make_cache(k), alone = model.make_cache(k);
  std::vector<SequenceId> sb, sa;
  for (size_t i = 0; i < lens.size(); ++i) sb.push_back(batch.create()), sa.push_back(alone.create());
  // Step 1: every prompt's first lens[i] ids in one ragged step; step 2: three more ids each, mixed lengths again.
  for (int round = 0; round < 2; ++round) {
    std::vector<int64_t> tokens;
    std::vector<int32_t> ids;
    for (size_t i = 0; i < lens.size(); ++i) {
      const int64_t off = round == 0 ? 0 : lens[i], n = round == 0 ? lens[i] : 3;
      tokens.push_back(n);
      ids.insert(ids.end(), prompts[i].begin() + off, prompts[i].begin() + off + n);
    }
    std::vector<float> got(lens.size() * static_cast<size_t>(V));
    model.step(batch, sb.data(), tokens.data(), static_cast<int64_t>(lens.size()), ids.data(), got.data());
    int64_t at = 0;
    for (size_t i = 0; i < lens.size(); ++i) {
      std::vector<float> want(static_cast<size_t>(V));
      model.step(alone, &sa[i], &tokens[i], 1, ids.data() + at, want.data());
      at += tokens[i];
      EXPECT_TRUE(close(got.data() + i * V, want.data(), V, c.n_layer, c.inner(),
                        "round " + std::to_string(round) + " sequence " + std::to_string(i)));
    }
  }
}

TEST(GPT2Runner, GreedyGenerationFollowsTheArgmaxOfItsLogits) {
  const GPT2Config c = tiny();
  GPT2 model(random_gpt2(c, 5));
  std::mt19937_64 rng(6);
  const std::vector<std::vector<int32_t>> prompts = {random_ids(7, c.vocab_size, rng), random_ids(30, c.vocab_size, rng),
                                                     random_ids(1, c.vocab_size, rng)};
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.max_step_tokens = 16;  // the 30-id prompt prefills in two chunks while the others decode
  g.logprobs = true;
  const std::vector<Generation> out = model.generate(prompts, g);
  ASSERT_EQ(out.size(), prompts.size());
  const int64_t V = c.vocab_size;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].prompt_ids, prompts[i]);
    ASSERT_EQ(out[i].new_ids.size(), 12u);
    EXPECT_EQ(out[i].finish_reason, "length");
    EXPECT_EQ(out[i].logprobs.size(), 12u);
    // Teacher forcing over prompt + the new ids but the last: each new id is the argmax at the position before it
    // (or within the tolerance of it: a near tie the two summation orders may break differently).
    std::vector<int32_t> seq = prompts[i];
    seq.insert(seq.end(), out[i].new_ids.begin(), out[i].new_ids.end() - 1);
    const int64_t T = static_cast<int64_t>(seq.size());
    std::vector<float> logits(static_cast<size_t>(T * V));
    model.logits(seq.data(), T, logits.data());
    for (size_t j = 0; j < out[i].new_ids.size(); ++j) {
      const float* row = logits.data() + (static_cast<int64_t>(prompts[i].size() + j) - 1) * V;
      const float best = *std::max_element(row, row + V);
      EXPECT_GE(row[out[i].new_ids[j]], best - 1e-4f) << "prompt " << i << " new id " << j;
      EXPECT_LE(out[i].logprobs[j], 0.0);
    }
  }
}

TEST(GPT2Runner, StopTokensAndTheContextEndTheSequence) {
  GPT2Config c = tiny();
  c.n_positions = 20;
  GPT2 model(random_gpt2(c, 7));
  std::mt19937_64 rng(8);
  const std::vector<int32_t> prompt = random_ids(15, c.vocab_size, rng);
  GenerateOptions g;
  g.max_new_tokens = 50;
  std::vector<Generation> out = model.generate({prompt}, g);
  EXPECT_EQ(out[0].new_ids.size(), 5u);  // 15 + 5 = n_positions
  EXPECT_EQ(out[0].finish_reason, "length");
  g.stop_tokens = {out[0].new_ids[2]};
  out = model.generate({prompt}, g);
  EXPECT_EQ(out[0].finish_reason, "stop");
  EXPECT_LE(out[0].new_ids.size(), 3u);
  EXPECT_EQ(out[0].new_ids.back(), g.stop_tokens[0]);
}

TEST(GPT2Runner, SeededSamplingIsReproducibleAcrossThreadCounts) {
  const GPT2Config c = tiny();
  std::mt19937_64 rng(9);
  const std::vector<std::vector<int32_t>> prompts = {random_ids(6, c.vocab_size, rng), random_ids(11, c.vocab_size, rng)};
  GenerateOptions g;
  g.max_new_tokens = 20;
  g.sampling.temperature = 1.0f, g.sampling.top_k = 40, g.sampling.top_p = 0.95f, g.sampling.seed = 1234;
  std::vector<std::vector<int32_t>> runs;
  for (int threads : {1, 2, 3}) {
    EngineOptions o;
    o.threads = threads;
    GPT2 model(random_gpt2(c, 10), o);
    for (const Generation& gen : model.generate(prompts, g)) runs.push_back(gen.new_ids);
  }
  EXPECT_EQ(runs[0], runs[2]);
  EXPECT_EQ(runs[1], runs[3]);
  EXPECT_EQ(runs[0], runs[4]);
  EXPECT_EQ(runs[1], runs[5]);
  EXPECT_NE(runs[0], runs[1]);
}

// RunOptions::batch_invariant through the whole model: a greedy request's ids and log-probabilities are the same bits
// generated alone on one thread as among seven others (prefill chunks and decode tokens sharing steps) on two.
TEST(GPT2Runner, BatchInvariantGenerationAloneEqualsInABatch) {
  const GPT2Config c = tiny();
  std::mt19937_64 rng(12);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {3, 40, 1, 17, 66, 8, 25, 2}) prompts.push_back(random_ids(n, c.vocab_size, rng));
  GenerateOptions g;
  g.max_new_tokens = 9, g.max_step_tokens = 48, g.logprobs = true, g.run.batch_invariant = true;
  EngineOptions two, one;
  two.threads = 2, one.threads = 1;
  GPT2 batched(random_gpt2(c, 13), two), single(random_gpt2(c, 13), one);
  const std::vector<Generation> together = batched.generate(prompts, g);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Generation alone = single.generate({prompts[i]}, g)[0];
    EXPECT_EQ(together[i].new_ids, alone.new_ids) << "prompt " << i;
    EXPECT_EQ(together[i].logprobs, alone.logprobs) << "prompt " << i;
  }
}

void expect_error(ErrorCode code, const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GPT2Runner, BadInputIsRefusedAndChangesNothing) {
  const GPT2Config c = tiny();
  GPT2 model(random_gpt2(c, 11));
  const int64_t V = c.vocab_size;
  KvCacheOptions k;
  k.capacity_tokens = 16;  // 4 blocks of 4 a layer
  k.block_tokens = 4;
  ModelKvCache cache = model.make_cache(k);
  const SequenceId a = cache.create(), b = cache.create();
  std::vector<int32_t> ids(20, 1);
  std::vector<float> logits(static_cast<size_t>(2 * V), -3.0f);
  const int64_t six = 6;
  model.step(cache, &a, &six, 1, ids.data(), logits.data());  // a holds 6 tokens: 2 blocks
  std::fill(logits.begin(), logits.end(), -3.0f);
  const std::vector<SequenceId> both = {a, b};
  const std::vector<int64_t> tokens = {2, 9};  // a needs 0 more blocks... b 3: one past the 2 left
  expect_error(ErrorCode::out_of_memory, [&] { model.step(cache, both.data(), tokens.data(), 2, ids.data(), logits.data()); },
               "KV blocks");
  ids[3] = static_cast<int32_t>(V);
  const std::vector<int64_t> small = {1, 3};
  expect_error(ErrorCode::invalid_argument,
               [&] { model.step(cache, both.data(), small.data(), 2, ids.data(), logits.data()); },
               "token id 97 at 3 is outside the vocabulary");
  ids[3] = 1;
  const int64_t past = c.n_positions;
  expect_error(ErrorCode::invalid_argument, [&] { model.step(cache, &a, &past, 1, ids.data(), logits.data()); },
               "past n_positions");
  EXPECT_EQ(cache.length(a), 6);
  EXPECT_EQ(cache.length(b), 0);
  EXPECT_EQ(logits, std::vector<float>(static_cast<size_t>(2 * V), -3.0f));

  GPT2Config other = c;
  other.n_layer = 2;
  ModelKvCache wrong(other.attention(), 2, k);
  const SequenceId w = wrong.create();
  const int64_t one = 1;
  expect_error(ErrorCode::invalid_argument, [&] { model.step(wrong, &w, &one, 1, ids.data(), logits.data()); },
               "make_cache");
  expect_error(ErrorCode::invalid_argument, [&] { model.generate({std::vector<int32_t>(80, 1)}, {}); },
               "n_positions - 1 = 79");
  expect_error(ErrorCode::invalid_argument, [&] { model.generate({{1, 2, -1}}, {}); }, "token id -1");
  std::vector<float> out(static_cast<size_t>(V));
  expect_error(ErrorCode::invalid_argument, [&] { model.logits(ids.data(), 0, out.data()); }, "T = 0");
}

}  // namespace
}  // namespace gpt2attn
