// tests/test_kv_step.cpp: CausalSelfAttention::step, continuous batching's ragged step, against the naive reference
// over each sequence's whole history: random mixes of decode tokens, drafts to verify and prompt chunks over cached
// lengths from 0 to the context, with forks sharing blocks and rejected drafts truncated between steps; every K/V
// format, both compute types, multi-head, grouped and multi-query, 1 and 2 threads, every instruction set this CPU
// runs. Then the step's refusals, each leaving every sequence and `out` as they were. The pool's books under random
// steps are the soak's (test_kv_soak.cpp), concurrent steps KvCacheConcurrency's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::Harness;
using test::IsaTest;
using test::kSentinel;
using test::Rng;

struct StepConfig {
  const char* name;
  Config cfg;
  int64_t block_tokens;
};

std::vector<StepConfig> step_configs() {
  Config mha = test::serving_config(64, 2, 0, 1100);  // D = 32; context past 1030-token chunks over a cache
  Config gqa = test::serving_config(96, 6, 40, 300);  // D = 16, 3 K/V heads, d_in 40
  gqa.num_kv_heads = 3;
  Config mqa = test::serving_config(64, 4, 0, 200, true, false);  // D = 16, 1 K/V head, no output bias
  mqa.num_kv_heads = 1;
  return {{"multi-head, 16-token blocks", mha, 16}, {"grouped 6/3 heads, 7-token blocks", gqa, 7},
          {"multi-query 4/1 heads, 64-token blocks", mqa, 64}};
}

// A token count as a server's step draws them: a decode token, a draft of 2-16, a chunk of 17-80 (to 32 on the decode
// kernel, kStepDecodeTokens, beyond on the tiled one), now and then a long prompt chunk (up to 1030 where the context
// allows); at most `room` (what the sequence's context leaves).
int64_t draw_tokens(Rng& r, int64_t room) {
  const int64_t u = r.between(0, 99);
  const int64_t n = u < 35 ? 1 : u < 65 ? r.between(2, 16) : u < 93 ? r.between(17, 80) : r.between(81, 1030);
  return std::clamp<int64_t>(n, 1, room);
}

class KvStep : public IsaTest {};

// Per (config, compute type, K/V format, threads): six sequences with prompts of 0-200 tokens (one a fork of
// another, so the step copies a shared block on write), then five steps over random subsets in random order, each
// followed by a truncate of 1-4 tokens of one sequence (a rejected draft); at the end every sequence's every output
// against the reference over its history.
TEST_P(KvStep, RandomMixesMatchTheReference) {
  uint64_t seed = 100;
  int64_t long_chunks = 0, drafts = 0;
  for (const StepConfig& sc : step_configs()) {
    for (DType compute : {DType::f32, DType::bf16}) {
      for (DType kv : test::kv_formats()) {
        for (int threads : {1, 2}) {
          ++seed;
          Harness h(sc.cfg, isa(), sc.block_tokens, 8 * sc.cfg.context_length, seed, threads, compute, kv);
          Rng r(seed * 7);
          const int64_t C = h.cfg.context_length;
          std::vector<SequenceId> ids;
          for (int i = 0; i < 5; ++i) {
            ids.push_back(h.create());
            if (const int64_t T = r.between(0, std::min<int64_t>(200, C - 40)); T > 0) h.extend(ids.back(), T);
          }
          ids.push_back(h.fork(ids[0]));
          for (int s = 0; s < 5; ++s) {
            std::vector<std::pair<SequenceId, int64_t>> entries;  // (sequence, new tokens), in random order
            for (SequenceId id : ids) {
              const int64_t room = C - h.model.len.at(id);
              if (room > 0 && (entries.empty() || r.chance(0.7))) entries.emplace_back(id, draw_tokens(r, room));
            }
            if (entries.empty()) break;
            std::shuffle(entries.begin(), entries.end(), r.g);
            std::vector<SequenceId> pick;
            std::vector<int64_t> n;
            for (const auto& [id, t] : entries) pick.push_back(id), n.push_back(t);
            h.step(pick, n);
            for (int64_t t : n) {
              long_chunks += t > 80;
              drafts += t > 1 && t <= 16;
            }
            const SequenceId victim = pick[static_cast<size_t>(r.between(0, static_cast<int64_t>(pick.size()) - 1))];
            h.truncate(victim, std::max<int64_t>(0, h.model.len.at(victim) - r.between(1, 4)));
          }
          for (SequenceId id : ids) {
            ASSERT_TRUE(h.matches_reference(id, sc.name)) << "seed " << seed;
            ASSERT_TRUE(h.accounting(h.ctx(sc.name))) << "seed " << seed;
          }
        }
      }
    }
  }
  EXPECT_GT(long_chunks, 0) << "no step held a chunk longer than 80 tokens";
  EXPECT_GT(drafts, 10) << "few steps held drafts of 2-16 tokens";
}

// Wide steps: 64 entries a step (every sequence of a busy server at once), tokens drawn as draw_tokens draws them but
// capped at 40, over cached lengths 0-150, K/V in f32 and int8, grouped heads, 2 threads.
TEST_P(KvStep, SixtyFourEntriesMatchTheReference) {
  Config c = test::serving_config(64, 4, 0, 300);  // D = 16
  c.num_kv_heads = 2;
  for (DType kv : {DType::f32, DType::i8}) {
    Harness h(c, isa(), 16, 64 * 320, 11, 2, DType::f32, kv);
    Rng r(5);
    std::vector<SequenceId> ids;
    for (int i = 0; i < 64; ++i) {
      ids.push_back(h.create());
      if (const int64_t T = r.between(0, 150); T > 0) h.extend(ids.back(), T);
    }
    for (int s = 0; s < 3; ++s) {
      std::shuffle(ids.begin(), ids.end(), r.g);
      std::vector<int64_t> n;
      for (size_t i = 0; i < ids.size(); ++i) n.push_back(std::min<int64_t>(40, draw_tokens(r, 40)));
      h.step(ids, n);
    }
    for (SequenceId id : ids) ASSERT_TRUE(h.matches_reference(id, std::string("64 entries, kv ") + to_string(kv)));
  }
}

// The call's refusals: each names the problem and leaves every sequence, the pool and `out` as they were.
TEST_P(KvStep, BadStepsChangeNothing) {
  Config c = test::serving_config(32, 2, 0, 64);
  Harness h(c, isa(), 8, 10 * 8, 7, 2);
  const SequenceId a = h.create(), b = h.create(), gone = h.create();
  h.extend(a, 20);
  h.extend(b, 5);
  h.release(gone);
  const auto refused = [&](const std::string& what, std::vector<SequenceId> ids, std::vector<int64_t> n,
                           ErrorCode code, const std::string& says) {
    int64_t M = 0;
    for (int64_t t : n) M += std::max<int64_t>(t, 0);
    const std::vector<float> x(static_cast<size_t>(std::max<int64_t>(M, 1) * h.W()), 0.5f);
    std::vector<float> out(static_cast<size_t>(std::max<int64_t>(M, 1) * h.E()), kSentinel);
    const test::CacheSnapshot before = test::snapshot(h.cache, h.live());
    try {
      h.block.step(h.cache, ids.data(), n.data(), static_cast<int64_t>(ids.size()), x.data(), out.data(), h.run());
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_TRUE(test::same_snapshot(before, test::snapshot(h.cache, h.live()))) << what;
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; })) << what << ": out written";
  };
  refused("an entry of 0 tokens", {a, b}, {3, 0}, ErrorCode::invalid_argument, "entry 1 (sequence");
  refused("an entry of -2 tokens", {a, b}, {-2, 1}, ErrorCode::invalid_argument, "tokens=-2");
  refused("the same sequence twice", {a, b, a}, {2, 1, 3}, ErrorCode::invalid_argument, "appears twice");
  refused("a step past the context", {b, a}, {3, 45}, ErrorCode::invalid_argument, "exceeds context_length");
  refused("a released sequence", {a, gone}, {2, 2}, ErrorCode::invalid_argument, std::to_string(gone));
  refused("more blocks than are free", {a, b}, {40, 30}, ErrorCode::out_of_memory, "KV pool exhausted");
  refused("no entries", {}, {}, ErrorCode::invalid_argument, "n (entries) must be >= 1");
  const std::vector<float> x(static_cast<size_t>(4 * h.W()), 0.5f);
  std::vector<float> out(static_cast<size_t>(4 * h.E()));
  const SequenceId ids[2] = {a, b};
  const int64_t n[2] = {3, 1};
  EXPECT_THROW(h.block.step(h.cache, nullptr, n, 2, x.data(), out.data()), Error);
  EXPECT_THROW(h.block.step(h.cache, ids, nullptr, 2, x.data(), out.data()), Error);
  EXPECT_THROW(h.block.step(h.cache, ids, n, 2, nullptr, out.data()), Error);
  EXPECT_THROW(h.block.step(h.cache, ids, n, 2, x.data(), nullptr), Error);
  std::vector<float> bad = x;
  bad[static_cast<size_t>(2 * h.W() + 3)] = std::numeric_limits<float>::quiet_NaN();
  const test::CacheSnapshot before = test::snapshot(h.cache, h.live());
  EXPECT_THROW(h.block.step(h.cache, ids, n, 2, bad.data(), out.data(), h.run()), Error);
  EXPECT_TRUE(test::same_snapshot(before, test::snapshot(h.cache, h.live()))) << "a NaN token";
  EXPECT_TRUE(h.matches_reference(a, "after the refusals"));
  EXPECT_TRUE(h.matches_reference(b, "after the refusals"));
}

// reserve_step then steps of that size: the workspace does not grow (its bytes() stays what reserve_step made it).
TEST_P(KvStep, ReservedStepsKeepTheirWorkspace) {
  Config c = test::serving_config(64, 4, 0, 512);
  for (DType compute : {DType::f32, DType::bf16}) {
    Harness h(c, isa(), 16, 8 * 512, 9, 2, compute);
    Workspace ws;
    h.block.reserve_step(200, 8, 2, &ws);
    const size_t bytes = ws.bytes();
    EXPECT_EQ(bytes, h.block.step_workspace_bytes(200, 8, 2));
    std::vector<SequenceId> ids;
    for (int i = 0; i < 8; ++i) ids.push_back(h.create());
    Rng r(3);
    for (int s = 0; s < 6; ++s) {
      std::vector<int64_t> n;
      int64_t left = 200;
      for (size_t i = 0; i < ids.size(); ++i) {
        n.push_back(std::min<int64_t>(left - static_cast<int64_t>(ids.size() - i - 1), s % 2 ? r.between(1, 16)
                                                                                           : r.between(1, 120)));
        left -= n.back();
      }
      int64_t M = 0;
      for (int64_t t : n) M += t;
      const std::vector<float> x(static_cast<size_t>(M * h.W()), 0.25f);
      std::vector<float> out(static_cast<size_t>(M * h.E()));
      h.block.step(h.cache, ids.data(), n.data(), static_cast<int64_t>(ids.size()), x.data(), out.data(), h.run(), &ws);
      EXPECT_EQ(ws.bytes(), bytes) << "step " << s << " of " << M << " tokens grew the reserved workspace";
    }
  }
  Harness h(c, isa(), 16, 512, 9, 1);
  EXPECT_THROW(h.block.reserve_step(0, 1), Error);
  EXPECT_THROW(h.block.reserve_step(4, 5), Error);
  EXPECT_THROW(h.block.step_workspace_bytes(INT64_MAX, 1), Error);
}

GPT2ATTN_INSTANTIATE_ISAS(KvStep, KvStep);

}  // namespace
}  // namespace gpt2attn
