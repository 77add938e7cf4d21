// tests/mpi/test_sharded.cpp: ShardedAttention and ShardedKvCache (gpt2attn/parallel.hpp) under mpiexec. Every rank
// builds the single-process layer from the same full weights and compares the sharded result with it at the f32
// policy (tests/tolerance.hpp); bad input on one rank must give every rank the same Error, after which the layer
// and the cache still work. Run by ctest as mpi.sharded.npN (tests/mpi/CMakeLists.txt); not a benchmark.
//
// Collective discipline in the tests themselves: a check that fails on one rank must not make that rank skip a
// collective the others enter, so around sharded calls only EXPECT_* is used (never ASSERT_*), and every helper
// that can fail on one rank returns instead of throwing. A rank that does hang is ended by the per-test watchdog
// (SIGALRM), naming the test, rather than by ctest's timeout.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/parallel.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

namespace fs = std::filesystem;
using test::OwnedInputs;
using test::OwnedTensor;

int g_rank = 0, g_size = 1;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSentinel = -12345.5f;
constexpr EngineOptions kOneThread{.threads = 1};
constexpr RunOptions kRun{.threads = 1};

// =============================================================================================================
// MPI helpers. Every one is collective over `comm`.

int comm_size(MPI_Comm comm) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  return n;
}
int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

// Every rank's string, in rank order, on every rank (so every rank makes the same EXPECT).
std::vector<std::string> allgather_strings(const std::string& s, MPI_Comm comm = MPI_COMM_WORLD) {
  const int n = comm_size(comm);
  int len = static_cast<int>(s.size());
  std::vector<int> lens(n), displs(n);
  MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm);
  int total = 0;
  for (int r = 0; r < n; ++r) displs[r] = total, total += lens[r];
  std::string all(static_cast<size_t>(total), '\0');
  MPI_Allgatherv(s.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, comm);
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.push_back(all.substr(displs[r], lens[r]));
  return out;
}

std::vector<int64_t> allgather_i64(int64_t v, MPI_Comm comm = MPI_COMM_WORLD) {
  std::vector<int64_t> all(comm_size(comm));
  MPI_Allgather(&v, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, comm);
  return all;
}

// True when `v` is the same on every rank.
bool same_on_every_rank(int64_t v, MPI_Comm comm = MPI_COMM_WORLD) {
  const auto all = allgather_i64(v, comm);
  return std::all_of(all.begin(), all.end(), [&](int64_t x) { return x == all[0]; });
}

uint64_t fnv1a(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

// The bytes of an output are the same on every rank (a server samples the next token from it on each rank).
::testing::AssertionResult bitwise_same_on_every_rank(const std::vector<float>& v, MPI_Comm comm,
                                                      const std::string& what) {
  const uint64_t h = fnv1a(v.data(), v.size() * sizeof(float));
  const auto all = allgather_i64(static_cast<int64_t>(h), comm);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      return ::testing::AssertionFailure() << what << ": the output differs between rank 0 and rank " << r
                                           << " (each rank must hold the same (B, T, E) output)";
    }
  }
  return ::testing::AssertionSuccess();
}

// What one call did on this rank: "ok", "error <code>: <what>" or "other exception: <what>".
std::string outcome_of(const std::function<void()>& f) {
  try {
    f();
    return "ok";
  } catch (const Error& e) {
    return "error " + std::to_string(static_cast<int>(e.code())) + ": " + e.what();
  } catch (const std::exception& e) {
    return std::string("other exception: ") + e.what();
  }
}

struct AgreedError {
  int code = 0;
  std::string message;  // what()
};

// f must throw gpt2attn::Error with the same code and message on every rank of comm.
::testing::AssertionResult same_error_on_every_rank(const std::function<void()>& f, MPI_Comm comm,
                                                    AgreedError* agreed = nullptr) {
  const std::vector<std::string> all = allgather_strings(outcome_of(f), comm);
  bool ok = all[0].rfind("error ", 0) == 0;
  for (const std::string& s : all) ok = ok && s == all[0];
  if (!ok) {
    auto fail = ::testing::AssertionFailure() << "expected the same gpt2attn::Error on every rank; got:";
    for (size_t r = 0; r < all.size(); ++r) fail << "\n    rank " << r << ": " << all[r];
    return fail;
  }
  if (agreed) {
    const size_t colon = all[0].find(": ");
    agreed->code = std::atoi(all[0].c_str() + 6);
    agreed->message = all[0].substr(colon + 2);
  }
  return ::testing::AssertionSuccess() << all[0];
}

// The single-process layer's message for the same bad call (what the sharded one must relay, prefixed).
std::string single_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<the single-process call did not fail>";
}

// A sharded error relays the failing rank's own message prefixed "rank r: " (parallel.hpp); the call's name may open
// it ("decode: rank r: ..."). `single` is the single-process layer's message for the same bad input, or empty when
// only the rank prefix is checked.
// "[call: ]rank r: <single>", where a single-process message that already starts with the call's name keeps it
// once: "extend: rank 0: T=17 ..." relays "extend: T=17 ...".
::testing::AssertionResult relays(const std::string& message, int rank, const std::string& single = "") {
  const std::string tail = "rank " + std::to_string(rank) + ": " + single;
  const bool exact = single.empty() ? message.rfind(tail, 0) == 0 : message == tail;
  const size_t at = message.find(": " + tail);
  const bool after_call = at != std::string::npos && (single.empty() || at + 2 + tail.size() == message.size());
  const size_t colon = single.find(": ");
  const bool call_once = colon != std::string::npos &&
                         message == single.substr(0, colon) + ": rank " + std::to_string(rank) + ": " +
                                        single.substr(colon + 2);
  if (exact || after_call || call_once) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected \"[call: ]" << tail << (single.empty() ? "...\"" : "\"")
                                       << ", got \"" << message << "\"";
}

// =============================================================================================================
// The fixture: a watchdog per test, and a test that failed on any rank fails on rank 0 too (whose printer is the
// only verbose one).

char g_watchdog_msg[512];
unsigned g_watchdog_s = 150;  // GPT2ATTN_MPI_TEST_WATCHDOG_S overrides

extern "C" void on_watchdog(int) {
  const ssize_t n = ::write(STDERR_FILENO, g_watchdog_msg, std::strlen(g_watchdog_msg));
  (void)n;
  std::_Exit(3);
}

class Sharded : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::snprintf(g_watchdog_msg, sizeof g_watchdog_msg,
                  "\n[rank %d] WATCHDOG: %s.%s did not finish within %u s: a rank is waiting in a collective the "
                  "others never reached (or never returned from one)\n",
                  g_rank, info->test_suite_name(), info->name(), g_watchdog_s);
    std::signal(SIGALRM, on_watchdog);
    alarm(g_watchdog_s);
  }
  void TearDown() override {
    const auto failed = allgather_i64(HasFailure() ? 1 : 0);
    alarm(0);
    if (g_rank != 0) return;
    std::ostringstream others;
    for (int r = 1; r < g_size; ++r) {
      if (failed[r]) others << " " << r;
    }
    if (!others.str().empty()) ADD_FAILURE() << "this test failed on rank(s)" << others.str() << " (see their output)";
  }
};

// =============================================================================================================
// Configs, inputs and the comparison.

struct ConfigSpec {
  int64_t E = 64, H = 8, H_kv = 0, d_in = 0, kdim = 0, vdim = 0, context = 128;
  bool causal = false, qkv_bias = true, out_bias = true;
  float dropout = 0;
};

Config make_config(const ConfigSpec& s) {
  Config c;
  c.d_model = s.E;
  c.num_heads = s.H;
  c.num_kv_heads = s.H_kv;
  c.d_in = s.d_in;
  c.kdim = s.kdim;
  c.vdim = s.vdim;
  c.context_length = s.context;
  c.causal = s.causal;
  c.qkv_bias = s.qkv_bias;
  c.out_bias = s.out_bias;
  c.dropout = s.dropout;
  return c;
}

// The config fields a sharded layer must report as the full layer's.
::testing::AssertionResult same_config(const Config& got, const Config& want) {
  if (got.d_model == want.d_model && got.num_heads == want.num_heads && got.kv_heads() == want.kv_heads() &&
      got.query_width() == want.query_width() && got.key_width() == want.key_width() &&
      got.value_width() == want.value_width() && got.context_length == want.context_length &&
      got.qkv_bias == want.qkv_bias && got.out_bias == want.out_bias && got.causal == want.causal &&
      got.dropout == want.dropout) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "config() is " << to_json(got) << ", expected the full layer's "
                                       << to_json(want);
}

OwnedTensor random_tensor(const std::vector<int64_t>& shape, std::mt19937_64& rng, float lo = -1, float hi = 1) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return test::make_tensor(test::random_uniform(static_cast<size_t>(n), rng, lo, hi), shape, DType::f32);
}

enum class MaskShape { t_tk, b_t_tk, b_h_t_tk, b_h_t_tk_broadcast_h, b_h_t_tk_strided };
const char* to_string(MaskShape s) {
  switch (s) {
    case MaskShape::t_tk: return "(T, Tk)";
    case MaskShape::b_t_tk: return "(B, T, Tk)";
    case MaskShape::b_h_t_tk: return "(B, H, T, Tk)";
    case MaskShape::b_h_t_tk_broadcast_h: return "(B, H, T, Tk) H broadcast";
    case MaskShape::b_h_t_tk_strided: return "(B, H, T, Tk) strided";
  }
  return "?";
}

// A mask whose values differ per head (the per-head shapes are the ones sharding slices): keep: nonzero w.p. 3/4;
// block: nonzero w.p. 1/4; additive: uniform [-2, 1), -inf w.p. 1/5.
OwnedTensor make_mask(MaskKind kind, DType dt, MaskShape shape, int64_t B, int64_t H, int64_t T, int64_t Tk,
                      std::mt19937_64& rng) {
  std::vector<int64_t> dims;
  test::Layout layout;
  switch (shape) {
    case MaskShape::t_tk: dims = {T, Tk}; break;
    case MaskShape::b_t_tk: dims = {B, T, Tk}; break;
    case MaskShape::b_h_t_tk: dims = {B, H, T, Tk}; break;
    case MaskShape::b_h_t_tk_broadcast_h: dims = {B, H, T, Tk}, layout.broadcast[1] = true; break;
    case MaskShape::b_h_t_tk_strided: dims = {B, H, T, Tk}, layout.pad = {3, 2, 1, 0}, layout.elem_stride = 2; break;
  }
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const float r = u(rng);
    if (kind == MaskKind::keep) x = r < 0.75f ? 1.0f : 0.0f;
    if (kind == MaskKind::block) x = r < 0.25f ? 1.0f : 0.0f;
    if (kind == MaskKind::additive) x = r < 0.2f ? -std::numeric_limits<float>::infinity() : u(rng) * 3 - 2;
  }
  return test::make_tensor(v, dims, dt, layout);
}

OwnedTensor make_key_padding(DType dt, int64_t B, int64_t Tk, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<float> v(static_cast<size_t>(B * Tk));
  for (float& x : v) x = u(rng) < 0.2f ? 1.0f : 0.0f;
  return test::make_tensor(v, {B, Tk}, dt);
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::string label(const Config& c, const std::string& what) {
  std::ostringstream s;
  s << "[rank " << g_rank << "/" << g_size << "] " << what << " | " << test::describe(c);
  return s.str();
}

// Runs the single-process layer and the sharded one on the same inputs; the sharded output must match at the f32
// policy (reduction length max(d_in, kdim, vdim, E, Tk)) and be the same bytes on every rank.
::testing::AssertionResult sharded_matches(MultiHeadAttention& single, ShardedAttention& sharded,
                                           const AttentionInputs& in, const RunOptions& run, const std::string& what,
                                           MPI_Comm comm = MPI_COMM_WORLD, DType policy = DType::f32) {
  const Config& c = single.config();
  const int64_t B = in.query.shape[0], T = in.query.shape[1];
  const int64_t Tk = in.key.empty() ? T : in.key.shape[1];
  std::vector<float> expected;
  const std::string single_outcome = outcome_of([&] { expected = test::run_fast(single, in, run); });
  std::vector<float> got(static_cast<size_t>(B * T * c.d_model), kNaN);
  const std::string sharded_outcome = outcome_of([&] { sharded.forward(in, got.data(), run); });
  if (single_outcome != "ok") return ::testing::AssertionFailure() << label(c, what) << ": single-process layer: "
                                                                   << single_outcome;
  if (sharded_outcome != "ok") return ::testing::AssertionFailure() << label(c, what) << ": sharded layer: "
                                                                    << sharded_outcome;
  auto close = test::all_close(got, to_double(expected), policy, test::reduction_length(c, Tk), label(c, what));
  if (!close) return close;
  return bitwise_same_on_every_rank(got, comm, label(c, what));
}

// The heads rank r of n owns: K/V heads split as evenly as possible, the first ranks one more (parallel.hpp).
std::pair<int64_t, int64_t> expected_kv_split(int64_t H_kv, int r, int n) {
  const int64_t base = H_kv / n, extra = H_kv % n;
  const int64_t count = base + (r < extra ? 1 : 0);
  const int64_t first = r * base + std::min<int64_t>(r, extra);
  return {first, count};
}

// ranks(), rank(), the head ranges (contiguous, covering every head once, split by K/V head) and config().
void expect_accessors(const ShardedAttention& s, const Config& full, MPI_Comm comm) {
  const int n = comm_size(comm), r = comm_rank(comm);
  EXPECT_EQ(s.ranks(), n);
  EXPECT_EQ(s.rank(), r);
  EXPECT_TRUE(same_config(s.config(), full));
  const int64_t g = full.num_heads / full.kv_heads();
  const auto [first_kv, kv] = expected_kv_split(full.kv_heads(), r, n);
  EXPECT_EQ(s.first_kv_head(), first_kv) << "rank " << r << " of " << n;
  EXPECT_EQ(s.kv_heads(), kv) << "rank " << r << " of " << n;
  EXPECT_EQ(s.first_head(), first_kv * g) << "rank " << r << " of " << n;
  EXPECT_EQ(s.heads(), kv * g) << "rank " << r << " of " << n;
  // Independent of the formula above: the ranges tile [0, H) and [0, H_kv) in rank order.
  int64_t heads = s.heads(), sum = 0, before = 0;
  MPI_Allreduce(&heads, &sum, 1, MPI_INT64_T, MPI_SUM, comm);
  MPI_Exscan(&heads, &before, 1, MPI_INT64_T, MPI_SUM, comm);
  if (r == 0) before = 0;  // MPI_Exscan leaves rank 0's result undefined
  EXPECT_EQ(sum, full.num_heads);
  EXPECT_EQ(s.first_head(), before);
  int64_t kv_heads = s.kv_heads(), kv_sum = 0;
  MPI_Allreduce(&kv_heads, &kv_sum, 1, MPI_INT64_T, MPI_SUM, comm);
  EXPECT_EQ(kv_sum, full.kv_heads());
  EXPECT_GE(s.kv_heads(), 1);
}

// Owned inputs of one forward call: self-attention (key empty) unless Tk > 0.
OwnedInputs make_inputs(const Config& c, int64_t B, int64_t T, int64_t Tk, std::mt19937_64& rng) {
  OwnedInputs in;
  in.query = random_tensor({B, T, c.query_width()}, rng);
  if (Tk > 0) {
    in.key = random_tensor({B, Tk, c.key_width()}, rng);
    in.value = random_tensor({B, Tk, c.value_width()}, rng);
  }
  return in;
}

// A full layer, single and sharded over comm, from Weights::random(config, seed).
struct LayerPair {
  Config config;
  Weights weights;
  MultiHeadAttention single;
  ShardedAttention sharded;
  LayerPair(const Config& c, uint64_t seed, MPI_Comm comm = MPI_COMM_WORLD, EngineOptions eo = kOneThread)
      : config(c),
        weights(Weights::random(c, seed)),
        single(c, weights.view(c), eo),
        sharded(c, weights.view(c), comm, eo) {}
};

// =============================================================================================================
// forward

class ShardedForward : public Sharded {};

TEST_F(ShardedForward, CausalSelfAttention) {
  for (const auto& [qkv_bias, out_bias] :
       std::initializer_list<std::pair<bool, bool>>{{true, true}, {false, false}, {true, false}, {false, true}}) {
    const Config c = make_config({.E = 64, .H = 8, .context = 160, .causal = true, .qkv_bias = qkv_bias,
                                  .out_bias = out_bias});
    LayerPair p(c, 11);
    std::mt19937_64 rng(1);
    for (const auto& [B, T] : std::initializer_list<std::pair<int64_t, int64_t>>{{2, 19}, {1, 1}, {3, 64}, {1, 130}}) {
      const OwnedInputs in = make_inputs(c, B, T, 0, rng);
      EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun,
                                  "causal B=" + std::to_string(B) + " T=" + std::to_string(T)));
    }
  }
}

TEST_F(ShardedForward, CausalSelfAttentionLayerAsSingle) {  // CausalSelfAttention::forward as the single process
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  const Weights w = Weights::random(c, 12);
  CausalSelfAttention single(c, w.view(c), kOneThread);
  ShardedAttention sharded(c, w.view(c), MPI_COMM_WORLD, kOneThread);
  std::mt19937_64 rng(2);
  const OwnedInputs in = make_inputs(c, 2, 23, 0, rng);
  std::vector<float> expected(2 * 23 * 64), got(2 * 23 * 64, kNaN);
  single.forward(in.query.f32.data(), 2, 23, expected.data(), kRun);
  EXPECT_NO_THROW(sharded.forward(in.inputs(), got.data(), kRun));
  EXPECT_TRUE(test::all_close(got, to_double(expected), DType::f32, test::reduction_length(c, 23), label(c, "csa")));
}

TEST_F(ShardedForward, EveryMaskKindDtypeAndShape) {
  const Config c = make_config({.E = 64, .H = 8});
  LayerPair p(c, 21);
  std::mt19937_64 rng(3);
  const int64_t B = 2, T = 9;
  for (const int64_t Tk : {int64_t{0}, int64_t{13}}) {  // self-attention, and cross with Tk != T
    const int64_t keys = Tk ? Tk : T;
    for (const auto& [kind, dt] : std::initializer_list<std::pair<MaskKind, DType>>{
             {MaskKind::keep, DType::u8}, {MaskKind::block, DType::u8}, {MaskKind::keep, DType::f32},
             {MaskKind::block, DType::f32}, {MaskKind::additive, DType::f32}}) {
      for (const MaskShape shape : {MaskShape::t_tk, MaskShape::b_t_tk, MaskShape::b_h_t_tk,
                                    MaskShape::b_h_t_tk_broadcast_h, MaskShape::b_h_t_tk_strided}) {
        OwnedInputs in = make_inputs(c, B, T, Tk, rng);
        in.attn_mask = make_mask(kind, dt, shape, B, c.num_heads, T, keys, rng);
        in.mask_kind = kind;
        std::ostringstream what;
        what << "mask " << gpt2attn::to_string(kind) << " " << gpt2attn::to_string(dt) << " " << to_string(shape)
             << " Tk=" << keys;
        EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, what.str()));
        // The same mask with a key-padding mask on top, in both of its dtypes.
        in.key_padding = make_key_padding(dt == DType::u8 ? DType::f32 : DType::u8, B, keys, rng);
        EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, what.str() + " + key_padding"));
      }
    }
  }
}

TEST_F(ShardedForward, KeyPaddingAlone) {
  const Config c = make_config({.E = 64, .H = 8});
  LayerPair p(c, 22);
  std::mt19937_64 rng(4);
  for (const DType dt : {DType::u8, DType::f32}) {
    OwnedInputs in = make_inputs(c, 3, 7, 11, rng);
    in.key_padding = make_key_padding(dt, 3, 11, rng);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun,
                                std::string("key_padding ") + gpt2attn::to_string(dt)));
  }
}

// A row with every key masked gives attention output 0, so the layer output is b_o (0 without an output bias); a
// row masked on some heads only (heads of different ranks) is an ordinary row.
TEST_F(ShardedForward, FullyMaskedRows) {
  for (const bool out_bias : {false, true}) {
    const Config c = make_config({.E = 64, .H = 8, .out_bias = out_bias});
    LayerPair p(c, 23);
    std::mt19937_64 rng(5);
    const int64_t B = 2, T = 5, Tk = 6, H = c.num_heads, E = c.d_model;
    OwnedInputs in = make_inputs(c, B, T, Tk, rng);
    std::vector<float> block(static_cast<size_t>(B * H * T * Tk), 0.0f);
    auto at = [&](int64_t b, int64_t h, int64_t i, int64_t j) -> float& {
      return block[static_cast<size_t>(((b * H + h) * T + i) * Tk + j)];
    };
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < Tk; ++j) at(1, h, 2, j) = 1;  // (b=1, i=2): every head, every key
    }
    for (int64_t j = 0; j < Tk; ++j) at(0, H - 1, 3, j) = 1, at(0, 0, 4, j) = 1;  // one head's row only
    in.attn_mask = test::make_tensor(block, {B, H, T, Tk}, DType::u8);
    in.mask_kind = MaskKind::block;
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "partly and fully masked rows"));

    std::vector<float> got(static_cast<size_t>(B * T * E), kNaN);
    EXPECT_NO_THROW(p.sharded.forward(in.inputs(), got.data(), kRun));
    for (int64_t e = 0; e < E; ++e) {
      const float want = out_bias ? p.weights.b_o[e] : 0.0f;
      EXPECT_EQ(got[static_cast<size_t>((1 * T + 2) * E + e)], want) << "fully masked row, column " << e;
    }

    // Every key of batch 0 padded: all of batch 0's rows are fully masked.
    std::vector<float> kp(static_cast<size_t>(B * Tk), 0.0f);
    for (int64_t j = 0; j < Tk; ++j) kp[j] = 1;
    OwnedInputs in2 = make_inputs(c, B, T, Tk, rng);
    in2.key_padding = test::make_tensor(kp, {B, Tk}, DType::u8);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in2.inputs(), kRun, "batch 0 all padding"));
    EXPECT_NO_THROW(p.sharded.forward(in2.inputs(), got.data(), kRun));
    for (int64_t i = 0; i < T * E; ++i) {
      EXPECT_EQ(got[static_cast<size_t>(i)], out_bias ? p.weights.b_o[i % E] : 0.0f) << "batch 0 element " << i;
    }
  }
}

TEST_F(ShardedForward, CrossAttentionOtherInputWidths) {
  for (const bool bias : {true, false}) {
    const Config c = make_config({.E = 64, .H = 8, .d_in = 48, .kdim = 40, .vdim = 56, .qkv_bias = bias,
                                  .out_bias = bias});
    LayerPair p(c, 24);
    std::mt19937_64 rng(6);
    OwnedInputs in = make_inputs(c, 2, 7, 13, rng);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "cross T=7 Tk=13"));
    in.attn_mask = make_mask(MaskKind::additive, DType::f32, MaskShape::b_h_t_tk, 2, 8, 7, 13, rng);
    in.mask_kind = MaskKind::additive;
    in.key_padding = make_key_padding(DType::u8, 2, 13, rng);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "cross, per-head mask, key padding"));
    // Strided query/key/value views.
    OwnedInputs strided;
    test::Layout layout;
    layout.pad = {5, 3, 0, 0};
    strided.query = test::make_tensor(in.query.f32, {2, 7, 48}, DType::f32, layout);
    strided.key = test::make_tensor(in.key.f32, {2, 13, 40}, DType::f32, layout);
    strided.value = test::make_tensor(in.value.f32, {2, 13, 56}, DType::f32, layout);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, strided.inputs(), kRun, "cross, strided views"));
  }
}

// Dropout draws are indexed by the full layer's head ((b*H + h)*T + i)*Tk + j, so a rank's heads draw what the
// single-process layer draws for them.
TEST_F(ShardedForward, TrainingDropoutMatchesSingleProcess) {
  for (const bool causal : {false, true}) {
    const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = causal, .dropout = 0.1f});
    LayerPair p(c, 25);
    std::mt19937_64 rng(7);
    OwnedInputs in = make_inputs(c, 2, 17, 0, rng);
    if (!causal) {
      in.attn_mask = make_mask(MaskKind::keep, DType::u8, MaskShape::b_h_t_tk, 2, 8, 17, 17, rng);
      in.mask_kind = MaskKind::keep;
    }
    const std::string what = causal ? "dropout, causal" : "dropout, per-head mask";
    for (const uint64_t seed : {uint64_t{1234}, uint64_t{99}}) {
      const RunOptions train{.threads = 1, .training = true, .dropout_seed = seed};
      EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), train, what + " seed " + std::to_string(seed)));
    }
    // ... and dropout really happened: training differs from inference.
    std::vector<float> train(2 * 17 * 64, kNaN), eval(2 * 17 * 64, kNaN);
    EXPECT_NO_THROW(p.sharded.forward(in.inputs(), train.data(), {.threads = 1, .training = true, .dropout_seed = 5}));
    EXPECT_NO_THROW(p.sharded.forward(in.inputs(), eval.data(), kRun));
    double diff = 0;
    for (size_t i = 0; i < train.size(); ++i) diff = std::max(diff, std::fabs(double(train[i]) - eval[i]));
    EXPECT_GT(diff, 1e-3) << what << ": training output equals inference output (no dropout?)";
  }
}

TEST_F(ShardedForward, Bf16Compute) {
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  LayerPair p(c, 26, MPI_COMM_WORLD, {.threads = 1, .compute = DType::bf16});
  std::mt19937_64 rng(8);
  const OwnedInputs in = make_inputs(c, 2, 21, 0, rng);
  EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "bf16 compute", MPI_COMM_WORLD, DType::bf16));
}

TEST_F(ShardedForward, RandomFactoryHasWeightsRandomValues) {
  for (const int64_t H_kv : {int64_t{0}, int64_t{4}}) {
    if (H_kv && H_kv < g_size) continue;
    const Config c = make_config({.E = 64, .H = 8, .H_kv = H_kv, .context = 64, .causal = true});
    const Weights w = Weights::random(c, 31);
    MultiHeadAttention single(c, w.view(c), kOneThread);
    ShardedAttention sharded = ShardedAttention::random(c, 31, MPI_COMM_WORLD, kOneThread);
    expect_accessors(sharded, c, MPI_COMM_WORLD);
    std::mt19937_64 rng(9);
    const OwnedInputs in = make_inputs(c, 2, 30, 0, rng);
    EXPECT_TRUE(sharded_matches(single, sharded, in.inputs(), kRun, "ShardedAttention::random"));
  }
}

// =============================================================================================================
// uneven head splits and grouped K/V heads

class ShardedUneven : public Sharded {};

void run_uneven_case(const ConfigSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ConfigSpec causal_spec = spec;
  causal_spec.causal = true;
  const Config c = make_config(causal_spec);
  LayerPair p(c, seed);
  expect_accessors(p.sharded, c, MPI_COMM_WORLD);
  if (c.same_input_widths()) {  // causal self-attention
    const OwnedInputs in = make_inputs(c, 1, 33, 0, rng);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "uneven causal"));
  } else {  // causal cross-attention, bottom-right aligned
    const OwnedInputs in = make_inputs(c, 1, 9, 21, rng);
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "uneven causal cross"));
  }

  const Config nc = make_config(spec);
  LayerPair q(nc, seed + 1);
  OwnedInputs in2 = make_inputs(nc, 2, 6, 10, rng);
  in2.attn_mask = make_mask(MaskKind::block, DType::u8, MaskShape::b_h_t_tk, 2, nc.num_heads, 6, 10, rng);
  in2.mask_kind = MaskKind::block;
  in2.key_padding = make_key_padding(DType::u8, 2, 10, rng);
  EXPECT_TRUE(sharded_matches(q.single, q.sharded, in2.inputs(), kRun, "uneven, per-head mask"));
  const RunOptions train{.threads = 1, .training = true, .dropout_seed = 3};
  ConfigSpec drop_spec = spec;
  drop_spec.dropout = 0.2f;
  const Config dc = make_config(drop_spec);
  LayerPair d(dc, seed + 2);
  EXPECT_TRUE(sharded_matches(d.single, d.sharded, in2.inputs(), train, "uneven, per-head mask, dropout"));
}

TEST_F(ShardedUneven, H25OfWidth100) {  // gpt2-xl's head count (D = 4): 13 + 12 on 2 ranks, 9 + 8 + 8 on 3
  run_uneven_case({.E = 100, .H = 25}, 41);
}

TEST_F(ShardedUneven, H12OnFiveRanks) {
  if (g_size != 5) GTEST_SKIP() << "needs a world of 5 ranks (mpi.sharded.np5)";
  run_uneven_case({.E = 96, .H = 12}, 42);
}

TEST_F(ShardedUneven, GroupedKvHeadsStayWhole) {  // H = 8 over H_kv = 4: groups of 2 query heads per K/V head
  if (g_size > 4) GTEST_SKIP() << "4 K/V heads serve at most 4 ranks";
  run_uneven_case({.E = 64, .H = 8, .H_kv = 4}, 43);
  run_uneven_case({.E = 64, .H = 8, .H_kv = 4, .d_in = 40, .kdim = 24, .vdim = 72}, 44);
}

TEST_F(ShardedUneven, MultiQuerySingleKvHead) {  // H_kv = 1: only a world of 1 can hold it
  if (g_size != 1) GTEST_SKIP() << "one K/V head serves one rank (the refusal is ShardedErrors.MoreRanksThanKvHeads)";
  run_uneven_case({.E = 64, .H = 8, .H_kv = 1}, 45);
}

// =============================================================================================================
// accessors, moves and a sub-communicator

class ShardedAccessors : public Sharded {};

TEST_F(ShardedAccessors, RanksHeadsConfigIsaTimes) {
  const Config c = make_config({.E = 64, .H = 8, .d_in = 48, .context = 80, .causal = true, .out_bias = false,
                                .dropout = 0.25f});
  LayerPair p(c, 51);
  expect_accessors(p.sharded, c, MPI_COMM_WORLD);
  EXPECT_EQ(p.sharded.isa(), p.single.isa());
  EXPECT_FALSE(p.sharded.implementation().empty());
  std::mt19937_64 rng(10);
  const OwnedInputs in = make_inputs(c, 2, 40, 0, rng);
  std::vector<float> out(2 * 40 * 64);
  EXPECT_NO_THROW(p.sharded.forward(in.inputs(), out.data(), kRun));
  const ShardedCallTimes t = p.sharded.last_call_times();
  EXPECT_GT(t.compute_s, 0.0);
  EXPECT_GE(t.allreduce_s, 0.0);
  EXPECT_LT(t.compute_s + t.allreduce_s, 60.0);
}

TEST_F(ShardedAccessors, MovedLayerAndCacheStillWork) {
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  LayerPair p(c, 52);
  ShardedAttention moved(std::move(p.sharded));
  ShardedAttention assigned = ShardedAttention::random(make_config({.E = 32, .H = 4, .causal = true}), 1,
                                                       MPI_COMM_WORLD, kOneThread);
  assigned = std::move(moved);
  expect_accessors(assigned, c, MPI_COMM_WORLD);
  std::mt19937_64 rng(11);
  const OwnedInputs in = make_inputs(c, 1, 12, 0, rng);
  EXPECT_TRUE(sharded_matches(p.single, assigned, in.inputs(), kRun, "moved layer"));
  ShardedKvCache cache(assigned, {.block_tokens = 8, .capacity_tokens = 64});
  ShardedKvCache cache2(std::move(cache));
  const SequenceId s = cache2.create();
  std::vector<float> out(12 * 64);
  EXPECT_NO_THROW(assigned.extend(cache2, s, in.query.f32.data(), 12, out.data(), kRun));
  EXPECT_EQ(cache2.length(s), 12);
}

// A layer over a communicator other than MPI_COMM_WORLD (the world split in two halves, each its own layer): the
// module must use the communicator it is given.
TEST_F(ShardedAccessors, SubCommunicators) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 ranks or more";
  MPI_Comm half;
  const int color = g_rank % 2;
  MPI_Comm_split(MPI_COMM_WORLD, color, g_rank, &half);
  {
    const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
    LayerPair p(c, 60 + color, half);
    expect_accessors(p.sharded, c, half);
    std::mt19937_64 rng(12 + color);
    const OwnedInputs in = make_inputs(c, 2, 15 + color, 0, rng);  // the halves make different calls
    EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "half " + std::to_string(color), half));
    ShardedKvCache cache(p.sharded, {.block_tokens = 8, .capacity_tokens = 64});
    const SequenceId s = cache.create();
    std::vector<float> out(static_cast<size_t>(15 + color) * 64);
    EXPECT_NO_THROW(p.sharded.extend(cache, s, in.query.f32.data(), 15 + color, out.data(), kRun));
  }
  MPI_Comm_free(&half);
}

// =============================================================================================================
// serving: a sharded cache against the single-process cache doing the same operations

struct ServingPair {
  Config config;
  Weights weights;
  CausalSelfAttention single;
  KvCache cache;
  ShardedAttention sharded;
  ShardedKvCache scache;
  std::mt19937_64 rng;
  MPI_Comm comm;
  DType kv_dtype;

  ServingPair(const Config& c, uint64_t seed, const KvCacheOptions& kv, MPI_Comm comm_ = MPI_COMM_WORLD)
      : config(c),
        weights(Weights::random(c, seed)),
        single(c, weights.view(c), kOneThread),
        cache(c, kv),
        sharded(c, weights.view(c), comm_, kOneThread),
        scache(sharded, kv),
        rng(seed),
        comm(comm_),
        kv_dtype(kv.dtype) {}

  // The f32 policy, plus the storage rounding of a bf16 or int8 cache (a rank's K/V may round apart from the single
  // process's when its projection's last bit differs).
  ::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, int64_t Tk,
                                   const std::string& what) const {
    const int64_t K = test::reduction_length(config, Tk), D = config.head_dim();
    const DType kv = kv_dtype;
    return test::all_close_within(got, to_double(want), [&](double m) { return kv_storage_tolerance(kv, D, K, m); },
                                  label(config, what + " kv=" + gpt2attn::to_string(kv)));
  }

  SequenceId create() {
    const SequenceId want = cache.create();
    SequenceId got = -1;
    EXPECT_EQ(outcome_of([&] { got = scache.create(); }), "ok");
    EXPECT_EQ(got, want) << "create(): the sharded cache's id differs from the single-process cache's";
    EXPECT_TRUE(same_on_every_rank(got, comm)) << "create() gave different ids on different ranks";
    return want;
  }
  SequenceId fork(SequenceId parent) {
    const SequenceId want = cache.fork(parent);
    SequenceId got = -1;
    EXPECT_EQ(outcome_of([&] { got = scache.fork(parent); }), "ok");
    EXPECT_EQ(got, want) << "fork(" << parent << ")";
    EXPECT_TRUE(same_on_every_rank(got, comm)) << "fork() gave different ids on different ranks";
    return want;
  }
  SequenceId fork(SequenceId parent, int64_t prefix) {
    const SequenceId want = cache.fork(parent, prefix);
    SequenceId got = -1;
    EXPECT_EQ(outcome_of([&] { got = scache.fork(parent, prefix); }), "ok");
    EXPECT_EQ(got, want) << "fork(" << parent << ", " << prefix << ")";
    expect_lengths({got}, "prefix fork");
    return want;
  }
  void truncate(SequenceId seq, int64_t new_length) {
    cache.truncate(seq, new_length);
    EXPECT_EQ(outcome_of([&] { scache.truncate(seq, new_length); }), "ok");
    expect_lengths({seq}, "truncate");
  }
  void release(SequenceId seq) {
    cache.release(seq);
    EXPECT_EQ(outcome_of([&] { scache.release(seq); }), "ok");
    EXPECT_FALSE(scache.contains(seq));
  }

  std::vector<float> random_x(int64_t rows) {
    return test::random_uniform(static_cast<size_t>(rows * config.query_width()), rng);
  }

  void extend(SequenceId seq, int64_t T, const std::string& what) {
    const std::vector<float> x = random_x(T);
    std::vector<float> want(static_cast<size_t>(T * config.d_model)), got(want.size(), kNaN);
    single.extend(cache, seq, x.data(), T, want.data(), kRun);
    EXPECT_EQ(outcome_of([&] { sharded.extend(scache, seq, x.data(), T, got.data(), kRun); }), "ok") << what;
    EXPECT_TRUE(close(got, want, cache.length(seq), what));
    EXPECT_TRUE(bitwise_same_on_every_rank(got, comm, what));
    expect_lengths({seq}, what);
  }

  void decode(const std::vector<SequenceId>& seqs, const std::string& what) {
    const int64_t B = static_cast<int64_t>(seqs.size());
    const std::vector<float> x = random_x(B);
    std::vector<float> want(static_cast<size_t>(B * config.d_model)), got(want.size(), kNaN);
    single.decode(cache, seqs.data(), B, x.data(), want.data(), kRun);
    EXPECT_EQ(outcome_of([&] { sharded.decode(scache, seqs.data(), B, x.data(), got.data(), kRun); }), "ok") << what;
    int64_t Tk = 0;
    for (SequenceId s : seqs) Tk = std::max(Tk, cache.length(s));
    EXPECT_TRUE(close(got, want, Tk, what));
    EXPECT_TRUE(bitwise_same_on_every_rank(got, comm, what));
    expect_lengths(seqs, what);
  }

  // A ragged step: tokens[i] new tokens for seqs[i].
  void step(const std::vector<SequenceId>& seqs, const std::vector<int64_t>& tokens, const std::string& what) {
    const int64_t n = static_cast<int64_t>(seqs.size());
    int64_t M = 0, Tk = 0;
    for (int64_t t : tokens) M += t;
    const std::vector<float> x = random_x(M);
    std::vector<float> want(static_cast<size_t>(M * config.d_model)), got(want.size(), kNaN);
    single.step(cache, seqs.data(), tokens.data(), n, x.data(), want.data(), kRun);
    EXPECT_EQ(outcome_of([&] { sharded.step(scache, seqs.data(), tokens.data(), n, x.data(), got.data(), kRun); }),
              "ok")
        << what;
    for (SequenceId s : seqs) Tk = std::max(Tk, cache.length(s));
    EXPECT_TRUE(close(got, want, Tk, what));
    EXPECT_TRUE(bitwise_same_on_every_rank(got, comm, what));
    expect_lengths(seqs, what);
  }

  void expect_lengths(const std::vector<SequenceId>& seqs, const std::string& what) {
    for (SequenceId s : seqs) {
      EXPECT_TRUE(scache.contains(s)) << what << ": seq " << s;
      if (!scache.contains(s)) continue;
      EXPECT_EQ(scache.length(s), cache.length(s)) << what << ": length of seq " << s;
      EXPECT_EQ(scache.local().length(s), cache.length(s)) << what << ": local pool's length of seq " << s;
    }
    EXPECT_EQ(scache.free_blocks(), cache.free_blocks()) << what;
    EXPECT_EQ(scache.total_blocks(), cache.total_blocks()) << what;
    EXPECT_EQ(scache.local().free_blocks(), scache.free_blocks()) << what;
  }
};

void serve_script(const Config& c, const KvCacheOptions& kv, uint64_t seed) {
  ServingPair p(c, seed, kv);
  EXPECT_EQ(p.scache.local().config().kv_heads(), p.sharded.kv_heads()) << "the local pool holds this rank's heads";
  const SequenceId a = p.create(), b = p.create(), s_c = p.create();
  p.extend(a, 5, "prefill a (5)");
  p.extend(b, 17, "prefill b (17)");
  p.extend(s_c, 1, "prefill c (1)");
  p.extend(a, 9, "chunked prefill a (5 + 9)");
  for (int step = 0; step < 3; ++step) p.decode({a, b, s_c}, "decode a, b, c step " + std::to_string(step));
  const SequenceId d = p.fork(b);
  p.decode({b, d}, "decode parent b and its fork d");
  p.decode({d, a}, "decode d, a");
  p.extend(d, 4, "extend the fork d (copy on write)");
  p.release(s_c);
  const SequenceId e = p.create();
  p.extend(e, 3, "prefill e after releasing c");
  for (int step = 0; step < 2; ++step) p.decode({e, a, b, d}, "decode e, a, b, d step " + std::to_string(step));
  p.decode({b}, "decode b alone");
  const SequenceId f = p.create();
  p.extend(f, 40, "prefill f (40)");
  p.extend(f, 1, "extend f by 1");
  p.decode({f, e, d, b, a}, "decode five sequences");
  const SequenceId g = p.fork(f, 19);  // a shared prompt of 19 tokens: two whole 8-token blocks and a part
  p.decode({g, f}, "decode the prefix fork g (19 of f's 41) and f");
  p.truncate(f, 30);                   // rejected drafts: f's last 12 tokens
  p.decode({f, g}, "decode f after truncating it to 30, and g");
  p.extend(g, 6, "extend g past its shared prefix");
  p.step({g, a, f, b}, {3, 1, 40, 7}, "a ragged step: a draft of 3, a decode token, a chunk of 40, a chunk of 7");
  p.truncate(g, p.cache.length(g) - 2);  // two of the draft's tokens rejected
  p.step({b, g}, {1, 1}, "a ragged step of single tokens (decode)");
  for (SequenceId s : {a, b, d, e, f, g}) p.release(s);
  EXPECT_EQ(p.scache.free_blocks(), p.scache.total_blocks());
  EXPECT_FALSE(p.scache.contains(s_c));
  EXPECT_EQ(p.create(), g + 1) << "ids are assigned in order and never reused";
}

class ShardedServing : public Sharded {};

TEST_F(ShardedServing, MixedExtendDecodeForkRelease) {
  serve_script(make_config({.E = 64, .H = 8, .context = 96, .causal = true}), {.block_tokens = 8, .capacity_tokens = 512},
               71);
}

TEST_F(ShardedServing, UnevenHeads) {
  serve_script(make_config({.E = 100, .H = 25, .context = 96, .causal = true}),
               {.block_tokens = 8, .capacity_tokens = 512}, 72);
}

TEST_F(ShardedServing, GroupedKvHeads) {
  if (g_size > 4) GTEST_SKIP() << "4 K/V heads serve at most 4 ranks";
  serve_script(make_config({.E = 64, .H = 8, .H_kv = 4, .d_in = 40, .context = 96, .causal = true}),
               {.block_tokens = 8, .capacity_tokens = 512}, 73);
}

TEST_F(ShardedServing, StoredKvCaches) {
  for (const DType kv : {DType::bf16, DType::i8, DType::fp8}) {
    serve_script(make_config({.E = 64, .H = 8, .context = 96, .causal = true}),
                 {.block_tokens = 16, .capacity_tokens = 512, .dtype = kv}, 76);
  }
}

TEST_F(ShardedServing, DefaultBlocksAndBytesCapacity) {
  const Config c = make_config({.E = 64, .H = 8, .context = 96, .causal = true});
  // capacity_bytes is per rank: every rank's pool holds what the smallest rank's bytes hold.
  ShardedAttention layer = ShardedAttention::random(c, 74, MPI_COMM_WORLD, kOneThread);
  ShardedKvCache cache(layer, {.capacity_bytes = size_t{1} << 20});
  EXPECT_TRUE(same_on_every_rank(cache.total_blocks()));
  EXPECT_GT(cache.total_blocks(), 0);
  serve_script(c, {.capacity_tokens = 640}, 75);
}

// =============================================================================================================
// errors: bad input on one rank gives every rank the same Error, and everything still works afterwards

class ShardedErrors : public Sharded {};

TEST_F(ShardedErrors, NanInputOnLastRank) {
  const int bad = g_size - 1;
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  ServingPair p(c, 81, {.block_tokens = 8, .capacity_tokens = 256});
  const SequenceId a = p.create(), b = p.create();
  p.extend(a, 6, "prefill a");
  p.extend(b, 3, "prefill b");

  // decode: x (B, d_in) with a NaN on the last rank only.
  std::vector<float> x = p.random_x(2);
  std::vector<float> bad_x = x;
  bad_x[70] = kNaN;  // row 1, column 6
  const SequenceId seqs[2] = {a, b};
  std::vector<float> out(2 * 64, kSentinel);
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.decode(p.scache, seqs, 2, g_rank == bad ? bad_x.data() : x.data(), out.data(), kRun); },
      MPI_COMM_WORLD, &err));
  std::vector<float> scratch(2 * 64);
  const std::string single_msg =
      single_error([&] { p.single.decode(p.cache, seqs, 2, bad_x.data(), scratch.data(), kRun); });
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::invalid_argument));
  EXPECT_TRUE(relays(err.message, bad, single_msg));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; })) << "out was written";
  p.expect_lengths({a, b}, "after the failed decode");
  EXPECT_EQ(p.scache.length(a), 6);
  p.decode({a, b}, "decode after the NaN error");

  // Every rank but 0 fails, each at its own element: every rank gets rank 1's message.
  if (g_size >= 3) {
    std::vector<float> own_nan = x;
    own_nan[static_cast<size_t>(g_rank)] = kNaN;
    EXPECT_TRUE(same_error_on_every_rank(
        [&] { p.sharded.decode(p.scache, seqs, 2, g_rank == 0 ? x.data() : own_nan.data(), out.data(), kRun); },
        MPI_COMM_WORLD, &err));
    std::vector<float> rank1_nan = x;
    rank1_nan[1] = kNaN;
    EXPECT_TRUE(relays(err.message, 1,
                       single_error([&] { p.single.decode(p.cache, seqs, 2, rank1_nan.data(), scratch.data(), kRun); })));
    p.decode({a, b}, "decode after the NaN errors on several ranks");
  }

  // extend
  std::vector<float> xe = p.random_x(4), bad_xe = xe;
  bad_xe[3] = std::numeric_limits<float>::infinity();
  std::vector<float> oute(4 * 64, kSentinel);
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.extend(p.scache, b, g_rank == bad ? bad_xe.data() : xe.data(), 4, oute.data(), kRun); },
      MPI_COMM_WORLD, &err));
  EXPECT_TRUE(relays(err.message, bad));
  EXPECT_TRUE(std::all_of(oute.begin(), oute.end(), [](float v) { return v == kSentinel; })) << "out was written";
  p.expect_lengths({a, b}, "after the failed extend");
  p.extend(b, 4, "extend after the Inf error");

  // forward
  LayerPair lp(c, 82);
  std::mt19937_64 rng(13);
  OwnedInputs in = make_inputs(c, 2, 9, 0, rng);
  OwnedInputs bad_in = in;
  bad_in.query.f32[100] = kNaN;
  std::vector<float> outf(2 * 9 * 64, kSentinel);
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { lp.sharded.forward(g_rank == bad ? bad_in.inputs() : in.inputs(), outf.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  std::vector<float> tmp(outf.size());
  EXPECT_TRUE(relays(err.message, bad, single_error([&] { lp.single.forward(bad_in.inputs(), tmp.data(), kRun); })));
  EXPECT_TRUE(std::all_of(outf.begin(), outf.end(), [](float v) { return v == kSentinel; })) << "out was written";
  EXPECT_TRUE(sharded_matches(lp.single, lp.sharded, in.inputs(), kRun, "forward after the NaN error"));
}

// The same bad input on every rank: the message is rank 0's, the single-process layer's prefixed "rank 0: ".
TEST_F(ShardedErrors, BadInputOnEveryRank) {
  const Config c = make_config({.E = 64, .H = 8, .context = 64});
  LayerPair p(c, 83);
  std::mt19937_64 rng(14);
  OwnedInputs in = make_inputs(c, 2, 5, 7, rng);
  in.attn_mask = make_mask(MaskKind::keep, DType::u8, MaskShape::b_h_t_tk, 2, 8, 5, 8, rng);  // Tk 8 != 7
  std::vector<float> out(2 * 5 * 64, kSentinel), tmp(out.size());
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank([&] { p.sharded.forward(in.inputs(), out.data(), kRun); }, MPI_COMM_WORLD,
                                       &err));
  EXPECT_TRUE(relays(err.message, 0, single_error([&] { p.single.forward(in.inputs(), tmp.data(), kRun); })))
      << "a per-head mask's error must name the full layer's shape, not a shard's";
  // A (B, H, T, Tk) mask with a shard's head count instead of H.
  in.attn_mask = make_mask(MaskKind::keep, DType::u8, MaskShape::b_h_t_tk, 2, std::max<int64_t>(p.sharded.heads(), 1),
                           5, 7, rng);
  if (g_size > 1) {
    EXPECT_TRUE(same_error_on_every_rank([&] { p.sharded.forward(in.inputs(), out.data(), kRun); }, MPI_COMM_WORLD,
                                         &err));
  }
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; })) << "out was written";
  in.attn_mask = {};
  EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "forward after the mask errors"));

  // Serving: a sequence past the context, training mode, an unknown id everywhere.
  const Config cc = make_config({.E = 64, .H = 8, .context = 16, .causal = true});
  ServingPair s(cc, 84, {.block_tokens = 8, .capacity_tokens = 64});
  const SequenceId a = s.create();
  std::vector<float> x = s.random_x(17), o(17 * 64, kSentinel);
  EXPECT_TRUE(same_error_on_every_rank([&] { s.sharded.extend(s.scache, a, x.data(), 17, o.data(), kRun); },
                                       MPI_COMM_WORLD, &err));
  EXPECT_TRUE(relays(err.message, 0, single_error([&] { s.single.extend(s.cache, a, x.data(), 17, o.data(), kRun); })));
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { s.sharded.extend(s.scache, a, x.data(), 3, o.data(), {.threads = 1, .training = true}); },
      MPI_COMM_WORLD, &err));
  const SequenceId unknown = 777;
  EXPECT_TRUE(same_error_on_every_rank([&] { s.sharded.decode(s.scache, &unknown, 1, x.data(), o.data(), kRun); },
                                       MPI_COMM_WORLD, &err));
  EXPECT_NE(err.message.find("777"), std::string::npos) << err.message;
  EXPECT_TRUE(same_error_on_every_rank([&] { s.scache.fork(unknown); }, MPI_COMM_WORLD, &err));
  EXPECT_TRUE(same_error_on_every_rank([&] { s.scache.release(unknown); }, MPI_COMM_WORLD, &err));
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return v == kSentinel; })) << "out was written";
  // The same sequence twice in one decode batch.
  const SequenceId twice[2] = {a, a};
  std::vector<float> tmp2(2 * 64);
  EXPECT_TRUE(same_error_on_every_rank([&] { s.sharded.decode(s.scache, twice, 2, x.data(), o.data(), kRun); },
                                       MPI_COMM_WORLD, &err));
  EXPECT_TRUE(relays(err.message, 0, single_error([&] { s.single.decode(s.cache, twice, 2, x.data(), tmp2.data(), kRun); })));
  // A cache used with a layer it was not built for.
  {
    ShardedAttention other = ShardedAttention::random(cc, 5, MPI_COMM_WORLD, kOneThread);
    EXPECT_TRUE(same_error_on_every_rank([&] { other.extend(s.scache, a, x.data(), 2, o.data(), kRun); },
                                         MPI_COMM_WORLD, &err));
  }
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return v == kSentinel; })) << "out was written";
  s.extend(a, 16, "extend after the errors");
  EXPECT_TRUE(same_error_on_every_rank([&] { s.sharded.decode(s.scache, &a, 1, x.data(), o.data(), kRun); },
                                       MPI_COMM_WORLD, &err))
      << "a decode past the context length";
  EXPECT_EQ(s.scache.length(a), 16);
}

// Construction compares the weights' source, not only the config: one rank's seed, compute type or weight values
// differing is refused on every rank (before, each was accepted and the sum of the ranks' heads was another layer).
TEST_F(ShardedErrors, LayersThatDifferBetweenRanks) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const int odd = g_size - 1;
  const Config c = make_config({.E = 64, .H = 8});
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention::random(c, g_rank == odd ? 8 : 7, MPI_COMM_WORLD, EngineOptions{.threads = 1}); },
      MPI_COMM_WORLD, &err));
  EXPECT_NE(err.message.find("other arguments"), std::string::npos) << err.message;
  EngineOptions bf16{.threads = 1};
  if (g_rank == odd) bf16.compute = DType::bf16;
  EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention::random(c, 7, MPI_COMM_WORLD, bf16); }, MPI_COMM_WORLD,
                                       &err));
  Weights w = Weights::random(c, 7);
  if (g_rank == odd) w.w_o[static_cast<size_t>(c.d_model) * 40 + 3] *= 2.0f;  // a row the sample reads (E = 64 rows)
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention(c, w.view(c), MPI_COMM_WORLD, EngineOptions{.threads = 1}); }, MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] weights differ on rank %d: %s\n", odd, err.message.c_str());
  // The same weights on every rank still build.
  const Weights same = Weights::random(c, 7);
  EXPECT_NO_THROW(ShardedAttention(c, same.view(c), MPI_COMM_WORLD, EngineOptions{.threads = 1}));
}

// The default check reads every value: weights that differ in one element of a row no sample reads, in a head only
// the last rank uses, are refused on every rank; WeightCheck::sampled, the opt-out for callers who guarantee
// identical files, does not see it (which is why it is not the default).
TEST_F(ShardedErrors, WeightsThatDifferAnywhereAreRefused) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const int odd = g_size - 1;
  const Config c = make_config({.E = 256, .H = 8});
  Weights w = Weights::random(c, 7);
  // Row 5 of the last head's W_q rows: the last rank's slice only, and not one of the sample's rows i * 255 / 63.
  const int64_t row = c.d_model - c.head_dim() + 5;
  for (int64_t i = 0; i < 64; ++i) ASSERT_NE(i * (c.d_model - 1) / 63, row) << "the sample reads row " << row;
  if (g_rank == odd) w.w_q[static_cast<size_t>(row * c.query_width() + 3)] += 0.5f;
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention(c, w.view(c), MPI_COMM_WORLD, EngineOptions{.threads = 1}); }, MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] one unsampled value differs on rank %d: %s\n", odd, err.message.c_str());
  EXPECT_NO_THROW(
      ShardedAttention(c, w.view(c), MPI_COMM_WORLD, EngineOptions{.threads = 1}, WeightCheck::sampled));
  // The two checks are an argument like the others: ranks that ask for different ones are refused.
  EXPECT_TRUE(same_error_on_every_rank(
      [&] {
        ShardedAttention(c, Weights::random(c, 7).view(c), MPI_COMM_WORLD, EngineOptions{.threads = 1},
                         g_rank == odd ? WeightCheck::sampled : WeightCheck::full);
      },
      MPI_COMM_WORLD, &err));
}

TEST_F(ShardedErrors, InputsThatDifferBetweenRanks) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const int odd = g_size - 1;
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  ServingPair p(c, 85, {.block_tokens = 8, .capacity_tokens = 256});
  const SequenceId a = p.create(), b = p.create();
  p.extend(a, 4, "prefill a");
  p.extend(b, 7, "prefill b");
  AgreedError err;

  // decode: one rank's x differs in one element.
  std::vector<float> x = p.random_x(2), odd_x = x, out(2 * 64, kSentinel);
  odd_x[5] += 1e-3f;
  const SequenceId seqs[2] = {a, b};
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.decode(p.scache, seqs, 2, g_rank == odd ? odd_x.data() : x.data(), out.data(), kRun); },
      MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] decode, x differs on rank %d: %s\n", odd, err.message.c_str());
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; })) << "out was written";
  p.expect_lengths({a, b}, "after the differing decode");

  // decode: one rank names other sequences (b, a instead of a, b).
  const SequenceId swapped[2] = {b, a};
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.decode(p.scache, g_rank == odd ? swapped : seqs, 2, x.data(), out.data(), kRun); },
      MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] decode, seqs differ on rank %d: %s\n", odd, err.message.c_str());

  // decode: one rank's B differs.
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.decode(p.scache, seqs, g_rank == odd ? 1 : 2, x.data(), out.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  if (g_rank == 0) std::printf("[ message  ] decode, B differs on rank %d: %s\n", odd, err.message.c_str());

  // extend: one rank's T differs, then one rank's x.
  std::vector<float> xe = p.random_x(5), odd_xe = xe, oute(5 * 64, kSentinel);
  odd_xe[5 * 64 - 1] = -odd_xe[5 * 64 - 1];
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.extend(p.scache, a, xe.data(), g_rank == odd ? 4 : 5, oute.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.extend(p.scache, a, g_rank == odd ? odd_xe.data() : xe.data(), 5, oute.data(), kRun); },
      MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] extend, x differs on rank %d: %s\n", odd, err.message.c_str());
  EXPECT_TRUE(std::all_of(oute.begin(), oute.end(), [](float v) { return v == kSentinel; })) << "out was written";
  p.expect_lengths({a, b}, "after the differing extends");

  // fork / release of different ids on one rank.
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.fork(g_rank == odd ? b : a); }, MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] fork, parent differs on rank %d: %s\n", odd, err.message.c_str());
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.release(g_rank == odd ? b : a); }, MPI_COMM_WORLD, &err));
  // truncate and a prefix fork: a length that differs on one rank, and one out of range everywhere.
  const int64_t len_a = p.scache.length(a);
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.truncate(a, g_rank == odd ? 1 : 2); }, MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] truncate, length differs on rank %d: %s\n", odd, err.message.c_str());
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.fork(a, g_rank == odd ? 1 : 2); }, MPI_COMM_WORLD, &err));
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.truncate(a, len_a + 1); }, MPI_COMM_WORLD, &err));
  EXPECT_NE(err.message.find("must be 0.."), std::string::npos) << err.message;
  EXPECT_TRUE(same_error_on_every_rank([&] { p.scache.fork(a, -1); }, MPI_COMM_WORLD, &err));
  EXPECT_EQ(p.scache.length(a), len_a);
  EXPECT_TRUE(p.scache.contains(a));
  EXPECT_TRUE(p.scache.contains(b));
  p.decode({a, b}, "decode after the differing calls");
  const SequenceId f = p.fork(a);  // the failed fork consumed no id on any rank
  p.decode({f, b}, "decode the fork");

  // forward: one rank's query differs, then one rank's mask, then one rank's run options.
  LayerPair lp(make_config({.E = 64, .H = 8}), 86);
  std::mt19937_64 rng(15);
  OwnedInputs in = make_inputs(lp.config, 2, 6, 8, rng);
  in.attn_mask = make_mask(MaskKind::keep, DType::u8, MaskShape::b_h_t_tk, 2, 8, 6, 8, rng);
  OwnedInputs odd_in = in;
  odd_in.query.f32[0] += 1.0f;
  std::vector<float> outf(2 * 6 * 64, kSentinel);
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { lp.sharded.forward(g_rank == odd ? odd_in.inputs() : in.inputs(), outf.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  if (g_rank == 0) std::printf("[ message  ] forward, query differs on rank %d: %s\n", odd, err.message.c_str());
  OwnedInputs odd_mask = in;
  odd_mask.attn_mask.u8[odd_mask.attn_mask.u8.size() - 1] ^= 1;  // the last head's last element: a remote shard's
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { lp.sharded.forward(g_rank == odd ? odd_mask.inputs() : in.inputs(), outf.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  OwnedInputs odd_kind = in;
  odd_kind.mask_kind = MaskKind::block;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { lp.sharded.forward(g_rank == odd ? odd_kind.inputs() : in.inputs(), outf.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  EXPECT_TRUE(same_error_on_every_rank(
      [&] {
        lp.sharded.forward(in.inputs(), outf.data(),
                           g_rank == odd ? RunOptions{.threads = 1, .training = true, .dropout_seed = 1} : kRun);
      },
      MPI_COMM_WORLD, &err));
  EXPECT_TRUE(std::all_of(outf.begin(), outf.end(), [](float v) { return v == kSentinel; })) << "out was written";
  EXPECT_TRUE(sharded_matches(lp.single, lp.sharded, in.inputs(), kRun, "forward after the differing calls"));
}

TEST_F(ShardedErrors, UnknownSequenceOnOneRank) {
  const int bad = g_size - 1;
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  ServingPair p(c, 87, {.block_tokens = 8, .capacity_tokens = 256});
  const SequenceId a = p.create(), b = p.create();
  p.extend(a, 4, "prefill a");
  p.extend(b, 2, "prefill b");
  p.release(b);  // b is now unknown everywhere; one rank passes it
  const SequenceId good[1] = {a}, stale[1] = {b};
  std::vector<float> x = p.random_x(1), out(64, kSentinel), tmp(64);
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { p.sharded.decode(p.scache, g_rank == bad ? stale : good, 1, x.data(), out.data(), kRun); }, MPI_COMM_WORLD,
      &err));
  if (g_rank == 0) std::printf("[ message  ] decode, unknown id on rank %d: %s\n", bad, err.message.c_str());
  EXPECT_TRUE(relays(err.message, bad,
                     single_error([&] { p.single.decode(p.cache, stale, 1, x.data(), tmp.data(), kRun); })))
      << "the failing rank's own check, as the single-process layer words it";
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; })) << "out was written";
  p.expect_lengths({a}, "after the failed decode");
  p.decode({a}, "decode after the unknown-id error");
  const SequenceId e = p.create();  // ids still in step with the single-process cache
  p.extend(e, 3, "prefill e");
  p.decode({a, e}, "decode a, e");
}

TEST_F(ShardedErrors, MoreRanksThanKvHeads) {
  if (g_size < 2) GTEST_SKIP() << "a world of one rank has no fewer K/V heads than ranks";
  const int64_t H_kv = g_size - 1;
  const Config c = make_config({.E = 8 * 2 * H_kv, .H = 2 * H_kv, .H_kv = H_kv, .causal = true});
  const Weights w = Weights::random(c, 88);
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention s(c, w.view(c), MPI_COMM_WORLD, kOneThread); },
                                       MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] %d ranks, %ld K/V heads: %s\n", g_size, long(H_kv), err.message.c_str());
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::invalid_argument));
  EXPECT_NE(err.message.find("head"), std::string::npos) << err.message;
  EXPECT_NE(err.message.find(std::to_string(H_kv)), std::string::npos) << err.message;
  EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention::random(c, 88, MPI_COMM_WORLD, kOneThread); },
                                       MPI_COMM_WORLD, &err));
  EXPECT_NE(err.message.find("head"), std::string::npos) << err.message;
  // Plain multi-head with fewer heads than ranks.
  const Config few = make_config({.E = 8 * H_kv, .H = H_kv});
  const Weights wf = Weights::random(few, 89);
  EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention s(few, wf.view(few), MPI_COMM_WORLD, kOneThread); },
                                       MPI_COMM_WORLD, &err));
  // An invalid config on every rank.
  Config broken = make_config({.E = 64, .H = 7});
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention::random(broken, 1, MPI_COMM_WORLD, kOneThread); }, MPI_COMM_WORLD, &err));
  // A config that differs on one rank.
  const Config mine = make_config({.E = 64, .H = 8, .context = g_rank == g_size - 1 ? 65 : 64, .causal = true});
  EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention::random(mine, 1, MPI_COMM_WORLD, kOneThread); },
                                       MPI_COMM_WORLD, &err));
  if (g_rank == 0) std::printf("[ message  ] config differs on one rank: %s\n", err.message.c_str());
  // And the world still builds and runs a layer.
  const Config ok = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  LayerPair p(ok, 90);
  std::mt19937_64 rng(16);
  const OwnedInputs in = make_inputs(ok, 1, 10, 0, rng);
  EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "a layer after the refusals"));
}

// Only causal self-attention serves a KV cache (parallel.hpp; CausalSelfAttention makes its config causal and refuses
// kdim or vdim != d_in): a sharded cache for a non-causal or a cross-width layer is refused, when it is built or
// when it is used, the same on every rank, and nothing is written.
TEST_F(ShardedErrors, KvCacheServesOnlyCausalSelfAttention) {
  const Config non_causal = make_config({.E = 64, .H = 8, .context = 16});
  const Config cross_width = make_config({.E = 64, .H = 8, .kdim = 40, .vdim = 40, .context = 16, .causal = true});
  std::mt19937_64 rng(20);
  const std::vector<float> x = test::random_uniform(4 * 64, rng);
  for (const Config& c : {non_causal, cross_width}) {
    const std::string what = c.causal ? "causal, kdim = vdim = 40 != d_in = 64" : "non-causal";
    ShardedAttention layer = ShardedAttention::random(c, 6, MPI_COMM_WORLD, kOneThread);
    std::vector<float> out(4 * 64, kSentinel);
    AgreedError err;
    const bool refused = same_error_on_every_rank(
        [&] {
          ShardedKvCache k(layer, {.block_tokens = 8, .capacity_tokens = 64});
          const SequenceId q = k.create();
          layer.extend(k, q, x.data(), 4, out.data(), kRun);
        },
        MPI_COMM_WORLD, &err);
    EXPECT_TRUE(refused) << what << ": extend through a sharded KV cache was not refused";
    if (g_rank == 0 && refused) std::printf("[ message  ] a KV cache for a %s layer: %s\n", what.c_str(), err.message.c_str());
    // decode only once extend is refused: with the packed decode weights missing it may crash the process.
    if (refused) {
      EXPECT_TRUE(same_error_on_every_rank(
          [&] {
            ShardedKvCache k(layer, {.block_tokens = 8, .capacity_tokens = 64});
            const SequenceId q = k.create();
            layer.decode(k, &q, 1, x.data(), out.data(), kRun);
          },
          MPI_COMM_WORLD, &err))
          << what << ": decode through a sharded KV cache was not refused";
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == kSentinel; }))
        << what << ": out was written";
  }
}

// run_agreed: a caller's own step (reading its inputs) agreed like the library's calls.
TEST_F(ShardedErrors, RunAgreed) {
  const int bad = g_size - 1;
  AgreedError err;
  int ran = 0;
  EXPECT_EQ(outcome_of([&] { run_agreed(MPI_COMM_WORLD, "read inputs", [&] { ++ran; }); }), "ok");
  EXPECT_EQ(ran, 1);
  EXPECT_TRUE(same_error_on_every_rank(
      [&] {
        run_agreed(MPI_COMM_WORLD, "read inputs", [&] {
          if (g_rank == bad) fail(ErrorCode::bad_file, "q.npy: cannot open: no such file");
        });
      },
      MPI_COMM_WORLD, &err));
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::bad_file));
  EXPECT_TRUE(relays(err.message, bad, "q.npy: cannot open: no such file"));
  EXPECT_EQ(err.message.rfind("read inputs: ", 0), 0u) << err.message;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { run_agreed(MPI_COMM_WORLD, "step", [&] { if (g_rank == bad) throw std::runtime_error("boom"); }); },
      MPI_COMM_WORLD, &err));
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::internal));
  EXPECT_TRUE(relays(err.message, bad, "boom"));
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { run_agreed(MPI_COMM_WORLD, "step", [&] { if (g_rank == bad) throw std::bad_alloc(); }); }, MPI_COMM_WORLD,
      &err));
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::out_of_memory));
  // The world is still in step: a layer builds and runs.
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  LayerPair p(c, 96);
  std::mt19937_64 rng(19);
  const OwnedInputs in = make_inputs(c, 1, 8, 0, rng);
  EXPECT_TRUE(sharded_matches(p.single, p.sharded, in.inputs(), kRun, "after run_agreed's errors"));
}

// =============================================================================================================
// deadlines: calls under a short deadline work, and a bad deadline is refused on every rank. A rank that stops
// answering is tests/mpi/test_deadline.cpp's (it must end the job, so it cannot run here).

class ShardedDeadline : public Sharded {};

TEST_F(ShardedDeadline, CallsUnderAShortDeadlineWork) {
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  const Weights w = Weights::random(c, 41);
  MultiHeadAttention single(c, w.view(c), kOneThread);
  ShardedAttention sharded(c, w.view(c), MPI_COMM_WORLD, kOneThread, WeightCheck::full, 2.0);
  EXPECT_EQ(sharded.deadline_s(), 2.0);
  std::mt19937_64 rng(43);
  const OwnedInputs in = make_inputs(c, 2, 17, 0, rng);
  EXPECT_TRUE(sharded_matches(single, sharded, in.inputs(), kRun, "forward under a 2 s deadline"));
  // The cache's collectives (construction, create, release) and extend wait with the layer's deadline.
  ShardedKvCache cache(sharded, {.capacity_tokens = 64});
  SequenceId seq = -1;
  EXPECT_EQ(outcome_of([&] { seq = cache.create(); }), "ok");
  std::vector<float> x(static_cast<size_t>(5 * c.d_model), 0.25f), out(x.size());
  EXPECT_EQ(outcome_of([&] { sharded.extend(cache, seq, x.data(), 5, out.data(), kRun); }), "ok");
  EXPECT_EQ(outcome_of([&] { cache.release(seq); }), "ok");
  EXPECT_EQ(outcome_of([&] { run_agreed(MPI_COMM_WORLD, "step", [] {}, 2.0); }), "ok");
  // No deadline at all.
  EXPECT_EQ(outcome_of([&] { run_agreed(MPI_COMM_WORLD, "step", [] {}, std::numeric_limits<double>::infinity()); }),
            "ok");
  EXPECT_EQ(ShardedAttention::random(c, 1, MPI_COMM_WORLD, kOneThread).deadline_s(), kCollectiveDeadlineS);
}

TEST_F(ShardedDeadline, ZeroNegativeOrNanIsRefusedOnEveryRank) {
  const Config c = make_config({.E = 32, .H = 4, .context = 32, .causal = true});
  const Weights w = Weights::random(c, 5);
  for (const double bad : {0.0, -1.0, kNaN * 1.0}) {
    AgreedError err;
    EXPECT_TRUE(same_error_on_every_rank(
        [&] { ShardedAttention(c, w.view(c), MPI_COMM_WORLD, kOneThread, WeightCheck::full, bad); }, MPI_COMM_WORLD,
        &err));
    EXPECT_EQ(err.code, static_cast<int>(ErrorCode::invalid_argument));
    EXPECT_NE(err.message.find("deadline_s="), std::string::npos) << err.message;
    EXPECT_NE(err.message.find("must be above 0 seconds"), std::string::npos) << err.message;
    EXPECT_TRUE(same_error_on_every_rank([&] { ShardedAttention::random(c, 1, MPI_COMM_WORLD, kOneThread, bad); },
                                         MPI_COMM_WORLD, &err));
    EXPECT_NE(err.message.find("ShardedAttention::random: rank 0: deadline_s="), std::string::npos) << err.message;
    EXPECT_TRUE(same_error_on_every_rank([&] { run_agreed(MPI_COMM_WORLD, "step", [] {}, bad); }, MPI_COMM_WORLD,
                                         &err));
    EXPECT_NE(err.message.find("step: rank 0: deadline_s="), std::string::npos) << err.message;
  }
  // Only on the last rank: every rank still gets the error, naming that rank.
  const int odd = g_size - 1;
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention::random(c, 1, MPI_COMM_WORLD, kOneThread, g_rank == odd ? -3.0 : 2.0); },
      MPI_COMM_WORLD, &err));
  EXPECT_NE(err.message.find("rank " + std::to_string(odd) + ": deadline_s=-3"), std::string::npos) << err.message;
}

// =============================================================================================================
// the file constructor

class ShardedFile : public Sharded {
 protected:
  void SetUp() override {
    Sharded::SetUp();
    std::string dir;
    if (g_rank == 0) {
      std::string tmpl = (fs::path(::testing::TempDir()) / "gpt2attn_mpi_XXXXXX").string();
      dir = ::mkdtemp(tmpl.data()) ? tmpl : "";
    }
    dir_ = allgather_strings(dir)[0];
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0 && !dir_.empty()) {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
    Sharded::TearDown();
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::string dir_;
};

using TensorList = std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>>;

std::vector<float> transposed(const std::vector<float>& m, int64_t rows, int64_t cols) {  // (rows, cols) -> (cols, rows)
  std::vector<float> t(m.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = m[static_cast<size_t>(r * cols + c)];
  }
  return t;
}
std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> v;
  for (const auto* p : parts) v.insert(v.end(), p->begin(), p->end());
  return v;
}

// One layer of Weights::random(c, seed) in torch naming after `prefix`: fused in_proj when the input widths agree,
// else q/k/v_proj_weight; in_proj_bias always fused (as torch stores it).
void add_torch_layer(TensorList& t, const std::string& prefix, const Config& c, const Weights& w) {
  const int64_t E = c.d_model, KW = c.kv_width();
  if (c.same_input_widths()) {
    t.push_back({prefix + "in_proj_weight", {{E + 2 * KW, c.query_width()}, concat({&w.w_q, &w.w_k, &w.w_v})}});
  } else {
    t.push_back({prefix + "q_proj_weight", {{E, c.query_width()}, w.w_q}});
    t.push_back({prefix + "k_proj_weight", {{KW, c.key_width()}, w.w_k}});
    t.push_back({prefix + "v_proj_weight", {{KW, c.value_width()}, w.w_v}});
  }
  if (c.qkv_bias) t.push_back({prefix + "in_proj_bias", {{E + 2 * KW}, concat({&w.b_q, &w.b_k, &w.b_v})}});
  t.push_back({prefix + "out_proj.weight", {{E, E}, w.w_o}});
  if (c.out_bias) t.push_back({prefix + "out_proj.bias", {{E}, w.b_o}});
}

// Every rank loads the file with the sharded constructor; the single process with open_safetensors_layer.
void expect_file_layer_matches(const std::string& file, const std::string& prefix, const Config& partial,
                               const std::string& what, int64_t Tk = 0) {
  const StoredLayer l = open_safetensors_layer(file, prefix);
  const Config full = apply_loaded_shapes(partial, l);
  MultiHeadAttention single(full, l.weights, kOneThread);
  std::string outcome = outcome_of([&] {
    ShardedAttention sharded(partial, file, prefix, MPI_COMM_WORLD, kOneThread);
    expect_accessors(sharded, full, MPI_COMM_WORLD);
    std::mt19937_64 rng(17);
    OwnedInputs in = make_inputs(full, 2, 11, Tk, rng);
    EXPECT_TRUE(sharded_matches(single, sharded, in.inputs(), kRun, what));
  });
  EXPECT_EQ(outcome, "ok") << what;
}

TEST_F(ShardedFile, TorchAndHfNamingsMatchSingleProcess) {
  const Config c0 = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  const Config c1 = make_config({.E = 64, .H = 8, .H_kv = 4, .d_in = 48, .kdim = 40, .vdim = 56, .qkv_bias = true,
                                 .out_bias = false});
  const Config c2 = make_config({.E = 100, .H = 25, .context = 64, .causal = true});
  const Weights w0 = Weights::random(c0, 91), w1 = Weights::random(c1, 92), w2 = Weights::random(c2, 93),
                other = Weights::random(c0, 94);
  if (g_rank == 0) {
    TensorList torch;
    add_torch_layer(torch, "layer0.", c0, w0);
    add_torch_layer(torch, "layer1.", c0, other);  // another layer in the same file: the prefix must select
    add_torch_layer(torch, "cross.", c1, w1);
    safetensors::write_f32(path("torch.safetensors"), torch);
    // Hugging Face GPT-2: Conv1D weights stored (in, out), so the layer reads transposed views of them.
    const int64_t E = c2.d_model;
    TensorList hf = {
        {"h.3.attn.c_attn.weight", {{E, 3 * E}, transposed(concat({&w2.w_q, &w2.w_k, &w2.w_v}), 3 * E, E)}},
        {"h.3.attn.c_attn.bias", {{3 * E}, concat({&w2.b_q, &w2.b_k, &w2.b_v})}},
        {"h.3.attn.c_proj.weight", {{E, E}, transposed(w2.w_o, E, E)}},
        {"h.3.attn.c_proj.bias", {{E}, w2.b_o}},
    };
    safetensors::write_f32(path("hf.safetensors"), hf);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Config partial0;  // widths and biases come from the file
  partial0.num_heads = 8;
  partial0.context_length = 64;
  partial0.causal = true;
  expect_file_layer_matches(path("torch.safetensors"), "layer0.", partial0, "torch fused in_proj, layer0.");
  if (g_size <= 4) {
    Config partial1;
    partial1.num_heads = 8;
    partial1.num_kv_heads = 4;
    expect_file_layer_matches(path("torch.safetensors"), "cross.", partial1, "torch q/k/v_proj, GQA, cross", 13);
    Config from_width = partial1;  // num_kv_heads = 0: read from the file's K/V width
    from_width.num_kv_heads = 0;
    expect_file_layer_matches(path("torch.safetensors"), "cross.", from_width, "K/V heads from the file", 13);
  }
  Config partial2;
  partial2.num_heads = 25;
  partial2.context_length = 64;
  partial2.causal = true;
  expect_file_layer_matches(path("hf.safetensors"), "h.3.attn.", partial2, "hf-gpt2 Conv1D, 25 heads");

  // The file's values are the layer's: against the in-memory weights directly.
  LayerPair p(c0, 91);
  ShardedAttention from_file(partial0, path("torch.safetensors"), "layer0.", MPI_COMM_WORLD, kOneThread);
  std::mt19937_64 rng(18);
  const OwnedInputs in = make_inputs(c0, 1, 20, 0, rng);
  EXPECT_TRUE(sharded_matches(p.single, from_file, in.inputs(), kRun, "file layer vs in-memory weights"));
}

TEST_F(ShardedFile, MissingFileOnOneRank) {
  const Config c = make_config({.E = 64, .H = 8, .context = 64, .causal = true});
  const Weights w = Weights::random(c, 95);
  if (g_rank == 0) {
    TensorList t;
    add_torch_layer(t, "", c, w);
    safetensors::write_f32(path("w.safetensors"), t);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const int bad = g_size - 1;
  const std::string missing = path("missing_on_rank_" + std::to_string(bad) + ".safetensors");
  Config partial;
  partial.num_heads = 8;
  partial.context_length = 64;
  partial.causal = true;
  AgreedError err;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] {
        ShardedAttention s(partial, g_rank == bad ? missing : path("w.safetensors"), "", MPI_COMM_WORLD, kOneThread);
      },
      MPI_COMM_WORLD, &err));
  EXPECT_EQ(err.code, static_cast<int>(ErrorCode::bad_file));
  EXPECT_TRUE(relays(err.message, bad, single_error([&] { open_safetensors_layer(missing); })));
  // A prefix naming no layer, on every rank.
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention s(partial, path("w.safetensors"), "nope.", MPI_COMM_WORLD, kOneThread); }, MPI_COMM_WORLD,
      &err));
  EXPECT_TRUE(relays(err.message, 0, single_error([&] { open_safetensors_layer(path("w.safetensors"), "nope."); })));
  // A file whose heads do not divide its width (E = 64, H = 7), on every rank.
  Config seven = partial;
  seven.num_heads = 7;
  EXPECT_TRUE(same_error_on_every_rank(
      [&] { ShardedAttention s(seven, path("w.safetensors"), "", MPI_COMM_WORLD, kOneThread); }, MPI_COMM_WORLD,
      &err));
  // Then every rank loads it.
  expect_file_layer_matches(path("w.safetensors"), "", partial, "after the missing-file error");
}

}  // namespace
}  // namespace gpt2attn

// =============================================================================================================
// main: MPI around gtest. Rank 0 prints as gtest does; the other ranks print only their failures. The exit status
// is nonzero on every rank when any rank failed a test.

namespace {
class FailuresOnly : public ::testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  // The test's name is kept here: OnTestPartResult runs under gtest's lock, which current_test_info() takes again.
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILURE in %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_ = "?";
};
}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &gpt2attn::g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &gpt2attn::g_size);
  if (provided < MPI_THREAD_FUNNELED) {
    std::fprintf(stderr, "MPI_Init_thread gave thread level %d, below MPI_THREAD_FUNNELED\n", provided);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (const char* w = std::getenv("GPT2ATTN_MPI_TEST_WATCHDOG_S")) gpt2attn::g_watchdog_s = std::atoi(w);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (gpt2attn::g_rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(gpt2attn::g_rank));
  } else {
    std::printf("[ MPI      ] %d rank(s)\n", gpt2attn::g_size);
  }
  const int mine = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any != 0 ? 1 : 0;
}
