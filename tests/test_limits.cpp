// tests/test_limits.cpp: sizes and counts at the edges of what the library accepts: config bounds (context
// length, widths), overflow-checked byte counts, thread counts, buffers sized by the call rather than by the
// context, and allocation failures surfacing as Error(out_of_memory). Each case is a refusal with a message that
// names the problem, never a crash or a silent truncation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "engine/team.hpp"
#include "engine/workspace.hpp"
#include "gpt2attn/gpt2attn.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

Config small(int64_t context = 64) { return test::small_causal_config(context); }

// Runs f, expecting Error(code) whose message contains every one of `words`.
template <class F>
::testing::AssertionResult refused(F&& f, ErrorCode code, std::initializer_list<const char*> words) {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() != code) {
      return ::testing::AssertionFailure() << "code " << static_cast<int>(e.code()) << ": " << e.what();
    }
    for (const char* w : words) {
      if (std::string(e.what()).find(w) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks '" << w << "': " << e.what();
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "not a gpt2attn::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "accepted";
}

// Near INT64_MAX the layer's sizes wrapped (the causal row, the decode scratch) and forward wrote past its
// workspace; at 2^62 a std::vector length error escaped. Every size a config carries is bounded now.
TEST(Limits, ContextLengthIsBounded) {
  for (int64_t context : {kInt64Max, int64_t{1} << 62, kMaxContextLength + 1}) {
    Config c = small(context);
    EXPECT_TRUE(refused([&] { c.validate(); }, ErrorCode::invalid_argument, {"context_length", "16777216"}))
        << context;
    EXPECT_TRUE(refused([&] { MultiHeadAttention(c, Weights::random(small(), 1)); }, ErrorCode::invalid_argument,
                        {"context_length"}));
  }
  Config c = small(kMaxContextLength);
  EXPECT_NO_THROW(c.validate());
}

TEST(Limits, WidthsAreBounded) {
  for (auto field : {&Config::d_model, &Config::d_in, &Config::kdim, &Config::vdim, &Config::num_heads}) {
    Config c = small();
    c.*field = kInt64Max;
    EXPECT_TRUE(refused([&] { c.validate(); }, ErrorCode::invalid_argument, {"must be in"}));
    c.*field = kMaxWidth + 1;
    EXPECT_TRUE(refused([&] { c.validate(); }, ErrorCode::invalid_argument, {"1048576"}));
  }
  Config c = small();
  c.d_in = -1;
  EXPECT_TRUE(refused([&] { c.validate(); }, ErrorCode::invalid_argument, {"d_in", "-1"}));
}

// The registered causal mask and the kernel scratch are sized by the kernel's tiles and by the call, not by
// the context: a short query on a layer built for the longest context costs what a short query costs.
TEST(Limits, BuffersAreSizedByTheCallNotTheContext) {
  const Config c = small(kMaxContextLength);
  const Weights w = Weights::random(c, 2);
  MultiHeadAttention mha(c, w);
  const size_t at_max_context = mha.workspace_bytes(1, 5, 5);
  MultiHeadAttention short_ctx(small(8), w);
  EXPECT_EQ(at_max_context, short_ctx.workspace_bytes(1, 5, 5));
  EXPECT_LT(at_max_context, size_t{1} << 20);
  std::vector<float> x(5 * 16, 0.25f), y(5 * 16);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, 5, 16});
  Workspace ws;
  mha.forward(in, y.data(), {}, &ws);
  EXPECT_LT(ws.bytes(), size_t{1} << 20);
}

// A Workspace keeps the oneDNN primitives of the prefill shapes it ran, only the ExecContext::kKeptEntries most
// recently used besides the reserved ones (engine/linear.hpp): a server meeting a new prompt length on every call
// holds a bounded number of them (before, one set per length for good), and what it reserved stays however many
// other shapes pass. A length whose primitives were dropped, and one still held, give the same bits when they
// come back.
TEST(Limits, GemmPrimitivesPerWorkspaceAreBounded) {
  const Config c = small(512);
  MultiHeadAttention mha(c, Weights::random(c, 3));
  Workspace ws;
  mha.reserve(2, 400, 400, &ws);  // a shape the loop below never runs
  const size_t reserved = ws.impl().exec.reserved();
  ASSERT_GT(reserved, 0u);
  ASSERT_EQ(ws.impl().exec.entries(), reserved);
  RunOptions one_thread;
  one_thread.threads = 1;  // one projection entry per shape, whatever the machine's default
  const auto run = [&](int64_t T) {
    std::vector<float> x(static_cast<size_t>(T * c.d_model)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.125f - 0.75f;
    AttentionInputs in;
    in.query = TensorView::f32(x.data(), {1, T, c.d_model});
    mha.forward(in, y.data(), one_thread, &ws);
    return y;
  };
  const std::vector<float> at_1 = run(1);
  const int64_t lengths = 300;  // 2 entries a length (the per-head projections' and the output projection's)
  size_t most = 0;
  std::vector<float> at_last;
  for (int64_t T = 2; T <= lengths; ++T) {
    at_last = run(T);
    most = std::max(most, ws.impl().exec.entries());
  }
  const size_t kept = detail::ExecContext::kKeptEntries + reserved;
  ASSERT_GT(2 * lengths, static_cast<int64_t>(detail::ExecContext::kKeptEntries));  // so the bound is reached
  EXPECT_LE(most, kept + 2);  // trimmed at each call's start; the call adds its own
  EXPECT_GE(most, kept);
  EXPECT_EQ(ws.impl().exec.reserved(), reserved);  // none of the reserved shape's was dropped
  EXPECT_EQ(run(1), at_1);                         // dropped long ago, created again
  EXPECT_EQ(run(lengths), at_last);                // still held
  EXPECT_LE(ws.impl().exec.entries(), kept + 2);
}

// A server that calls forward() from its own OpenMP region, one Workspace per thread, each reserved beforehand
// outside it: the calls find every primitive reserve() prepared. Linear::run took the caller's thread number in
// that region for the output projection's slot, so thread 1 created a primitive (an allocation on the hot path)
// that reserve(), preparing slot 0, could not know of. The answers are the plain call's.
TEST(Limits, ReservedWorkspacesServeCallersInTheirOwnParallelRegion) {
  const Config c = small(64);
  MultiHeadAttention mha(c, Weights::random(c, 4));
  const int64_t B = 2, T = 9;
  std::vector<float> x(static_cast<size_t>(B * T * c.d_model)), expected(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) * 0.25f - 0.5f;
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, c.d_model});
  mha.forward(in, expected.data());
  constexpr int kCallers = 2;
  Workspace ws[kCallers];
  size_t reserved[kCallers];
  for (int k = 0; k < kCallers; ++k) {
    mha.reserve(B, T, T, &ws[k]);
    reserved[k] = ws[k].impl().exec.entries();
  }
  std::vector<float> got[kCallers];
  // The caller's region: an OpenMP team, as engine/team.hpp starts one (k = omp_get_thread_num() inside it).
  const int callers = detail::team_run(kCallers, [&](int k, int) {
    got[k].resize(x.size());
    mha.forward(in, got[k].data(), {}, &ws[k]);
  });
  for (int k = 0; k < callers; ++k) {
    EXPECT_EQ(ws[k].impl().exec.entries(), reserved[k]) << "caller thread " << k << " created a primitive";
    EXPECT_EQ(got[k], expected) << "caller thread " << k;
  }
  EXPECT_EQ(callers, kCallers) << "the region ran on fewer threads than asked";
}

// Weights::random validates its config before sizing anything: kv_width() of num_kv_heads = INT64_MAX overflowed
// int64 (undefined behaviour, which UBSan reports) before the layer that would have refused the config was built.
TEST(Limits, RandomWeightsRefuseAnInvalidConfigFirst) {
  Config c = small();
  c.num_kv_heads = kInt64Max;
  EXPECT_TRUE(refused([&] { Weights::random(c, 1); }, ErrorCode::invalid_argument, {"num_kv_heads"}));
}

// Byte counts are computed with overflow checks: a request too large to exist is refused before any allocation,
// as invalid_argument naming the size (no machine could satisfy it, so it is not the out_of_memory a server retries).
TEST(Limits, HugeCallsAreRefusedNotWrapped) {
  const Config c = small();
  CausalSelfAttention layer(c, Weights::random(c, 3));
  EXPECT_TRUE(refused([&] { layer.layer().workspace_bytes(kInt64Max / 4, 64, 64); }, ErrorCode::invalid_argument,
                      {"overflows", "no machine could hold it"}));
  EXPECT_TRUE(refused([&] { layer.layer().reserve(int64_t{1} << 40, 64, 64); }, ErrorCode::out_of_memory, {}));
  EXPECT_TRUE(refused([&] { layer.serving_workspace_bytes(0, kInt64Max / 2); }, ErrorCode::invalid_argument,
                      {"overflows"}));
  EXPECT_TRUE(refused([&] { layer.serving_workspace_bytes(0, kInt64Max); }, ErrorCode::invalid_argument,
                      {"overflows", std::to_string(kInt64Max).c_str()}));
  EXPECT_TRUE(refused([&] { layer.reserve_serving(0, kInt64Max); }, ErrorCode::invalid_argument, {"overflows"}));
  EXPECT_TRUE(refused([&] { layer.serving_workspace_bytes(65, 1); }, ErrorCode::invalid_argument,
                      {"max_extend_tokens", "context_length=64"}));
  EXPECT_TRUE(refused([&] { layer.layer().workspace_bytes(1, 65, 64); }, ErrorCode::invalid_argument,
                      {"context_length=64"}));
  EXPECT_TRUE(refused([&] { KvCache(c, KvCacheOptions{.block_tokens = 4, .capacity_tokens = kInt64Max}); },
                      ErrorCode::invalid_argument, {"capacity"}));
  EXPECT_TRUE(refused([&] { KvCache(c, KvCacheOptions{.block_tokens = 4, .capacity_bytes = SIZE_MAX}); },
                      ErrorCode::invalid_argument, {"capacity"}));
  // A batch no output could hold: B x T (or B x T x E) overflowing int64 wrapped the input's finiteness scan (which
  // was skipped, or read far past x); now it is refused before any element is read (x is never dereferenced).
  float x = 0.0f, y = 0.0f;
  for (const int64_t B : {int64_t{1} << 62, int64_t{1} << 60}) {
    EXPECT_TRUE(refused([&] { layer.forward(&x, B, 4, &y); }, ErrorCode::invalid_argument, {"overflows"})) << B;
  }
  EXPECT_TRUE(refused([&] { layer.forward(&x, kInt64Max, 4, &y); }, ErrorCode::invalid_argument,
                      {"overflows", std::to_string(kInt64Max).c_str()}));
  // Representable, but more than this machine has: out_of_memory, as before.
  EXPECT_TRUE(refused([&] { layer.forward(&x, int64_t{1} << 40, 4, &y); }, ErrorCode::out_of_memory,
                      {"the output (B, T, E)", "physical memory"}));
}

// Linux overcommits: a buffer larger than the machine's memory may be granted and the process OOM-killed when it
// is touched. Every buffer sized by a caller's request (the KV pool, a workspace, random weights) is refused first.
TEST(Limits, BuffersBeyondPhysicalMemoryAreRefused) {
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  ASSERT_GT(physical, 0);
  const Config c = small();
  EXPECT_TRUE(refused([&] { KvCache(c, KvCacheOptions{.capacity_bytes = static_cast<size_t>(physical) * 2}); },
                      ErrorCode::out_of_memory, {"KvCache", "physical memory"}));
  CausalSelfAttention layer(c, Weights::random(c, 3));
  // B sequences of 64 tokens: the Q/K/V buffers alone are 3 x B x 64 x 16 floats.
  const int64_t B = physical / (3 * 64 * 16 * 4) + 1;
  EXPECT_TRUE(refused([&] { layer.layer().reserve(B, 64, 64); }, ErrorCode::out_of_memory,
                      {"workspace", "physical memory"}));
  Config wide = small();
  wide.d_model = wide.d_in = wide.kdim = wide.vdim = 1 << 20;  // 4 x 2^40 floats
  EXPECT_TRUE(refused([&] { Weights::random(wide, 1); }, ErrorCode::out_of_memory, {"physical memory"}));
}

// libgomp overflows its stack starting a team of 100,000 threads, or exit()s when it cannot create one; a
// count beyond max_threads() is refused wherever a thread count enters.
TEST(Limits, ThreadCountsAreBounded) {
  ASSERT_GE(max_threads(), 1);
  ASSERT_LE(max_threads(), kMaxThreads);
  const Config c = small();
  const Weights w = Weights::random(c, 4);
  for (int threads : {100000, max_threads() + 1, -1}) {
    EXPECT_TRUE(refused([&] { CausalSelfAttention(c, w, EngineOptions{.threads = threads}); },
                        ErrorCode::invalid_argument, {"EngineOptions.threads", "max_threads"}))
        << threads;
    CausalSelfAttention layer(c, w);
    std::vector<float> x(16, 0.5f), y(16, -7.0f);
    RunOptions run;
    run.threads = threads;
    EXPECT_TRUE(refused([&] { layer.forward(x.data(), 1, 1, y.data(), run); }, ErrorCode::invalid_argument,
                        {"run.threads"}));
    EXPECT_EQ(y, std::vector<float>(16, -7.0f)) << "a refused call wrote its output";
    KvCache cache(c, KvCacheOptions{.capacity_tokens = 64});
    const SequenceId s = cache.create();
    EXPECT_TRUE(refused([&] { layer.extend(cache, s, x.data(), 1, y.data(), run); }, ErrorCode::invalid_argument,
                        {"extend", "threads"}));
    EXPECT_EQ(cache.length(s), 0);
    EXPECT_TRUE(refused([&] { layer.reserve_serving(1, 1, threads); }, ErrorCode::invalid_argument, {"threads"}));
  }
  EXPECT_NO_THROW(CausalSelfAttention(c, w, EngineOptions{.threads = max_threads()}));
}

// run_on_threads: f runs once on each thread of the team OpenMP grants, by index, and the team's size comes back;
// counts outside 1..max_threads() are refused before anything runs; f's exception reaches the caller.
TEST(Limits, RunOnThreadsRunsOncePerThreadOfTheTeam) {
  const int asked = std::min(4, max_threads());
  std::vector<int> runs(static_cast<size_t>(asked), 0);
  std::vector<int> teams(static_cast<size_t>(asked), -1);
  const int granted = run_on_threads(asked, [&](int t, int team) {
    ++runs[static_cast<size_t>(t)];
    teams[static_cast<size_t>(t)] = team;
  });
  ASSERT_GE(granted, 1);
  ASSERT_LE(granted, asked);
  for (int t = 0; t < asked; ++t) {
    EXPECT_EQ(runs[static_cast<size_t>(t)], t < granted ? 1 : 0) << t;
    if (t < granted) {
      EXPECT_EQ(teams[static_cast<size_t>(t)], granted) << t;
    }
  }
  bool ran = false;
  for (int threads : {0, -1, max_threads() + 1}) {
    EXPECT_TRUE(refused([&] { run_on_threads(threads, [&](int, int) { ran = true; }); },
                        ErrorCode::invalid_argument, {"run_on_threads", "threads"}))
        << threads;
  }
  EXPECT_FALSE(ran);
  EXPECT_THROW(run_on_threads(asked, [](int t, int) {
                 if (t == 0) throw Error(ErrorCode::internal, "thread 0");
               }),
               Error);
}

}  // namespace
}  // namespace gpt2attn
