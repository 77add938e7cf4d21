// tests/test_kv_soak.cpp: the KV soak: a long random stream of create / extend / decode / fork (of the whole sequence
// or a prefix) / truncate / release operations,
// with bad calls mixed in, on small pools that run out of blocks and sequences that reach the context length, on
// every instruction set this CPU runs and every cache dtype (f32, bf16, int8; one grouped-query and one multi-query
// config). Before each call a plain model (kv_harness.hpp's BlockModel and the sequences' lengths) predicts whether
// it is accepted or refused, and with which error; after it the cache's books must equal the model's, a refused call
// must have left every sequence bit-identical and `out` untouched, and an accepted one every other sequence's blocks
// and its own sequences' earlier tokens. Outputs are spot-checked against the reference; at the end everything is
// released and the pool must be full again (no leaked block). test_kv_cache_script_fork.cpp is the short scripted
// version (always enough room); test_kv_cache_errors.cpp names each refusal once, with its message.
//
//   GPT2ATTN_SOAK_OPS   N, the operations of the whole soak (default kDefaultOps; CI runs 100000), split like the
//                       sweep over the instruction sets this CPU runs, then evenly over the pool configs.
//   GPT2ATTN_SOAK_SEED  the base seed (default kDefaultSeed; decimal or 0x hex). A failure names its operation and
//                       prints the line that re-runs the same stream up to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "gpt2attn/error.hpp"
#include "tests/kv_harness.hpp"

namespace gpt2attn {
namespace {

using test::BlockModel;
using test::CacheSnapshot;
using test::Harness;
using test::kNaN;
using test::kSentinel;
using test::Rng;

// About 2 s of CPU here for the whole default soak (4 instruction sets x 3 pools); CI sets 100000.
constexpr int64_t kDefaultOps = 20000;
constexpr uint64_t kDefaultSeed = 0x50a4;
constexpr SequenceId kNeverIssued = 1'000'000'007;  // ids count up from 1: this one is never handed out
constexpr int64_t kMaxLive = 10;                    // live sequences the stream aims to stay under
constexpr int kReferenceEvery = 25;                 // a random live sequence against the reference every this many ops

// =============================================================================================================
// The environment's size and seed (as in test_fastpath_sweep.cpp).

struct SoakSettings {
  int64_t ops = kDefaultOps;
  uint64_t seed = kDefaultSeed;
  std::string error;
};

SoakSettings soak_settings() {
  SoakSettings s;
  s.ops = static_cast<int64_t>(
      test::env_uint("GPT2ATTN_SOAK_OPS", static_cast<uint64_t>(s.ops), true, uint64_t{1} << 40, s.error));
  s.seed = test::env_uint("GPT2ATTN_SOAK_SEED", s.seed, false, UINT64_MAX, s.error);
  return s;
}

// This instruction set's share of N among the sets this CPU runs (at least one op each).
int64_t share_of(int64_t N, Isa isa) {
  const auto [k, n] = test::runnable_isa_index(isa);
  return std::max<int64_t>(1, (k + 1) * N / n - k * N / n);
}

std::string replay_line(const SoakSettings& s) {
  std::error_code ec;
  std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec || exe.empty()) exe = "./build/tests/gpt2attn_tests";
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  std::ostringstream o;
  o << "GPT2ATTN_SOAK_OPS=" << s.ops << " GPT2ATTN_SOAK_SEED=" << s.seed << " " << exe << " --gtest_filter='"
    << t->test_suite_name() << "." << t->name() << "'";
  return o.str();
}

// =============================================================================================================
// The pools: small enough that a few sequences fill them, contexts short enough that sequences reach them.

struct PoolConfig {
  const char* name;
  Config cfg;
  DType compute, kv;
  int64_t block_tokens, blocks;
  int threads;
};

std::vector<PoolConfig> pool_configs() {
  Config mha = test::serving_config(32, 2, 24, 40);  // D = 16
  Config gqa = test::serving_config(48, 4, 0, 36);   // D = 12, 2 K/V heads
  gqa.num_kv_heads = 2;
  Config mqa = test::serving_config(64, 4, 40, 48, true, false);  // D = 16, 1 K/V head, no output bias
  mqa.num_kv_heads = 1;
  // Sequences of many blocks, past the 256 keys (kernels/tiles.hpp kDecodeMinSplitKeys) where decode splits a
  // sequence's keys into work items.
  const Config longer = test::serving_config(64, 4, 0, 512);  // D = 16
  // One thread per call: the soak is about the pool's books, and thousands of tiny calls that each start a team
  // ran 10-20x slower on a busy 2-core machine (libgomp's spinning waits). Decode still splits the keys of a long
  // sequence (into 256-key items, merged); calls on two threads are the sweep's (test_fastpath_sweep.cpp serving
  // cases) and KvCacheConcurrency's.
  return {
      {"f32 cache, 2 heads", mha, DType::f32, DType::f32, 4, 16, 1},
      {"bf16 cache, grouped 4/2 heads, 3-token blocks", gqa, DType::f32, DType::bf16, 3, 20, 1},
      {"int8 cache, multi-query 4/1 heads, bf16 compute", mqa, DType::bf16, DType::i8, 8, 10, 1},
      {"fp8 cache, grouped 4/2 heads, 5-token blocks", gqa, DType::f32, DType::fp8, 5, 20, 1},
      {"f32 cache, context 512, 16-token blocks", longer, DType::f32, DType::f32, 16, 64, 1},
  };
}

// What the stream reached, so a soak that stopped exercising something fails.
struct Reached {
  int64_t creates = 0, extends = 0, decodes = 0, steps = 0, forks = 0, prefix_forks = 0, truncates = 0, releases = 0;
  int64_t copy_on_write = 0, pool_full = 0;
  int64_t refused_pool = 0, refused_context = 0, refused_bad_id = 0, refused_duplicate = 0, refused_non_finite = 0;
  int64_t refused_bad_length = 0;
  int64_t reference_checks = 0;
  int64_t longest_decode = 0;  // the longest sequence a decode step extended
};

// =============================================================================================================

class Soak {
 public:
  Soak(const PoolConfig& pc, Isa isa, uint64_t seed)
      : pc_(pc),
        h_(pc.cfg, isa, pc.block_tokens, pc.block_tokens * pc.blocks, seed, pc.threads, pc.compute, pc.kv),
        r_(seed ^ 0x0b5ULL) {}

  // Runs `ops` operations and the final release; the first failure ends it.
  ::testing::AssertionResult run(int64_t ops) {
    if (h_.cache.total_blocks() != pc_.blocks) return fail("setup") << "total_blocks " << h_.cache.total_blocks();
    for (op_ = 0; op_ < ops; ++op_) {
      if (auto ok = step(); !ok) return ok;
      if (auto ok = h_.accounting(where("after it")); !ok) return ok;
      for (SequenceId id : released_) {
        if (h_.cache.contains(id)) return fail("after it") << "released id " << id << " is still contained";
      }
      if (h_.model.free() == 0) ++reached_.pool_full;
      if (op_ % kReferenceEvery == kReferenceEvery - 1 && !h_.seqs.empty()) {
        if (auto ok = check_reference(pick_live(), "spot check"); !ok) return ok;
      }
    }
    // Everything released: the pool is full again and no id survives.
    op_ = ops;
    what_ = "release of everything";
    for (SequenceId id : h_.live()) {
      if (auto ok = check_reference(id, "final release"); !ok) return ok;
      h_.release(id);
      released_.push_back(id);
    }
    if (auto ok = h_.accounting(where("everything released")); !ok) return ok;
    if (h_.cache.free_blocks() != h_.cache.total_blocks() || h_.cache.num_sequences() != 0) {
      return fail("everything released") << "free_blocks " << h_.cache.free_blocks() << " of "
                                         << h_.cache.total_blocks() << ", num_sequences " << h_.cache.num_sequences()
                                         << ": a block or a sequence leaked";
    }
    for (SequenceId id : ever_) {
      if (h_.cache.contains(id)) return fail("everything released") << "id " << id << " is still contained";
    }
    return ::testing::AssertionSuccess();
  }

  const Reached& reached() const { return reached_; }
  const BlockModel& model() const { return h_.model; }
  std::string label() const { return h_.ctx(pc_.name); }

 private:
  const PoolConfig& pc_;
  Harness h_;
  Rng r_;  // the operation stream; the harness's own draws the tokens
  int64_t op_ = 0;
  std::string what_;                  // the current operation, for messages
  std::vector<SequenceId> released_;  // the last few released ids, for bad calls and the contains() check
  std::set<SequenceId> ever_;
  Reached reached_;

  std::string where(const std::string& when) const {
    return std::string(pc_.name) + " | op " + std::to_string(op_) + " (" + what_ + "), " + when;
  }
  ::testing::AssertionResult fail(const std::string& when) const {
    return ::testing::AssertionFailure() << h_.ctx(where(when)) << ": ";
  }
  int64_t len(SequenceId id) const { return h_.model.len.at(id); }
  int64_t context() const { return h_.cfg.context_length; }
  SequenceId pick_live() {
    const std::vector<SequenceId> ids = h_.live();
    return ids[static_cast<size_t>(r_.between(0, static_cast<int64_t>(ids.size()) - 1))];
  }
  SequenceId bad_id() {
    return released_.empty() || r_.chance(0.2) ? kNeverIssued
                                               : released_[r_.between(0, static_cast<int64_t>(released_.size()) - 1)];
  }
  std::vector<float> tokens(int64_t n) {
    return test::random_uniform(static_cast<size_t>(n * h_.W()), h_.rng.g, -2.0f, 2.0f);
  }

  ::testing::AssertionResult check_reference(SequenceId id, const std::string& why) {
    ++reached_.reference_checks;
    return h_.matches_reference(id, where(why));
  }

  // ---------------------------------------------------------------------------------------------------------
  // One operation, drawn by weight from what applies now: no creates or forks at kMaxLive, more releases the
  // fuller the pool.
  ::testing::AssertionResult step() {
    const int64_t live = static_cast<int64_t>(h_.seqs.size()), free = h_.model.free();
    const bool crowded = live >= kMaxLive;
    const int64_t w_create = crowded ? 0 : 4, w_extend = live ? 6 : 0, w_decode = live ? 10 : 0;
    const int64_t w_fork = live && !crowded ? 3 : 0, w_truncate = live ? 2 : 0, w_bad = 2;
    // Releases keep the pool busy but not jammed: about a quarter of the calls end up refused for want of blocks.
    const int64_t w_release = !live ? 0 : free == 0 ? 12 : free < 3 || live > kMaxLive / 2 ? 5 : 1;
    int64_t x = r_.between(0, w_create + w_extend + w_decode + w_fork + w_truncate + w_release + w_bad - 1);
    if ((x -= w_create) < 0) return create();
    if ((x -= w_extend) < 0) return extend(pick_live());
    if ((x -= w_decode) < 0) return decode();
    if ((x -= w_fork) < 0) return fork();
    if ((x -= w_truncate) < 0) return truncate();
    if ((x -= w_release) < 0) return release();
    return bad_call();
  }

  ::testing::AssertionResult create() {
    what_ = "create";
    const SequenceId id = h_.create();
    ever_.insert(id);
    ++reached_.creates;
    if (h_.cache.length(id) != 0) return fail("created") << "a new sequence has length " << h_.cache.length(id);
    return r_.chance(0.7) ? extend(id) : ::testing::AssertionSuccess();  // usually a prompt right away
  }

  // Mostly a chunk of a block or two, sometimes up to the whole context (which the pool or context may refuse).
  ::testing::AssertionResult extend(SequenceId id) {
    const int64_t T = r_.chance(0.15) ? r_.between(1, context()) : r_.between(1, 2 * pc_.block_tokens + 1);
    what_ = "extend " + std::to_string(id) + " (length " + std::to_string(len(id)) + ") by " + std::to_string(T);
    if (len(id) + T > context()) {
      ++reached_.refused_context;
      const std::vector<float> x = tokens(T);
      return refused({ErrorCode::invalid_argument}, T, [&](float* out) {
        h_.block.extend(h_.cache, id, x.data(), T, out, h_.run());
      });
    }
    if (h_.model.needed(id, T) > h_.model.free()) {
      ++reached_.refused_pool;
      const std::vector<float> x = tokens(T);
      return refused({ErrorCode::out_of_memory}, T, [&](float* out) {
        h_.block.extend(h_.cache, id, x.data(), T, out, h_.run());
      });
    }
    ++reached_.extends;
    return accepted({id}, [&] { return h_.extend(id, T); });
  }

  // A random subset of the live sequences (empty ones included), in random order: a decode step, or half the time a
  // ragged step (CausalSelfAttention::step) appending 1 to 2 blocks' worth of tokens to each. The model predicts the
  // whole batch: any sequence at the context length refuses it (invalid_argument), else it needs the blocks of its appends
  // made one after another on a copy of the model (a shared block is copied by each writer while another sequence
  // still holds it: of w writers among r holders, min(w, r - 1) copy), all or nothing.
  ::testing::AssertionResult decode() {
    std::vector<SequenceId> ids;
    for (SequenceId id : h_.live()) {
      if (r_.chance(0.5)) ids.push_back(id);
    }
    if (ids.empty()) ids.push_back(pick_live());
    std::shuffle(ids.begin(), ids.end(), r_.g);
    const bool ragged = r_.chance(0.5);
    std::vector<int64_t> n(ids.size(), 1);
    if (ragged) {
      for (int64_t& t : n) t = r_.chance(0.4) ? 1 : r_.between(1, 2 * pc_.block_tokens + 1);
    }
    what_ = std::string(ragged ? "step" : "decode") + " of " + std::to_string(ids.size()) + " (";
    for (size_t i = 0; i < ids.size(); ++i) {
      what_ += std::to_string(ids[i]) + ":" + std::to_string(len(ids[i])) + (ragged ? "+" + std::to_string(n[i]) : "") +
               " ";
    }
    what_.back() = ')';
    const int64_t B = static_cast<int64_t>(ids.size());
    int64_t M = 0;
    bool past_context = false;
    BlockModel after = h_.model;
    for (size_t i = 0; i < ids.size(); ++i) {
      past_context = past_context || len(ids[i]) + n[i] > context();
      after.append(ids[i], n[i]);
      M += n[i];
    }
    const int64_t needed = after.allocated_ever - h_.model.allocated_ever;
    const auto call = [&](const std::vector<float>& x, float* out) {
      if (ragged) {
        h_.block.step(h_.cache, ids.data(), n.data(), B, x.data(), out, h_.run());
      } else {
        h_.block.decode(h_.cache, ids.data(), B, x.data(), out, h_.run());
      }
    };
    if (past_context || needed > h_.model.free()) {
      ++(past_context ? reached_.refused_context : reached_.refused_pool);
      const std::vector<float> x = tokens(M);
      return refused({past_context ? ErrorCode::invalid_argument : ErrorCode::out_of_memory}, M,
                     [&](float* out) { call(x, out); });
    }
    ++(ragged ? reached_.steps : reached_.decodes);
    for (size_t i = 0; i < ids.size(); ++i) {
      reached_.longest_decode = std::max(reached_.longest_decode, len(ids[i]) + n[i]);
    }
    return accepted(ids, [&] { return ragged ? h_.step(ids, n) : h_.decode(ids); });
  }

  // Half the forks take a random prefix of the parent (a shared system prompt), cut anywhere in a block.
  ::testing::AssertionResult fork() {
    const SequenceId parent = pick_live();
    const bool prefix = r_.chance(0.5);
    const int64_t n = prefix ? r_.between(0, len(parent)) : len(parent);
    what_ = "fork " + std::to_string(parent) + " (length " + std::to_string(len(parent)) + ")" +
            (prefix ? " of its first " + std::to_string(n) : "");
    const test::BlockBytes all = test::held_blocks(h_.cache, h_.live());
    const SequenceId child = prefix ? h_.fork(parent, n) : h_.fork(parent);
    ever_.insert(child);
    ++reached_.forks;
    if (prefix) ++reached_.prefix_forks;
    if (const std::string c = test::changed_blocks(h_.cache, all); !c.empty()) return fail("forked") << c;
    return ::testing::AssertionSuccess();
  }

  // Drops a random number of a sequence's last tokens (rejected drafts): no other sequence's blocks change, and the
  // model's books (blocks given back unless shared) must equal the cache's.
  ::testing::AssertionResult truncate() {
    const SequenceId id = pick_live();
    const int64_t n = r_.chance(0.3) ? r_.between(0, len(id)) : std::max<int64_t>(0, len(id) - r_.between(1, 4));
    what_ = "truncate " + std::to_string(id) + " (length " + std::to_string(len(id)) + ") to " + std::to_string(n);
    std::vector<SequenceId> others = h_.live();
    others.erase(std::find(others.begin(), others.end(), id));
    const test::BlockBytes kept = test::held_blocks(h_.cache, others);
    h_.truncate(id, n);
    ++reached_.truncates;
    if (const std::string c = test::changed_blocks(h_.cache, kept); !c.empty()) {
      return fail("truncated") << "another sequence's blocks:" << c;
    }
    return r_.chance(0.2) ? check_reference(id, "after truncate") : ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult release() {
    const SequenceId id = pick_live();
    what_ = "release " + std::to_string(id) + " (length " + std::to_string(len(id)) + ")";
    if (r_.chance(0.25)) {
      if (auto ok = check_reference(id, "before release"); !ok) return ok;
    }
    std::vector<SequenceId> others = h_.live();
    others.erase(std::find(others.begin(), others.end(), id));
    const test::BlockBytes kept = test::held_blocks(h_.cache, others);
    h_.release(id);
    ++reached_.releases;
    released_.push_back(id);
    if (released_.size() > 8) released_.erase(released_.begin());
    if (const std::string c = test::changed_blocks(h_.cache, kept); !c.empty()) {
      return fail("released") << "another sequence's blocks:" << c;
    }
    return ::testing::AssertionSuccess();
  }

  // Calls the pool must refuse whatever its state: unknown or released ids, an id twice in one batch, a NaN or
  // infinite token.
  ::testing::AssertionResult bad_call() {
    const SequenceId bad = bad_id();
    const std::string b = std::to_string(bad);
    switch (r_.between(0, 6)) {
      case 0: {
        what_ = "extend of unknown id " + b;
        ++reached_.refused_bad_id;
        const std::vector<float> x = tokens(2);
        return refused({ErrorCode::invalid_argument}, 2,
                       [&](float* out) { h_.block.extend(h_.cache, bad, x.data(), 2, out, h_.run()); });
      }
      case 1: {
        if (h_.seqs.empty()) break;
        std::vector<SequenceId> ids = {pick_live(), bad};
        std::shuffle(ids.begin(), ids.end(), r_.g);
        what_ = "decode of a live and unknown id " + b;
        ++reached_.refused_bad_id;
        const std::vector<float> x = tokens(2);
        return refused({ErrorCode::invalid_argument}, 2,
                       [&](float* out) { h_.block.decode(h_.cache, ids.data(), 2, x.data(), out, h_.run()); });
      }
      case 6: {  // a length out of range for a live sequence
        if (h_.seqs.empty()) break;
        const SequenceId id = pick_live();
        const bool fork = r_.chance(0.5);
        const int64_t n = r_.chance(0.5) ? -r_.between(1, 3) : len(id) + r_.between(1, 3);
        what_ = std::string(fork ? "fork" : "truncate") + " of " + std::to_string(id) + " (length " +
                std::to_string(len(id)) + ") at " + std::to_string(n);
        ++reached_.refused_bad_length;
        return refused({ErrorCode::invalid_argument}, 0, [&](float*) {
          if (fork) {
            h_.cache.fork(id, n);
          } else {
            h_.cache.truncate(id, n);
          }
        });
      }
      case 2: {
        const bool fork = r_.chance(0.5);
        what_ = std::string(fork ? "fork" : "release") + " of unknown id " + b;
        ++reached_.refused_bad_id;
        return refused({ErrorCode::invalid_argument}, 0, [&](float*) {
          if (fork) {
            h_.cache.fork(bad);
          } else {
            h_.cache.release(bad);
          }
        });
      }
      case 3: {
        if (h_.seqs.empty()) break;
        const SequenceId id = pick_live();
        std::vector<SequenceId> ids = {id, id};
        for (SequenceId o : h_.live()) {
          if (o != id && r_.chance(0.3)) ids.push_back(o);
        }
        std::shuffle(ids.begin(), ids.end(), r_.g);
        what_ = "decode with id " + std::to_string(id) + " twice";
        ++reached_.refused_duplicate;
        const int64_t B = static_cast<int64_t>(ids.size());
        const std::vector<float> x = tokens(B);
        return refused({ErrorCode::invalid_argument}, B,
                       [&](float* out) { h_.block.decode(h_.cache, ids.data(), B, x.data(), out, h_.run()); });
      }
      default: {  // a non-finite token, checked before anything else
        if (h_.seqs.empty()) break;
        const SequenceId id = pick_live();
        const bool extend = r_.chance(0.5);
        const int64_t T = extend ? r_.between(1, 3) : 1;
        std::vector<float> x = tokens(T);
        x[static_cast<size_t>(r_.between(0, static_cast<int64_t>(x.size()) - 1))] =
            r_.chance(0.5) ? kNaN : -std::numeric_limits<float>::infinity();
        what_ = std::string(extend ? "extend" : "decode") + " of " + std::to_string(id) + " with a non-finite token";
        ++reached_.refused_non_finite;
        return refused({ErrorCode::invalid_argument}, T, [&](float* out) {
          if (extend) {
            h_.block.extend(h_.cache, id, x.data(), T, out, h_.run());
          } else {
            h_.block.decode(h_.cache, &id, 1, x.data(), out, h_.run());
          }
        });
      }
    }
    what_ = "fork of a live sequence (no live sequence for a bad call)";
    return h_.seqs.empty() ? create() : fork();
  }

  // ---------------------------------------------------------------------------------------------------------

  // A call the model says must be refused with one of `codes`: every live sequence bit-identical afterwards (lengths,
  // K/V, free blocks, sequence count) and its `rows` x E output untouched.
  ::testing::AssertionResult refused(std::initializer_list<ErrorCode> codes, int64_t rows,
                                     const std::function<void(float*)>& call) {
    const CacheSnapshot before = test::snapshot(h_.cache, h_.live());
    std::vector<float> out(static_cast<size_t>(std::max<int64_t>(rows, 1) * h_.E()), kSentinel);
    try {
      call(out.data());
      return fail("expected a refusal") << "accepted";
    } catch (const Error& e) {
      if (std::find(codes.begin(), codes.end(), e.code()) == codes.end()) {
        return fail("refused") << "wrong error code " << static_cast<int>(e.code()) << ": " << e.what();
      }
    } catch (const std::exception& e) {
      return fail("refused") << "threw a non-gpt2attn exception: " << e.what();
    }
    if (auto same = test::same_snapshot(before, test::snapshot(h_.cache, h_.live())); !same) {
      return fail("refused") << "the refused call changed the cache: " << same.message();
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (std::memcmp(&out[i], &kSentinel, sizeof(float)) != 0) {
        return fail("refused") << "the refused call wrote out[" << i << "] = " << out[i];
      }
    }
    return ::testing::AssertionSuccess();
  }

  // An append the model says must be accepted: it must not throw, its outputs are finite (the harness hands the
  // layer a NaN-filled buffer), no block of another sequence changed, and its own sequences' earlier tokens are
  // bit-identical (a copy on write copies exactly).
  ::testing::AssertionResult accepted(const std::vector<SequenceId>& ids,
                                      const std::function<std::vector<float>()>& call) {
    std::vector<SequenceId> others;
    for (SequenceId id : h_.live()) {
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) others.push_back(id);
    }
    for (SequenceId id : ids) reached_.copy_on_write += len(id) > 0 && h_.model.cow(id);
    const test::BlockBytes kept = test::held_blocks(h_.cache, others);
    const CacheSnapshot own = test::snapshot(h_.cache, ids);
    std::vector<float> out;
    try {
      out = call();
    } catch (const std::exception& e) {
      return fail("expected acceptance") << "refused: " << e.what();
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) return fail("accepted") << "out[" << i << "] = " << out[i];
    }
    if (const std::string c = test::changed_blocks(h_.cache, kept); !c.empty()) {
      return fail("accepted") << "another sequence's blocks:" << c;
    }
    const CacheSnapshot now = test::snapshot(h_.cache, ids);
    for (SequenceId id : ids) {
      const std::vector<float>& a = own.kv.at(id);
      // Bitwise; an empty sequence has no data pointer to give memcmp.
      if (!a.empty() && std::memcmp(a.data(), now.kv.at(id).data(), a.size() * sizeof(float)) != 0) {
        return fail("accepted") << "sequence " << id << "'s earlier tokens changed";
      }
    }
    return ::testing::AssertionSuccess();
  }
};

// =============================================================================================================

class KvSoak : public test::IsaTest {};

TEST_P(KvSoak, RandomOperationsKeepTheBooks) {
  const SoakSettings s = soak_settings();
  ASSERT_TRUE(s.error.empty()) << s.error;
  const int64_t mine = share_of(s.ops, isa());
  const std::vector<PoolConfig> configs = pool_configs();
  const int64_t n = static_cast<int64_t>(configs.size());
  for (int64_t c = 0; c < n; ++c) {
    const int64_t ops = (c + 1) * mine / n - c * mine / n;
    const auto start = std::chrono::steady_clock::now();
    Soak soak(configs[c], isa(), s.seed + 1000 * static_cast<uint64_t>(isa()) + static_cast<uint64_t>(c));
    const ::testing::AssertionResult ok = soak.run(ops);
    ASSERT_TRUE(ok) << "\n  replay: " << replay_line(s);
    const Reached& r = soak.reached();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "[ soak     ] " << to_string(isa()) << " " << configs[c].name << ": " << ops << " ops in " << seconds
              << " s: " << r.creates << " creates, " << r.extends << " extends, " << r.decodes << " decodes, "
              << r.steps << " ragged steps, "
              << r.forks << " forks (" << r.prefix_forks << " of a prefix), " << r.truncates << " truncates, "
              << r.releases << " releases, " << r.copy_on_write << " copies on write; "
              << "refused: " << r.refused_pool << " pool exhausted, " << r.refused_context << " past context, "
              << r.refused_bad_id << " unknown id, " << r.refused_duplicate << " duplicate id, "
              << r.refused_non_finite << " non-finite, " << r.refused_bad_length << " bad length; pool full "
              << r.pool_full << " times, "
              << soak.model().allocated_ever << " block allocations of " << soak.model().total << " blocks, "
              << r.reference_checks << " reference checks, longest decode " << r.longest_decode << " tokens\n";
    // The stream must reach what it claims to (checked once a run is long enough to make each near-certain).
    if (ops >= 400) {
      for (const auto& [count, what] : std::vector<std::pair<int64_t, const char*>>{
               {r.forks, "forks"},
               {r.steps, "ragged steps"},
               {r.prefix_forks, "forks of a prefix"},
               {r.truncates, "truncates"},
               {r.refused_bad_length, "refusals of a length out of range"},
               {r.copy_on_write, "copies on write"},
               {r.refused_pool, "refusals for an exhausted pool"},
               {r.refused_context, "refusals past the context length"},
               {r.refused_bad_id, "refusals of unknown ids"},
               {r.refused_duplicate, "refusals of a repeated id"},
               {r.refused_non_finite, "refusals of non-finite tokens"},
               {r.pool_full, "operations that left the pool full"},
               {r.reference_checks, "reference checks"}}) {
        EXPECT_GE(count, 1) << soak.label() << ": the soak never reached " << what;
      }
      EXPECT_GT(soak.model().allocated_ever, 3 * soak.model().total) << soak.label() << ": blocks were barely reused";
      if (configs[c].cfg.context_length > 256) {
        EXPECT_GT(r.longest_decode, 256) << soak.label() << ": no decode reached the lengths where keys are split";
      }
    }
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, KvSoak);

}  // namespace
}  // namespace gpt2attn
