// tests/test_kv_cache_errors.cpp: every refused serving call on a KV cache, on every instruction set this CPU runs:
// each throws Error with the right code and a message naming the problem, and leaves every sequence's length and
// cached K/V bit-identical, the pool's counts, and `out`, untouched; the sequences still work afterwards. The
// lease protocol underneath (begin_append / end_append) is test_kv_pool.cpp's.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::CacheSnapshot;
using test::Harness;
using test::IsaTest;
using test::kNaN;
using test::kSentinel;
using test::serving_config;
using test::pool;
using test::random_uniform;
using test::same_snapshot;
using test::snapshot;

// =============================================================================================================
// Errors: each refused call throws Error with the right code and a message naming the problem, and leaves
// every sequence's length and cached K/V bit-identical, the pool's counts, and `out`, untouched.

class KvCacheErrors : public IsaTest {
 protected:
  // Two sequences: a (length 6) and b (length 8, full blocks), on a 5-block pool of 4-token blocks (1 free),
  // context_length 16.
  void SetUp() override {
    IsaTest::SetUp();
    if (IsSkipped()) return;
    rebuild(20);
  }
  void rebuild(int64_t capacity_tokens) {
    h = std::make_unique<Harness>(serving_config(32, 2, 24, 16), isa(), 4, capacity_tokens, 170, 2);
    a = h->create();
    b = h->create();
    h->extend(a, 6);
    h->extend(b, 8);
  }
  std::unique_ptr<Harness> h;
  SequenceId a = 0, b = 0;

  // Runs `call` (which must throw), then checks code, message words (each group: one alternative must appear),
  // the cache state and `out`. `out` is the buffer the call was given, prefilled with kSentinel.
  void expect_refused(const std::string& what, ErrorCode code, const std::vector<std::vector<std::string>>& words,
                      const std::vector<float>& out, const std::function<void()>& call) {
    const std::string ctx = h->ctx(what);
    const CacheSnapshot before = snapshot(h->cache, h->live());
    try {
      call();
      ADD_FAILURE() << ctx << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << ctx << ": wrong code for: " << e.what();
      const std::string msg = e.what();
      for (const auto& group : words) {
        bool found = false;
        for (const std::string& w : group) found = found || msg.find(w) != std::string::npos;
        std::string alts;
        for (const std::string& w : group) alts += " \"" + w + "\"";
        EXPECT_TRUE(found) << ctx << ": message names none of" << alts << ": " << msg;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << ctx << ": threw a non-gpt2attn exception: " << e.what();
    }
    EXPECT_TRUE(same_snapshot(before, snapshot(h->cache, h->live()))) << ctx << ": state changed by a refused call";
    for (size_t i = 0; i < out.size(); ++i) {
      if (std::memcmp(&out[i], &kSentinel, sizeof(float)) != 0) {
        ADD_FAILURE() << ctx << ": refused call wrote out[" << i << "] = " << out[i];
        break;
      }
    }
    EXPECT_TRUE(h->accounting(what + ", after the refused call"));
  }
  std::vector<float> tokens(int64_t n) { return random_uniform(static_cast<size_t>(n * h->W()), h->rng.g); }
  std::vector<float> sentinel_out(int64_t rows) {
    return std::vector<float>(static_cast<size_t>(rows * h->E()), kSentinel);
  }
  // After the refusals the sequences still work and match their references.
  void still_works() {
    h->decode({a});
    EXPECT_TRUE(h->matches_reference(a, "after refused calls"));
    EXPECT_TRUE(h->matches_reference(b, "after refused calls"));
  }
};

TEST_P(KvCacheErrors, PoolExhaustedInExtend) {
  // a: 2 blocks, b: 2 blocks, 1 free. c needs 2 for 5 tokens; a needs 2 more for 6 tokens (8 -> 12 is 3 blocks).
  ASSERT_EQ(h->cache.free_blocks(), 1);
  const SequenceId c = h->create();
  std::vector<float> out = sentinel_out(7);
  const std::vector<float> x = tokens(7);
  const std::vector<std::vector<std::string>> words{{"block", "pool", "capacity", "KV", "memory"}};
  expect_refused("extend of 5 tokens into an empty sequence, 1 block free", ErrorCode::out_of_memory, words, out,
                 [&] { h->block.extend(h->cache, c, x.data(), 5, out.data()); });
  expect_refused("extend of 7 tokens into a (length 6 -> 13: 2 more blocks), 1 block free",
                 ErrorCode::out_of_memory, words, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 7, out.data()); });
  // Exactly enough: 2 tokens into a (6 -> 8) takes no block; 4 more into c takes the last one.
  h->extend(a, 2);
  h->extend(c, 4);
  ASSERT_EQ(h->cache.free_blocks(), 0);
  EXPECT_TRUE(h->accounting("pool exactly full"));
  std::vector<float> out1 = sentinel_out(1);
  expect_refused("extend of 1 token into c (length 4, full block), pool empty", ErrorCode::out_of_memory, words, out1,
                 [&] { h->block.extend(h->cache, c, x.data(), 1, out1.data()); });
  // Releasing b makes room; everything else is as it was.
  h->release(b);
  h->extend(c, 3);
  h->decode({a, c});
  EXPECT_TRUE(h->accounting("after release and reuse"));
  EXPECT_TRUE(h->matches_reference(a, "a after exhaustion"));
  EXPECT_TRUE(h->matches_reference(c, "c after exhaustion"));
}

// A request that needs more blocks than the whole pool holds can never fit, whatever is released: invalid_argument,
// not the out_of_memory a server reads as "wait for room" (it waited for good). Extend and decode alike.
TEST_P(KvCacheErrors, RequestLargerThanThePoolIsInvalidNotExhausted) {
  h = std::make_unique<Harness>(serving_config(32, 2, 24, 16), isa(), 4, 8, 170, 2);  // 2 blocks of 4 tokens
  ASSERT_EQ(h->cache.total_blocks(), 2);
  const SequenceId c = h->create();
  std::vector<float> out = sentinel_out(9);
  const std::vector<float> x = tokens(9);
  expect_refused("extend of 9 tokens (3 blocks) into an empty sequence of a 2-block pool", ErrorCode::invalid_argument,
                 {{"never fit"}, {"3 blocks"}}, out, [&] { h->block.extend(h->cache, c, x.data(), 9, out.data()); });
  h->extend(c, 8);
  ASSERT_EQ(h->cache.free_blocks(), 0);
  std::vector<float> out1 = sentinel_out(1);
  expect_refused("decode of c, which holds the whole pool", ErrorCode::invalid_argument, {{"never fit"}}, out1,
                 [&] { h->block.decode(h->cache, &c, 1, x.data(), out1.data()); });
  EXPECT_TRUE(h->matches_reference(c, "after the refusals"));
}

TEST_P(KvCacheErrors, PoolExhaustedInDecodeIsAllOrNothing) {
  // Fill: c takes the last block with 3 tokens. Then decode {c, b}: c fits in its block, b (length 8, full) needs
  // a new one: the whole batch is refused and c is not appended either.
  const SequenceId c = h->create();
  h->extend(c, 3);
  ASSERT_EQ(h->cache.free_blocks(), 0);
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const std::vector<std::vector<std::string>> words{{"block", "pool", "capacity", "KV", "memory"}};
  const SequenceId cb[] = {c, b};
  expect_refused("decode {c (fits), b (needs a block)}, pool empty", ErrorCode::out_of_memory, words, out,
                 [&] { h->block.decode(h->cache, cb, 2, x.data(), out.data()); });
  // c alone fits.
  h->decode({c});
  EXPECT_TRUE(h->accounting("c decoded alone"));
  h->release(a);
  h->decode({c, b});
  EXPECT_TRUE(h->accounting("after release"));
  for (SequenceId id : h->live()) EXPECT_TRUE(h->matches_reference(id, "after exhaustion in decode"));
}

// For every storage dtype (f32, bf16, int8, fp8: test::kv_formats()): a decode batch whose third sequence finds the pool empty is refused
// whole; every sequence's length and cached K/V (for int8: values and scales, read back through them) stay
// bit-identical, `out` untouched, and after a release the same batch succeeds.
TEST_P(KvCacheErrors, PoolExhaustedMidBatchLeavesEveryDtypeUntouched) {
  for (DType dtype : test::kv_formats()) {
    const std::string ctx = h->ctx(std::string("cache dtype ") + to_string(dtype));
    KvCacheOptions o = pool(4, 16);  // 4 blocks of 4 tokens
    o.dtype = dtype;
    KvCache cache(h->block.config(), o);
    const SequenceId s0 = cache.create(), s1 = cache.create(), s2 = cache.create(), spare = cache.create();
    std::vector<float> x = tokens(8), out(static_cast<size_t>(8 * h->E()));
    h->block.extend(cache, s0, x.data(), 3, out.data());  // 1 block, room for 1 more token
    h->block.extend(cache, s1, x.data(), 2, out.data());  // 1 block, room
    h->block.extend(cache, s2, x.data(), 4, out.data());  // 1 block, full: the next token needs a new one
    h->block.extend(cache, spare, x.data(), 1, out.data());  // the last block
    ASSERT_EQ(cache.free_blocks(), 0) << ctx;
    const std::vector<SequenceId> batch{s0, s1, s2};
    const CacheSnapshot before = snapshot(cache, {s0, s1, s2, spare});
    std::vector<float> y = sentinel_out(3);
    try {
      h->block.decode(cache, batch.data(), 3, x.data(), y.data());
      ADD_FAILURE() << ctx << ": accepted with the pool empty";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << ctx << ": " << e.what();
    }
    EXPECT_TRUE(same_snapshot(before, snapshot(cache, {s0, s1, s2, spare}))) << ctx;
    for (float v : y) ASSERT_EQ(std::memcmp(&v, &kSentinel, sizeof v), 0) << ctx << ": the refused call wrote out";
    EXPECT_EQ(cache.impl().audit(), "") << ctx;
    cache.release(spare);
    h->block.decode(cache, batch.data(), 3, x.data(), y.data());
    EXPECT_EQ(cache.length(s2), 5) << ctx;
    EXPECT_EQ(cache.impl().audit(), "") << ctx;
  }
}

TEST_P(KvCacheErrors, UnknownAndReleasedIds) {
  const SequenceId gone = h->create();
  h->extend(gone, 2);
  h->release(gone);
  const SequenceId never = 987654321;
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  for (SequenceId bad : {gone, never}) {
    const std::string id = std::to_string(bad);
    const std::string which = bad == gone ? "released" : "unknown";
    expect_refused("extend of " + which + " id " + id, ErrorCode::invalid_argument, {{id}}, out,
                   [&] { h->block.extend(h->cache, bad, x.data(), 1, out.data()); });
    const SequenceId ids[] = {a, bad};
    expect_refused("decode {a, " + which + " id " + id + "}", ErrorCode::invalid_argument, {{id}}, out,
                   [&] { h->block.decode(h->cache, ids, 2, x.data(), out.data()); });
    EXPECT_FALSE(h->cache.contains(bad));
    for (const char* m : {"length", "fork", "release", "blocks_needed"}) {
      try {
        const std::string mm = m;
        if (mm == "length") h->cache.length(bad);
        if (mm == "fork") h->cache.fork(bad);
        if (mm == "release") h->cache.release(bad);
        if (mm == "blocks_needed") h->cache.blocks_needed(bad, 1);
        ADD_FAILURE() << h->ctx("KvCache::" + mm + "(" + which + " id " + id + ")") << " accepted";
      } catch (const Error& e) {
        EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::invalid_argument)) << e.what();
        EXPECT_NE(std::string(e.what()).find(id), std::string::npos) << "message lacks the id: " << e.what();
      }
    }
    EXPECT_TRUE(h->accounting("after " + which + " id"));
  }
  still_works();
}

TEST_P(KvCacheErrors, SameIdTwiceInOneBatch) {
  std::vector<float> out = sentinel_out(3);
  const std::vector<float> x = tokens(3);
  const SequenceId ids[] = {a, b, a};
  expect_refused("decode {a, b, a}", ErrorCode::invalid_argument,
                 {{std::to_string(a)}, {"twice", "duplicate", "more than once", "repeated", "appears", "distinct"}},
                 out, [&] { h->block.decode(h->cache, ids, 3, x.data(), out.data()); });
  still_works();
}

TEST_P(KvCacheErrors, PastContextLength) {
  // context_length 16: a has 6, so extend of 11 is refused, 10 is fine; then a decode at length 16 is refused.
  // The pool has room for everything here, so the only problem is the length.
  rebuild(64);
  std::vector<float> out = sentinel_out(11);
  const std::vector<float> x = tokens(11);
  expect_refused("extend of 11 tokens into a (length 6), context 16", ErrorCode::invalid_argument,
                 {{"context_length"}}, out, [&] { h->block.extend(h->cache, a, x.data(), 11, out.data()); });
  h->extend(a, 10);
  ASSERT_EQ(h->cache.length(a), 16);
  const SequenceId c = h->create();
  h->extend(c, 2);
  std::vector<float> out2 = sentinel_out(2);
  const SequenceId ids[] = {c, a};
  expect_refused("decode {c (length 2), a (length 16 = context)}", ErrorCode::invalid_argument, {{"context_length"}},
                 out2, [&] { h->block.decode(h->cache, ids, 2, x.data(), out2.data()); });
  EXPECT_TRUE(h->matches_reference(a, "a at context_length"));
  h->decode({c});
  EXPECT_TRUE(h->matches_reference(c, "c after the refusal"));
}

TEST_P(KvCacheErrors, NonFiniteInput) {
  std::vector<float> out = sentinel_out(3);
  std::vector<float> x = tokens(3);
  x[1 * h->W() + 5] = kNaN;  // token 1, element 5
  expect_refused("extend with NaN at token 1, element 5", ErrorCode::invalid_argument, {{"NaN"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 3, out.data()); });
  const SequenceId ids[] = {a, b};
  std::vector<float> xd = tokens(2);
  xd[1 * h->W() + 3] = std::numeric_limits<float>::infinity();  // b's token
  std::vector<float> out2 = sentinel_out(2);
  expect_refused("decode {a, b} with +Inf in b's token", ErrorCode::invalid_argument, {{"Inf", "inf", "finite"}},
                 out2, [&] { h->block.decode(h->cache, ids, 2, xd.data(), out2.data()); });
  still_works();
}

TEST_P(KvCacheErrors, TrainingRefused) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const RunOptions train{.training = true};
  expect_refused("extend with training=true", ErrorCode::invalid_argument, {{"training"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 1, out.data(), train); });
  const SequenceId ids[] = {a, b};
  expect_refused("decode with training=true", ErrorCode::invalid_argument, {{"training"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, x.data(), out.data(), train); });
  still_works();
}

TEST_P(KvCacheErrors, EmptyCallsAndNullPointers) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  const SequenceId ids[] = {a, b};
  expect_refused("extend with T=0", ErrorCode::invalid_argument, {{"T"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 0, out.data()); });
  expect_refused("extend with T=-1", ErrorCode::invalid_argument, {{"T"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), -1, out.data()); });
  expect_refused("decode with B=0", ErrorCode::invalid_argument, {{"B", "batch"}}, out,
                 [&] { h->block.decode(h->cache, ids, 0, x.data(), out.data()); });
  expect_refused("extend with x = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.extend(h->cache, a, nullptr, 1, out.data()); });
  expect_refused("extend with out = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.extend(h->cache, a, x.data(), 1, nullptr); });
  expect_refused("decode with seqs = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, nullptr, 2, x.data(), out.data()); });
  expect_refused("decode with x = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, nullptr, out.data()); });
  expect_refused("decode with out = null", ErrorCode::invalid_argument, {{"null"}}, out,
                 [&] { h->block.decode(h->cache, ids, 2, x.data(), nullptr); });
  still_works();
}

TEST_P(KvCacheErrors, CacheBuiltForAnotherShape) {
  std::vector<float> out = sentinel_out(2);
  const std::vector<float> x = tokens(2);
  Config wider = h->cfg;
  wider.d_model = 48;  // H = 2, D = 24
  Config more_heads = h->cfg;
  more_heads.num_heads = 4;  // E = 32, D = 8
  Config one_kv_head = h->cfg;
  one_kv_head.num_kv_heads = 1;  // same E, H and D: only the K/V heads differ (multi-query)
  ASSERT_GT(h->cfg.kv_heads(), 1);
  for (const Config* other : {&wider, &more_heads, &one_kv_head}) {
    KvCache foreign(*other, pool(4, 20));
    const SequenceId f = foreign.create();
    const std::string shape = "a cache for E=" + std::to_string(other->d_model) +
                              " H=" + std::to_string(other->num_heads) + " H_kv=" + std::to_string(other->kv_heads());
    expect_refused("extend into " + shape, ErrorCode::invalid_argument,
                   {{"d_model", "num_heads", "heads", "width", "E="}}, out,
                   [&] { h->block.extend(foreign, f, x.data(), 1, out.data()); });
    EXPECT_EQ(foreign.length(f), 0) << shape;
    EXPECT_EQ(foreign.free_blocks(), foreign.total_blocks()) << shape;
    const SequenceId ids[] = {f};
    expect_refused("decode in " + shape, ErrorCode::invalid_argument,
                   {{"d_model", "num_heads", "heads", "width", "E="}}, out,
                   [&] { h->block.decode(foreign, ids, 1, x.data(), out.data()); });
  }
  still_works();
}
GPT2ATTN_INSTANTIATE_ISAS(KvCache, KvCacheErrors);

}  // namespace
}  // namespace gpt2attn
