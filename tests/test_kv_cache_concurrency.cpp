// tests/test_kv_cache_concurrency.cpp: concurrent callers of one layer and one KV pool (decode, extend and the ragged
// step, over forks of one parent too) give bit-identical results to the same work run sequentially, on every
// instruction set this CPU runs; scripts/tsan.sh runs this suite (KvCacheConcurrency) under ThreadSanitizer. Beyond a
// few sequences against the reference it checks no numerics.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::Dtype;
using test::IsaTest;
using test::kNaN;
using test::label;
using test::make_block;
using test::serving_config;
using test::pool;
using test::random_uniform;
using test::reduction_length;
using test::reference_sequence;

// =============================================================================================================
// Concurrency: 4 caller threads on one shared layer and pool, each with its own sequences (and its own
// Workspace, or none: the layer's own, serialised), give bit-identical results to the same work run
// sequentially. Each thread also forks and releases a scratch sequence off its own, so the pool's shared
// bookkeeping and copy on write race with the others' appends; and threads append to forks of one parent, whose
// shared blocks they copy at once. Each call runs on a team of 2 (engine/team.hpp), so the callers' teams run at
// once too. Run under ThreadSanitizer by scripts/tsan.sh.

class KvCacheConcurrency : public IsaTest {};

constexpr int kThreads = 4, kSteps = 20;

struct ThreadWork {
  int64_t T[2];
  std::vector<float> prefill[2];  // (T[s], d_in)
  std::vector<float> steps;       // (kSteps, 2, d_in)
  std::vector<float> scratch;     // (kSteps, d_in): tokens for the forked scratch sequences
};

ThreadWork make_work(int t, int64_t W) {
  ThreadWork k;
  std::mt19937_64 rng(200 + t);
  k.T[0] = 17 + 9 * t;
  k.T[1] = 40 - 5 * t;
  for (int s = 0; s < 2; ++s) k.prefill[s] = random_uniform(static_cast<size_t>(k.T[s] * W), rng, -2.0f, 2.0f);
  k.steps = random_uniform(static_cast<size_t>(kSteps * 2 * W), rng, -2.0f, 2.0f);
  k.scratch = random_uniform(static_cast<size_t>(kSteps * W), rng, -2.0f, 2.0f);
  return k;
}

// Runs body(t, ws) on kThreads threads released together, each with a Workspace of its own; returns what each threw
// ("" where nothing).
std::vector<std::string> run_together(const std::function<void(int, Workspace&)>& body) {
  std::vector<std::string> errors(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Workspace ws;
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      try {
        body(t, ws);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  return errors;
}

// One thread's work; returns the outputs of its two sequences, prefill rows then decode rows.
std::vector<float> run_work(CausalSelfAttention& block, KvCache& cache, const ThreadWork& k, Workspace* ws) {
  const int64_t W = block.config().query_width(), E = block.config().d_model;
  const RunOptions run{.threads = 2};
  std::vector<float> result;
  SequenceId ids[2] = {cache.create(), cache.create()};
  for (int s = 0; s < 2; ++s) {
    std::vector<float> out(static_cast<size_t>(k.T[s] * E), kNaN);
    block.extend(cache, ids[s], k.prefill[s].data(), k.T[s], out.data(), run, ws);
    result.insert(result.end(), out.begin(), out.end());
  }
  std::vector<float> out(static_cast<size_t>(2 * E), kNaN), scratch_out(static_cast<size_t>(E));
  for (int step = 0; step < kSteps; ++step) {
    block.decode(cache, ids, 2, k.steps.data() + step * 2 * W, out.data(), run, ws);
    result.insert(result.end(), out.begin(), out.end());
    if (step % 4 == 1) {  // a scratch fork appends into (a copy of) the shared last block, then goes away
      const SequenceId f = cache.fork(ids[step % 2]);
      block.decode(cache, &f, 1, k.scratch.data() + step * W, scratch_out.data(), run, ws);
      cache.release(f);
    }
  }
  cache.release(ids[0]);
  cache.release(ids[1]);
  return result;
}

// `kv`: the cache's storage dtype. The concurrent run must equal the sequential one bit for bit whatever it is; the
// sequential result is checked against the f32 reference for an f32 cache (test_kv_cache_storage.cpp checks the
// other formats' outputs against the K/V they hold).
void concurrent_matches_sequential(Isa isa, bool own_workspaces, DType kv = DType::f32) {
  KvCacheOptions opts = pool(16, 1024);
  opts.dtype = kv;
  const Config c = serving_config(64, 4, 48, 128);
  const Weights w = Weights::random(c, 210);
  CausalSelfAttention block = make_block(c, w, isa, 1);
  const int64_t W = block.config().query_width();
  std::vector<ThreadWork> work;
  for (int t = 0; t < kThreads; ++t) work.push_back(make_work(t, W));

  // Sequential: the same work, one thread after the other, on a fresh pool of the same size.
  std::vector<std::vector<float>> want(kThreads);
  {
    KvCache cache(block.config(), opts);
    Workspace ws;
    for (int t = 0; t < kThreads; ++t) want[t] = run_work(block, cache, work[t], own_workspaces ? &ws : nullptr);
    ASSERT_EQ(cache.free_blocks(), cache.total_blocks());
  }
  // Concurrent: all threads released together.
  KvCache cache(block.config(), opts);
  std::vector<std::vector<float>> got(kThreads);
  const std::vector<std::string> errors = run_together(
      [&](int t, Workspace& ws) { got[t] = run_work(block, cache, work[t], own_workspaces ? &ws : nullptr); });
  const std::string ctx = label(isa, 2, std::string(own_workspaces ? "4 threads, own Workspaces" : "4 threads, no Workspace") +
                                            ", " + to_string(kv) + " cache");
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << ctx << ": thread " << t << " threw: " << errors[t];
    ASSERT_EQ(got[t].size(), want[t].size()) << ctx << ": thread " << t;
    for (size_t i = 0; i < got[t].size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[t][i], &want[t][i], sizeof(float)), 0)
          << ctx << ": thread " << t << " output [" << i << "] (prefill rows, then (step, slot, e)): concurrent "
          << got[t][i] << " sequential " << want[t][i];
    }
  }
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks()) << ctx;
  EXPECT_EQ(cache.num_sequences(), 0) << ctx;
  if (kv != DType::f32) return;

  // And the sequential results are right: thread 0's first sequence against the reference.
  const ThreadWork& k = work[0];
  std::vector<float> x = k.prefill[0];
  const int64_t E = block.config().d_model;
  std::vector<float> out0(want[0].begin(), want[0].begin() + k.T[0] * E);
  const int64_t decode_base = (k.T[0] + k.T[1]) * E;
  for (int step = 0; step < kSteps; ++step) {
    x.insert(x.end(), k.steps.begin() + step * 2 * W, k.steps.begin() + step * 2 * W + W);
    out0.insert(out0.end(), want[0].begin() + decode_base + step * 2 * E,
                want[0].begin() + decode_base + step * 2 * E + E);
  }
  EXPECT_TRUE(all_close(out0, reference_sequence(block.config(), w, x), Dtype::f32,
                        reduction_length(block.config(), k.T[0] + kSteps),
                        ctx + " | thread 0 sequence 0 vs reference; index token*E+e"));
}

// Forks of one parent, appended to by 4 threads at once: the parent's owner decodes it while each other thread
// decodes its own fork and then releases it. All four hold the parent's partly filled last block, so every first
// append copies it while the others still hold it (or have just let go), and the releases race the others' copies.
// The results must equal the same work run sequentially, bit for bit, and every block must come back to the pool.
void shared_parent_matches_sequential(Isa isa, DType kv) {
  KvCacheOptions opts = pool(16, 1024);
  opts.dtype = kv;
  const Config c = serving_config(64, 4, 48, 128);
  CausalSelfAttention block = make_block(c, Weights::random(c, 220), isa, 1);
  const int64_t W = block.config().query_width(), E = block.config().d_model, T0 = 37;  // 16 + 16 + 5 tokens
  std::mt19937_64 rng(221);
  const std::vector<float> prompt = random_uniform(static_cast<size_t>(T0 * W), rng, -2.0f, 2.0f);
  std::vector<std::vector<float>> tokens(kThreads);
  for (auto& t : tokens) t = random_uniform(static_cast<size_t>(kSteps * W), rng, -2.0f, 2.0f);
  const RunOptions run{.threads = 2};

  // The parent and its forks, made before any thread starts (a sequence being appended to cannot be forked).
  const auto set_up = [&](KvCache& cache) {
    std::vector<SequenceId> ids{cache.create()};
    std::vector<float> out(static_cast<size_t>(T0 * E));
    block.extend(cache, ids[0], prompt.data(), T0, out.data(), run, nullptr);
    for (int t = 1; t < kThreads; ++t) ids.push_back(cache.fork(ids[0]));
    return ids;
  };
  // Thread t's work: kSteps decode steps of its sequence; the forks' threads then release theirs.
  const auto work = [&](KvCache& cache, SequenceId id, int t, Workspace& ws) {
    std::vector<float> result(static_cast<size_t>(kSteps * E), kNaN);
    for (int step = 0; step < kSteps; ++step) {
      block.decode(cache, &id, 1, tokens[t].data() + step * W, result.data() + step * E, run, &ws);
    }
    if (t > 0) cache.release(id);
    return result;
  };

  std::vector<std::vector<float>> want(kThreads), got(kThreads);
  {
    KvCache cache(block.config(), opts);
    const std::vector<SequenceId> ids = set_up(cache);
    Workspace ws;
    for (int t = 0; t < kThreads; ++t) want[t] = work(cache, ids[static_cast<size_t>(t)], t, ws);
  }
  KvCache cache(block.config(), opts);
  const std::vector<SequenceId> ids = set_up(cache);
  const std::vector<std::string> errors =
      run_together([&](int t, Workspace& ws) { got[t] = work(cache, ids[static_cast<size_t>(t)], t, ws); });
  const std::string ctx = label(isa, 2, "4 threads on one parent and its forks, " + std::string(to_string(kv)) + " cache");
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << ctx << ": thread " << t << " threw: " << errors[t];
    ASSERT_EQ(std::memcmp(got[t].data(), want[t].data(), got[t].size() * sizeof(float)), 0)
        << ctx << ": thread " << t << "'s outputs differ from the sequential run";
  }
  EXPECT_EQ(cache.length(ids[0]), T0 + kSteps) << ctx;
  EXPECT_EQ(cache.num_sequences(), 1) << ctx;
  cache.release(ids[0]);
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks()) << ctx << ": a block was lost or freed twice";
}

// =============================================================================================================
// Ragged steps (CausalSelfAttention::step) on 4 threads over one pool: each thread steps three sequences of its own
// for four rounds, one of them shared: thread 0 steps a parent and threads 1-3 its forks, made before the threads
// start over the parent's partly filled last block, so their first steps copy it on write while the others still hold
// it. The rounds' mixes rotate between the threads, so at any moment they run different paths of the step at once:
// projections on the few-row kernel (<= 64 tokens) and on oneDNN GEMMs (> 64), entries of 2-32 tokens on the decode
// kernel (split-KV) and of 33-80 on the tiled kernel. The results must equal the same work run sequentially, bit for
// bit, and every block must come back to the pool.

constexpr int kSlots = 3, kRounds = 4;
constexpr int64_t kParentTokens = 37;  // 16 + 16 + 5: the forks share a partly filled last block

// A mix of kSlots entries' token counts. kind 0: decode kernel, few-row projections (sum <= 49); 1: tiled and decode
// kernel, few-row projections (sum <= 59); 2: tiled and decode kernel, oneDNN (sum >= 72); 3: decode kernel only,
// oneDNN (sum >= 65).
std::vector<int64_t> step_mix(int kind, std::mt19937_64& rng) {
  const auto between = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  switch (kind) {
    case 0: return {1, between(2, 16), between(17, 32)};
    case 1: return {between(33, 50), between(2, 8), 1};
    case 2: return {between(50, 80), between(20, 32), between(2, 10)};
    default: return {between(24, 32), between(24, 32), between(17, 32)};
  }
}

struct StepWork {
  int64_t prompt[kSlots] = {0, 0, 0};            // tokens extended into the thread's own slots 1, 2 first
  int64_t counts[kRounds][kSlots] = {};          // new tokens of each slot in each round
  int order[kRounds][kSlots] = {};               // each round's entries: slots in this order
  std::vector<float> x[kSlots];                  // every token each slot is fed, prompt first: (tokens, d_in)
};

StepWork make_step_work(int t, int64_t W) {
  StepWork k;
  std::mt19937_64 rng(300 + t);
  k.prompt[1] = 5 + 11 * t;  // 5..38: block boundaries in different places
  k.prompt[2] = 30 - 7 * t;
  for (int r = 0; r < kRounds; ++r) {
    const std::vector<int64_t> mix = step_mix((r + t) % 4, rng);
    int perm[kSlots] = {0, 1, 2};
    std::shuffle(perm, perm + kSlots, rng);
    for (int e = 0; e < kSlots; ++e) {
      k.order[r][e] = perm[e];
      k.counts[r][perm[e]] = mix[static_cast<size_t>(e)];
    }
  }
  for (int s = 0; s < kSlots; ++s) {
    int64_t total = k.prompt[s];
    for (int r = 0; r < kRounds; ++r) total += k.counts[r][s];
    k.x[s] = random_uniform(static_cast<size_t>(total * W), rng, -2.0f, 2.0f);
  }
  return k;
}

// One thread's work: `shared` (the parent or a fork of it) in slot 0, two sequences of its own created and
// prompted here; kRounds steps; then its own sequences and, with `release_shared`, the shared one released. Returns
// each slot's outputs in order (slot 0: those of its steps only).
std::vector<std::vector<float>> run_step_work(CausalSelfAttention& block, KvCache& cache, const StepWork& k,
                                              SequenceId shared, bool release_shared, Workspace* ws) {
  const int64_t W = block.config().query_width(), E = block.config().d_model;
  const RunOptions run{.threads = 2};
  std::vector<std::vector<float>> result(kSlots);
  const SequenceId ids[kSlots] = {shared, cache.create(), cache.create()};
  int64_t fed[kSlots] = {};  // tokens of k.x[s] fed so far
  for (int s = 1; s < kSlots; ++s) {
    result[s].assign(static_cast<size_t>(k.prompt[s] * E), kNaN);
    block.extend(cache, ids[s], k.x[s].data(), k.prompt[s], result[s].data(), run, ws);
    fed[s] = k.prompt[s];
  }
  for (int r = 0; r < kRounds; ++r) {
    SequenceId seqs[kSlots];
    int64_t tokens[kSlots], M = 0;
    std::vector<float> x;
    for (int e = 0; e < kSlots; ++e) {
      const int s = k.order[r][e];
      seqs[e] = ids[s];
      tokens[e] = k.counts[r][s];
      x.insert(x.end(), k.x[s].begin() + fed[s] * W, k.x[s].begin() + (fed[s] + tokens[e]) * W);
      fed[s] += tokens[e];
      M += tokens[e];
    }
    std::vector<float> out(static_cast<size_t>(M * E), kNaN);
    block.step(cache, seqs, tokens, kSlots, x.data(), out.data(), run, ws);
    int64_t row = 0;
    for (int e = 0; e < kSlots; ++e) {
      std::vector<float>& dst = result[k.order[r][e]];
      dst.insert(dst.end(), out.begin() + row * E, out.begin() + (row + tokens[e]) * E);
      row += tokens[e];
    }
  }
  cache.release(ids[1]);
  cache.release(ids[2]);
  if (release_shared) cache.release(ids[0]);
  return result;
}

void concurrent_steps_match_sequential(Isa isa, DType kv) {
  KvCacheOptions opts = pool(16, 8192);  // room for every sequence's longest draw
  opts.dtype = kv;
  const Config c = serving_config(64, 4, 48, 512);
  const Weights w = Weights::random(c, 230);
  CausalSelfAttention block = make_block(c, w, isa, 1);
  const int64_t W = block.config().query_width(), E = block.config().d_model;
  std::mt19937_64 rng(231);
  const std::vector<float> prompt = random_uniform(static_cast<size_t>(kParentTokens * W), rng, -2.0f, 2.0f);
  std::vector<StepWork> work;
  for (int t = 0; t < kThreads; ++t) work.push_back(make_step_work(t, W));
  const RunOptions run{.threads = 2};

  // The parent (thread 0's slot 0) and a fork of it for each other thread, made before any thread starts.
  std::vector<float> prompt_out(static_cast<size_t>(kParentTokens * E), kNaN);
  const auto set_up = [&](KvCache& cache) {
    std::vector<SequenceId> ids{cache.create()};
    block.extend(cache, ids[0], prompt.data(), kParentTokens, prompt_out.data(), run, nullptr);
    for (int t = 1; t < kThreads; ++t) ids.push_back(cache.fork(ids[0]));
    return ids;
  };

  std::vector<std::vector<std::vector<float>>> want(kThreads), got(kThreads);
  {
    KvCache cache(block.config(), opts);
    const std::vector<SequenceId> ids = set_up(cache);
    Workspace ws;
    for (int t = 0; t < kThreads; ++t) {
      want[t] = run_step_work(block, cache, work[t], ids[static_cast<size_t>(t)], t > 0, &ws);
    }
    cache.release(ids[0]);
    ASSERT_EQ(cache.free_blocks(), cache.total_blocks());
  }
  KvCache cache(block.config(), opts);
  const std::vector<SequenceId> ids = set_up(cache);
  const std::vector<std::string> errors = run_together([&](int t, Workspace& ws) {
    got[t] = run_step_work(block, cache, work[t], ids[static_cast<size_t>(t)], t > 0, &ws);
  });
  const std::string ctx = label(isa, 2, "4 threads stepping ragged mixes, one parent and its forks, " +
                                            std::string(to_string(kv)) + " cache");
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << ctx << ": thread " << t << " threw: " << errors[t];
    for (int s = 0; s < kSlots; ++s) {
      ASSERT_EQ(got[t][s].size(), want[t][s].size()) << ctx << ": thread " << t << " slot " << s;
      for (size_t i = 0; i < got[t][s].size(); ++i) {
        ASSERT_EQ(std::memcmp(&got[t][s][i], &want[t][s][i], sizeof(float)), 0)
            << ctx << ": thread " << t << " slot " << s << " output [" << i << "] (token * E + e): concurrent "
            << got[t][s][i] << " sequential " << want[t][s][i];
      }
    }
  }
  int64_t parent_tokens = kParentTokens;
  for (int r = 0; r < kRounds; ++r) parent_tokens += work[0].counts[r][0];
  EXPECT_EQ(cache.length(ids[0]), parent_tokens) << ctx;
  EXPECT_EQ(cache.num_sequences(), 1) << ctx;
  cache.release(ids[0]);
  EXPECT_EQ(cache.free_blocks(), cache.total_blocks()) << ctx << ": a block was lost or freed twice";
  if (kv != DType::f32) return;

  // And the sequential results are right: the parent, thread 1's fork and thread 0's own sequences against the
  // reference over their histories.
  const auto check = [&](int t, int s) {
    std::vector<float> x = work[t].x[s], out = want[t][s];
    if (s == 0) {
      x.insert(x.begin(), prompt.begin(), prompt.end());
      out.insert(out.begin(), prompt_out.begin(), prompt_out.end());
    }
    const int64_t N = static_cast<int64_t>(x.size()) / W;
    EXPECT_TRUE(all_close(out, reference_sequence(block.config(), w, x), Dtype::f32,
                          reduction_length(block.config(), N),
                          ctx + " | thread " + std::to_string(t) + " slot " + std::to_string(s) +
                              " vs reference; index token*E+e"));
  };
  check(0, 0);
  check(1, 0);
  check(0, 1);
  check(0, 2);
}

TEST_P(KvCacheConcurrency, ThreadsWithOwnWorkspacesMatchSequential) { concurrent_matches_sequential(isa(), true); }
TEST_P(KvCacheConcurrency, ForksOfOneParentAppendedConcurrentlyMatchSequential) {
  shared_parent_matches_sequential(isa(), DType::f32);
}
TEST_P(KvCacheConcurrency, ForksOfOneInt8ParentAppendedConcurrentlyMatchSequential) {
  shared_parent_matches_sequential(isa(), DType::i8);
}
TEST_P(KvCacheConcurrency, ThreadsSharingLayerWorkspaceMatchSequential) {
  concurrent_matches_sequential(isa(), false);
}
TEST_P(KvCacheConcurrency, ThreadsOnOneInt8CacheMatchSequential) { concurrent_matches_sequential(isa(), true, DType::i8); }
TEST_P(KvCacheConcurrency, ThreadsSteppingRaggedMixesMatchSequential) {
  concurrent_steps_match_sequential(isa(), DType::f32);
}
TEST_P(KvCacheConcurrency, ThreadsSteppingOnOneInt8CacheMatchSequential) {
  concurrent_steps_match_sequential(isa(), DType::i8);
}
GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheConcurrency);

}  // namespace
}  // namespace gpt2attn
