// ModelKvCache: one id per sequence over a KvCache per layer. Its layers run real CausalSelfAttention calls, so
// a wrong id map shows as a wrong output or an error, not only as a wrong count.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/model_kv_cache.hpp"

namespace gpt2attn {
namespace {

constexpr int64_t kE = 32;  // d_model; d_in = E, so a layer's output is the next layer's input

Config small_config() {
  Config c;
  c.d_model = kE;
  c.num_heads = 4;
  c.context_length = 64;
  c.causal = true;
  return c;
}

KvCacheOptions tokens_options(int64_t capacity_tokens) {
  KvCacheOptions o;
  o.block_tokens = 4;
  o.capacity_tokens = capacity_tokens;
  return o;
}

std::vector<float> random_rows(int64_t rows, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * kE));
  for (float& x : v) x = u(g);
  return v;
}

// A stack of layers as a model runs them: layer l reads layer l-1's output.
struct Stack {
  std::vector<CausalSelfAttention> layers;
  explicit Stack(int64_t n) {
    EngineOptions one_thread;  // layers this small gain nothing from a team, and the test machines are shared
    one_thread.threads = 1;
    for (int64_t l = 0; l < n; ++l) {
      layers.emplace_back(small_config(), Weights::random(small_config(), 100 + l), one_thread);
    }
  }
  // One step() of the model, with each layer's cache and ids given by `at(l)` -> {KvCache&, const SequenceId*}.
  template <class At>
  std::vector<float> step(At at, const std::vector<int64_t>& tokens, uint32_t seed, Workspace* ws = nullptr) {
    int64_t rows = 0;
    for (int64_t t : tokens) rows += t;
    std::vector<float> x = random_rows(rows, seed), out(x.size());
    const RunOptions run;
    for (size_t l = 0; l < layers.size(); ++l) {
      auto [cache, ids] = at(static_cast<int64_t>(l));
      layers[l].step(cache, ids, tokens.data(), static_cast<int64_t>(tokens.size()), x.data(), out.data(), run, ws);
      std::swap(x, out);
    }
    return x;
  }
  // The same through a ModelKvCache, the ids found with layer_ids().
  std::vector<float> step(ModelKvCache& mc, const std::vector<SequenceId>& seqs, const std::vector<int64_t>& tokens,
                          uint32_t seed, Workspace* ws = nullptr) {
    const auto n = static_cast<int64_t>(seqs.size());
    std::vector<SequenceId> ids(static_cast<size_t>(mc.layers() * n));
    mc.layer_ids(seqs.data(), n, ids.data());
    return step([&](int64_t l) { return std::pair<KvCache&, const SequenceId*>(mc.layer(l), ids.data() + l * n); },
                tokens, seed, ws);
  }
};

std::vector<SequenceId> ids_of(const ModelKvCache& mc, SequenceId seq) {
  std::vector<SequenceId> ids(static_cast<size_t>(mc.layers()));
  mc.layer_ids(&seq, 1, ids.data());
  return ids;
}

// Every layer agrees with the model on each live sequence's length and with layer 0 on its free blocks.
void expect_layers_agree(const ModelKvCache& mc, const std::vector<SequenceId>& live) {
  for (int64_t l = 0; l < mc.layers(); ++l) {
    EXPECT_EQ(mc.layer(l).free_blocks(), mc.layer(0).free_blocks()) << "layer " << l;
    EXPECT_EQ(mc.layer(l).num_sequences(), static_cast<int64_t>(live.size())) << "layer " << l;
    for (SequenceId s : live) EXPECT_EQ(mc.layer(l).length(ids_of(mc, s)[l]), mc.length(s)) << "seq " << s;
  }
  EXPECT_EQ(mc.free_blocks(), mc.layer(0).free_blocks());
}

void expect_all_free(const ModelKvCache& mc) {
  EXPECT_EQ(mc.num_sequences(), 0);
  for (int64_t l = 0; l < mc.layers(); ++l) {
    EXPECT_EQ(mc.layer(l).free_blocks(), mc.layer(l).total_blocks()) << "layer " << l;
    EXPECT_EQ(mc.layer(l).num_sequences(), 0) << "layer " << l;
  }
}

// Runs f, expecting Error(code) whose message holds every one of `parts`.
template <class F>
void expect_error(F&& f, ErrorCode code, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << *parts.begin();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(ModelKvCacheStack, MatchesSeparateCachesBitForBit) {
  Stack stack(3);
  ModelKvCache mc(small_config(), 3, tokens_options(64));
  std::vector<KvCache> sep;
  for (int l = 0; l < 3; ++l) sep.emplace_back(small_config(), tokens_options(64));
  // Layer 1's ids run ahead of the others: a model that assumed equal ids would hand it another sequence's id.
  const SequenceId stray = mc.layer(1).create();
  const SequenceId a = mc.create(), b = mc.create();
  std::vector<std::vector<SequenceId>> ids(3);  // the separate caches' ids, [layer][a, b]
  for (int l = 0; l < 3; ++l) ids[l] = {sep[l].create(), sep[l].create()};
  EXPECT_NE(ids_of(mc, a)[1], ids_of(mc, a)[0]);

  const auto separate = [&](const std::vector<int>& which, const std::vector<int64_t>& tokens, uint32_t seed) {
    std::vector<std::vector<SequenceId>> per(3);
    for (int l = 0; l < 3; ++l) {
      for (int w : which) per[l].push_back(ids[l][w]);
    }
    return stack.step(
        [&](int64_t l) { return std::pair<KvCache&, const SequenceId*>(sep[l], per[l].data()); }, tokens, seed);
  };
  const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(stack.step(mc, {a}, {7}, 1), separate({0}, {7}, 1))) << "prompt of a";
  EXPECT_TRUE(same(stack.step(mc, {b}, {5}, 2), separate({1}, {5}, 2))) << "prompt of b";
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(same(stack.step(mc, {a, b}, {1, 1}, 10 + i), separate({0, 1}, {1, 1}, 10 + i))) << "decode " << i;
  }
  EXPECT_TRUE(same(stack.step(mc, {b, a}, {3, 1}, 20), separate({1, 0}, {3, 1}, 20))) << "ragged step";
  EXPECT_EQ(mc.length(a), 11);
  EXPECT_EQ(mc.length(b), 11);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(mc.layer(l).free_blocks(), sep[l].free_blocks());
  mc.layer(1).release(stray);
  mc.release(a);
  mc.release(b);
  expect_all_free(mc);
}

TEST(ModelKvCacheOps, ForkTruncateReleaseActOnEveryLayer) {
  Stack stack(3);
  ModelKvCache mc(small_config(), 3, tokens_options(64));
  const SequenceId a = mc.create();
  stack.step(mc, {a}, {6}, 1);
  const SequenceId b = mc.fork(a), c = mc.fork(a, 3);
  EXPECT_EQ(mc.length(b), 6);
  EXPECT_EQ(mc.length(c), 3);
  expect_layers_agree(mc, {a, b, c});
  const int64_t shared = mc.free_blocks();
  EXPECT_EQ(shared, 16 - 2);  // forks share a's two blocks
  // c's next token goes into a's partly used block: a copy-on-write copy in every layer.
  EXPECT_EQ(mc.blocks_needed(c, 1), 1);
  const SequenceId batch[] = {b, c};
  const int64_t tokens[] = {3, 1};
  EXPECT_EQ(mc.blocks_needed(batch, tokens, 2), mc.blocks_needed(b, 3) + mc.blocks_needed(c, 1));
  for (int l = 0; l < 3; ++l) EXPECT_EQ(mc.layer(l).blocks_needed(ids_of(mc, b)[l], 3), mc.blocks_needed(b, 3));
  stack.step(mc, {b, c}, {3, 1}, 2);
  EXPECT_EQ(mc.length(b), 9);
  EXPECT_EQ(mc.length(c), 4);
  expect_layers_agree(mc, {a, b, c});
  mc.truncate(a, 2);
  EXPECT_EQ(mc.length(a), 2);
  expect_layers_agree(mc, {a, b, c});
  const std::vector<SequenceId> gone = ids_of(mc, b);
  mc.release(b);
  EXPECT_FALSE(mc.contains(b));
  for (int l = 0; l < 3; ++l) EXPECT_FALSE(mc.layer(l).contains(gone[l])) << "layer " << l;
  expect_error([&] { ids_of(mc, b); }, ErrorCode::invalid_argument, {"unknown sequence id"});
  expect_error([&] { mc.release(b); }, ErrorCode::invalid_argument, {"unknown sequence id"});
  expect_layers_agree(mc, {a, c});
  mc.release(a);
  mc.release(c);
  expect_all_free(mc);
}

TEST(ModelKvCacheOps, TruncateRepairsAStepThatFailedPartWay) {
  Stack stack(3);
  ModelKvCache mc(small_config(), 3, tokens_options(64));
  const SequenceId a = mc.create();
  stack.step(mc, {a}, {5}, 1);
  // A model step whose layer 2 failed: layers 0 and 1 appended 3 tokens, layer 2 did not.
  const std::vector<SequenceId> ids = ids_of(mc, a);
  const std::vector<float> x = random_rows(3, 3);
  std::vector<float> out(x.size());
  for (int l = 0; l < 2; ++l) stack.layers[l].extend(mc.layer(l), ids[l], x.data(), 3, out.data());
  EXPECT_EQ(mc.length(a), 5);  // what every layer holds
  // One more token opens a third block in layers 0 and 1 (at 8 tokens), none in layer 2 (at 5): the most is counted.
  EXPECT_EQ(mc.layer(2).blocks_needed(ids[2], 1), 0);
  EXPECT_EQ(mc.blocks_needed(a, 1), 1);
  expect_error([&] { mc.truncate(a, 6); }, ErrorCode::invalid_argument, {"new_length 6", "holds 5"});
  mc.truncate(a, 5);
  expect_layers_agree(mc, {a});
  EXPECT_EQ(mc.layer(0).length(ids[0]), 5);
  mc.release(a);
  expect_all_free(mc);
}

TEST(ModelKvCacheErrors, ForkRefusedByALaterLayerIsUndoneInTheEarlierOnes) {
  Stack stack(3);
  ModelKvCache mc(small_config(), 3, tokens_options(64));
  const SequenceId stray = mc.layer(1).create();  // layer 1's ids move ahead
  const SequenceId a = mc.create();
  stack.step(mc, {a}, {5}, 1);
  const std::vector<SequenceId> a_ids = ids_of(mc, a);
  mc.layer(2).release(a_ids[2]);  // layer 2 now refuses a fork of a
  std::vector<int64_t> free_before, seqs_before;
  for (int l = 0; l < 3; ++l) {
    free_before.push_back(mc.layer(l).free_blocks());
    seqs_before.push_back(mc.layer(l).num_sequences());
  }
  expect_error([&] { mc.fork(a); }, ErrorCode::invalid_argument, {"fork of sequence", "layer 2"});
  EXPECT_EQ(mc.num_sequences(), 1);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(mc.layer(l).free_blocks(), free_before[l]) << "layer " << l;
    EXPECT_EQ(mc.layer(l).num_sequences(), seqs_before[l]) << "layer " << l;
  }
  // The undone fork spent ids in layers 0 and 1 only: a new sequence's layer ids now differ, and map right.
  const SequenceId d = mc.create();
  const std::vector<SequenceId> d_ids = ids_of(mc, d);
  EXPECT_FALSE(d_ids[0] == d_ids[1] && d_ids[1] == d_ids[2]);
  for (int l = 0; l < 3; ++l) {
    EXPECT_TRUE(mc.layer(l).contains(d_ids[l])) << "layer " << l;
    EXPECT_NE(d_ids[l], a_ids[l]) << "layer " << l;
  }
  EXPECT_NE(d_ids[1], stray);
  stack.step(mc, {d}, {6}, 2);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(mc.layer(l).length(d_ids[l]), 6) << "layer " << l;
  EXPECT_EQ(mc.layer(1).length(stray), 0);
  // The release skips the layer that no longer holds a (see the header on a release a layer refused).
  mc.release(a);
  mc.release(d);
  mc.layer(1).release(stray);
  expect_all_free(mc);
}

TEST(ModelKvCacheErrors, BadIdsAndLengthsAreNamedAndChangeNothing) {
  Stack stack(2);
  ModelKvCache mc(small_config(), 2, tokens_options(64));
  const SequenceId a = mc.create();
  stack.step(mc, {a}, {6}, 1);
  const int64_t free_before = mc.free_blocks();
  const auto unchanged = [&] {
    EXPECT_EQ(mc.num_sequences(), 1);
    EXPECT_EQ(mc.length(a), 6);
    EXPECT_EQ(mc.free_blocks(), free_before);
    expect_layers_agree(mc, {a});
  };
  const SequenceId bad = 12345;
  const auto code = ErrorCode::invalid_argument;
  expect_error([&] { mc.fork(bad); }, code, {"12345"});
  expect_error([&] { mc.fork(bad, 0); }, code, {"12345"});
  expect_error([&] { mc.truncate(bad, 0); }, code, {"12345"});
  expect_error([&] { mc.release(bad); }, code, {"12345"});
  expect_error([&] { mc.length(bad); }, code, {"12345"});
  expect_error([&] { mc.blocks_needed(bad, 1); }, code, {"12345"});
  EXPECT_FALSE(mc.contains(bad));
  const SequenceId pair[] = {a, bad};
  std::vector<SequenceId> out(4, -7);
  expect_error([&] { mc.layer_ids(pair, 2, out.data()); }, code, {"12345"});
  EXPECT_EQ(out, std::vector<SequenceId>(4, -7));
  expect_error([&] { mc.truncate(a, 7); }, code, {"new_length 7", "holds 6"});
  expect_error([&] { mc.truncate(a, -1); }, code, {"new_length -1"});
  expect_error([&] { mc.fork(a, 7); }, code, {"prefix_tokens 7"});
  expect_error([&] { mc.fork(a, -1); }, code, {"prefix_tokens -1"});
  const SequenceId twice[] = {a, a};
  const int64_t tokens[] = {1, 1}, negative[] = {-1};
  expect_error([&] { mc.blocks_needed(twice, tokens, 2); }, code, {"appears twice"});
  expect_error([&] { mc.blocks_needed(&a, negative, 1); }, code, {"tokens[0]"});
  expect_error([&] { mc.blocks_needed(a, 59); }, code, {"context_length"});
  unchanged();
  mc.release(a);
  expect_all_free(mc);
}

TEST(ModelKvCacheConstruction, LayersCapacityAndLayerIndex) {
  const Config c = small_config();
  expect_error([&] { ModelKvCache(c, 0, tokens_options(64)); }, ErrorCode::invalid_argument, {"layers", "got 0"});
  ModelKvCache mc(c, 3, tokens_options(10));  // each layer holds 10 tokens: 3 blocks of 4
  EXPECT_EQ(mc.layers(), 3);
  EXPECT_EQ(mc.total_blocks(), 3);
  EXPECT_EQ(mc.block_tokens(), 4);
  EXPECT_EQ(mc.capacity_bytes(), 3 * mc.layer(2).capacity_bytes());
  expect_error([&] { mc.layer(3); }, ErrorCode::invalid_argument, {"l=3"});
  expect_error([&] { mc.layer(-1); }, ErrorCode::invalid_argument, {"l=-1"});
  const size_t block = mc.block_bytes();

  KvCacheOptions o = tokens_options(0);
  o.capacity_bytes = 3 * 5 * block + 2 * block + 3;  // each layer 5 blocks and a remainder, rounded down
  ModelKvCache split(c, 3, o);
  EXPECT_EQ(split.total_blocks(), 5);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(split.layer(l).total_blocks(), 5) << "layer " << l;
  EXPECT_EQ(split.capacity_bytes(), 15 * block);
  o.capacity_bytes = 3 * block - 1;  // a share just below one block
  expect_error([&] { ModelKvCache(c, 3, o); }, ErrorCode::invalid_argument, {"capacity_bytes", "less than one block"});
  o.capacity_bytes = 2;  // a share of 0 bytes
  expect_error([&] { ModelKvCache(c, 3, o); }, ErrorCode::invalid_argument,
               {"capacity_bytes=2", "less than one block (" + std::to_string(block) + " bytes"});
  o.capacity_bytes = 3 * block - 1;
  o.dtype = DType::u8;  // not a K/V format: that, not the share, is named
  expect_error([&] { ModelKvCache(c, 3, o); }, ErrorCode::invalid_argument, {"dtype"});
}

TEST(ModelKvCacheConcurrency, ThreadsCreateExtendAndReleaseTheirOwnSequences) {
  Stack stack(3);
  ModelKvCache mc(small_config(), 3, tokens_options(256));  // 4 threads x 2 sequences x at most 24 tokens
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Workspace ws;
      std::mt19937 g(static_cast<uint32_t>(t));
      try {
        for (int i = 0; i < 40; ++i) {
          const SequenceId s = mc.create();
          const int64_t prompt = 1 + static_cast<int64_t>(g() % 16);
          stack.step(mc, {s}, {prompt}, g(), &ws);
          const SequenceId f = mc.fork(s, prompt / 2);
          stack.step(mc, {s, f}, {1, 2}, g(), &ws);
          if (mc.length(s) != prompt + 1 || mc.length(f) != prompt / 2 + 2) ++failures;
          if (i % 2) mc.truncate(s, 1);
          // Bookkeeping alone, many times a step, so that the threads' structure calls do meet.
          for (int k = 0; k < 250; ++k) {
            const SequenceId e = mc.create(), ef = mc.fork(e);
            if (ids_of(mc, ef).size() != 3 || mc.length(ef) != 0) ++failures;
            mc.release(ef);
            mc.release(e);
          }
          mc.release(s);
          mc.release(f);
        }
      } catch (const std::exception& e) {
        std::cerr << "thread " << t << ": " << e.what() << "\n";
        ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  expect_all_free(mc);
}

// The figure in model_kv_cache.hpp: the per-step bookkeeping of a 48-layer model decoding 16 sequences.
TEST(ModelKvCacheCost, BookkeepingPerDecodeStep) {
  constexpr int64_t L = 48, B = 16;
  ModelKvCache mc(small_config(), L, tokens_options(B * 64));
  std::vector<SequenceId> seqs;
  for (int64_t i = 0; i < B; ++i) seqs.push_back(mc.create());
  const std::vector<int64_t> one(B, 1);
  std::vector<SequenceId> ids(static_cast<size_t>(L * B));
  std::vector<double> all_us, ids_us;
  using clock = std::chrono::steady_clock;
  for (int rep = 0; rep < 2000; ++rep) {
    const auto t0 = clock::now();
    mc.layer_ids(seqs.data(), B, ids.data());
    const auto t1 = clock::now();
    const int64_t need = mc.blocks_needed(seqs.data(), one.data(), B);
    const auto t2 = clock::now();
    ASSERT_EQ(need, B);  // each empty sequence's first token opens a block
    ids_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    all_us.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < B; ++i) ASSERT_TRUE(mc.layer(l).contains(ids[l * B + i])) << l << ", " << i;
  }
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  std::cout << "B=" << B << " L=" << L << ": layer_ids + blocks_needed median " << median(all_us)
            << " us, layer_ids alone " << median(ids_us) << " us\n";
}

}  // namespace
}  // namespace gpt2attn
