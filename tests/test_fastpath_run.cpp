// tests/test_fastpath_run.cpp: the fast path against the naive reference_forward under its run options and entry
// points, on every instruction set this CPU runs: dropout's hash contract, thread counts and bitwise determinism,
// one layer reused across shapes, NaN isolation and propagation, and CausalSelfAttention (the GPT-2 block).
// Shapes chosen for the kernel's tiles live in test_fastpath_tiles.cpp, the random sweep in test_fastpath_sweep.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/linear.hpp"
#include "engine/workspace.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"
#include "tests/fastpath_util.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::Dtype;
using test::fast_matches_reference;
using test::FastPathTest;
using test::make_config;
using test::make_tensor;
using test::OwnedInputs;
using test::OwnedTensor;
using test::random_uniform;
using test::reduction_length;
using test::simple_inputs;

// This process's oneDNN cap (ONEDNN_MAX_CPU_ISA, or its older name), upper-cased; empty where none is set.
std::string onednn_cap() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (!cap) cap = std::getenv("DNNL_MAX_CPU_ISA");
  std::string c = cap ? cap : "";
  for (char& ch : c) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return c;
}
// Whether that cap is below AVX-512, where oneDNN 2.6 has no bf16 matmul.
bool onednn_below_avx512() {
  const std::string c = onednn_cap();
  return c == "SSE41" || c == "AVX" || c == "AVX2" || c == "AVX2_VNNI";
}

// =============================================================================================================
// 1. Dropout follows the documented hash contract exactly, so training mode matches the reference.

class FastPathDropout : public FastPathTest {};

TEST_P(FastPathDropout, TrainingMatchesReferenceForTwoSeeds) {
  // T != Tk on every ISA (BQ may equal BK), so a draw index built with T where Tk belongs cannot pass.
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  const int64_t B = 2, T = 2 * BQ + 3, Tk = 2 * BK + 7;
  for (bool self : {false, true}) {
    Config c = make_config(64, 4, 0, self ? 0 : 24, self ? 0 : 40, true);
    c.dropout = 0.3f;
    const Weights w = Weights::random(c, 800 + self);
    OwnedInputs in = simple_inputs(c, B, T, self ? T : Tk, self, 810 + self, 2.0f);
    std::mt19937_64 rng(820);
    std::vector<float> keep = random_uniform(B * T * (self ? T : Tk), rng, 0.0f, 1.0f);
    for (float& x : keep) x = x < 0.2f ? 0.0f : 1.0f;
    in.attn_mask = make_tensor(keep, {B, T, self ? T : Tk}, DType::u8);
    for (int threads : {1, 2}) {
      MultiHeadAttention l = layer(c, w, threads);
      const std::vector<double> inference = reference_forward(c, w, in.inputs());
      for (uint64_t seed : {uint64_t{1}, uint64_t{0x8000000000000005ull}}) {
        const RunOptions run{.training = true, .dropout_seed = seed};
        std::ostringstream d;
        d << "dropout p=0.3 seed " << seed << (self ? " self" : " cross") << " B=" << B << " T=" << T;
        EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), run, d.str()));
        // The comparison above means something only if dropout changed the result.
        const std::vector<double> trained = reference_forward(c, w, in.inputs(), run);
        EXPECT_FALSE(all_close(trained, inference, Dtype::f32, reduction_length(c, Tk), "dropout had no effect"))
            << d.str();
      }
      // Outside training, dropout is off.
      EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{.training = false, .dropout_seed = 1},
                                         "p=0.3 inference"));
    }
  }
}

TEST_P(FastPathDropout, ZeroProbabilityTrainingEqualsInference) {
  const Config c = make_config(64, 4, 0, 0, 0, true);  // dropout = 0
  const Weights w = Weights::random(c, 850);
  const OwnedInputs in = simple_inputs(c, 2, 77, 77, true, 851, 2.0f);
  MultiHeadAttention l = layer(c, w, 2);
  const std::vector<float> inference = test::run_fast(l, in.inputs());
  const std::vector<float> training = test::run_fast(l, in.inputs(), RunOptions{.training = true, .dropout_seed = 9});
  ASSERT_EQ(inference.size(), training.size());
  for (size_t i = 0; i < inference.size(); ++i) {
    ASSERT_EQ(std::memcmp(&inference[i], &training[i], sizeof(float)), 0)
        << "[isa=" << to_string(isa()) << "] p=0: training differs from inference at [" << i << "]: inference "
        << inference[i] << " training " << training[i];
  }
  EXPECT_TRUE(
      fast_matches_reference(l, w, in.inputs(), RunOptions{.training = true, .dropout_seed = 9}, "p=0 training"));
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathDropout);

// =============================================================================================================
// 2. Threads, determinism, and one layer reused across shapes.

class FastPathThreads : public FastPathTest {};

TEST_P(FastPathThreads, ThreadCountDoesNotChangeResult) {
  const Config c = make_config(128, 4, 0, 0, 0, true);
  const Weights w = Weights::random(c, 900);
  const OwnedInputs in = simple_inputs(c, 2, 130, 130, true, 901, 2.0f);
  MultiHeadAttention l = layer(c, w, 1);
  const std::vector<float> one = test::run_fast(l, in.inputs(), RunOptions{.threads = 1});
  const std::vector<float> two = test::run_fast(l, in.inputs(), RunOptions{.threads = 2});
  EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{.threads = 1}, "threads=1"));
  EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{.threads = 2}, "threads=2"));
  EXPECT_TRUE(all_close(two, std::vector<double>(one.begin(), one.end()), Dtype::f32, reduction_length(c, 130),
                        test::fast_context(l, {}, "threads=2 (got) vs threads=1 (expected)")));
}

TEST_P(FastPathThreads, RepeatedCallsAreBitwiseIdentical) {
  Config c = make_config(96, 3, 40, 24, 56, true);
  const Weights w = Weights::random(c, 950);
  OwnedInputs in = simple_inputs(c, 3, 113, 130, false, 951, 2.0f);
  for (int threads : {1, 2}) {
    MultiHeadAttention l = layer(c, w, threads);
    const std::vector<float> first = test::run_fast(l, in.inputs());
    for (int rep = 1; rep <= 3; ++rep) {
      const std::vector<float> again = test::run_fast(l, in.inputs());
      for (size_t i = 0; i < first.size(); ++i) {
        ASSERT_EQ(std::memcmp(&first[i], &again[i], sizeof(float)), 0)
            << "[isa=" << to_string(isa()) << " threads=" << threads << "] call " << rep + 1
            << " differs from call 1 at [" << i << "]: first " << first[i] << " now " << again[i];
      }
    }
  }
}

// One layer, one workspace, calls whose T and Tk change up and down (and switch self/cross and masks).
TEST_P(FastPathThreads, LayerReusedAcrossShapes) {
  const Config c = make_config(64, 4, 0, 0, 0, false);
  const Weights w = Weights::random(c, 1000);
  MultiHeadAttention l = layer(c, w, 2);
  struct Call {
    int64_t B, T, Tk;
    bool self, mask;
  };
  const Call calls[] = {{2, 130, 130, true, false},  {1, 7, 7, true, true},    {3, 1, 113, false, true},
                        {2, 64, 33, false, false},   {1, 130, 2, false, true}, {2, 33, 33, true, true},
                        {3, 113, 130, false, false}, {1, 1, 1, true, false}};
  uint64_t seed = 1010;
  for (const Call& k : calls) {
    OwnedInputs in = simple_inputs(c, k.B, k.T, k.Tk, k.self, ++seed, 2.0f);
    if (k.mask) {
      std::mt19937_64 rng(seed);
      std::vector<float> m = random_uniform(k.T * k.Tk, rng, -1.0f, 1.0f);
      in.attn_mask = make_tensor(m, {k.T, k.Tk}, DType::f32);
      in.mask_kind = MaskKind::additive;
    }
    std::ostringstream d;
    d << "reused layer: B=" << k.B << " T=" << k.T << " Tk=" << k.Tk << (k.self ? " self" : " cross")
      << (k.mask ? " additive mask" : "");
    EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, d.str()));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathThreads);

// =============================================================================================================
// 3. NaN isolation: with check_finite off, a NaN in batch 0 stays in batch 0.

class FastPathNaN : public FastPathTest {
 protected:
  // Compares batch 1 of the fast output with batch 1 of the reference (which sees the same NaN), and requires it
  // finite.
  void check_batch1(MultiHeadAttention& l, const Weights& w, const AttentionInputs& in, const std::string& what) {
    const RunOptions run{.check_finite = false};
    const int64_t T = in.query.shape[1], E = l.config().d_model;
    const int64_t Tk = in.key.empty() ? T : in.key.shape[1];
    const std::vector<double> ref = reference_forward(l.config(), w, in, run);
    const std::vector<float> got = test::run_fast(l, in, run);
    const std::vector<double> want1(ref.begin() + T * E, ref.begin() + 2 * T * E);
    const std::vector<float> got1(got.begin() + T * E, got.begin() + 2 * T * E);
    for (double x : want1) ASSERT_TRUE(std::isfinite(x)) << what << ": the reference's batch 1 is not finite";
    EXPECT_TRUE(all_close(got1, want1, Dtype::f32, reduction_length(l.config(), Tk),
                          test::fast_context(l, run, what + ": batch 1; index into (T, E)")));
  }
};

TEST_P(FastPathNaN, NaNInBatch0QueryLeavesBatch1Intact) {
  for (bool causal : {false, true}) {
    const Config c = make_config(64, 4, 0, 0, 0, causal);
    const Weights w = Weights::random(c, 1100);
    OwnedInputs in = simple_inputs(c, 2, 70, 70, true, 1101);
    in.query.f32[(0 * 70 + 3) * 64 + 5] = std::numeric_limits<float>::quiet_NaN();
    MultiHeadAttention l = layer(c, w, 2);
    check_batch1(l, w, in.inputs(), std::string("NaN at query (0, 3, 5), self, causal=") + (causal ? "1" : "0"));
  }
}

TEST_P(FastPathNaN, NaNInBatch0KeyOrValueLeavesBatch1Intact) {
  const Config c = make_config(64, 4, 0, 24, 40, false);
  const Weights w = Weights::random(c, 1200);
  for (bool in_key : {true, false}) {
    OwnedInputs in = simple_inputs(c, 2, 33, 70, false, 1201);
    if (in_key) {
      in.key.f32[(0 * 70 + 69) * 24 + 1] = std::numeric_limits<float>::quiet_NaN();
    } else {
      in.value.f32[(0 * 70 + 0) * 40 + 39] = std::numeric_limits<float>::infinity();
    }
    MultiHeadAttention l = layer(c, w, 2);
    check_batch1(l, w, in.inputs(), in_key ? "NaN at key (0, 69, 1)" : "+Inf at value (0, 0, 39)");
  }
}
// With check_finite off, a NaN input must poison the rows it reaches, as in the reference and in torch
// (torch.nn.MultiheadAttention gives NaN for both cases below); a finite result there hides the bad input.
// Smallest cases: one query, two keys, one head.
TEST_P(FastPathNaN, NaNPropagatesToItsRowsLikeReference) {
  const Config c = make_config(4, 1, 0, 2, 2, false);
  const Weights w = Weights::random(c, 1);
  for (bool in_key : {true, false}) {
    OwnedInputs in = simple_inputs(c, 1, 1, 2, false, 2);
    if (in_key) {
      in.key.f32[1 * 2 + 0] = std::numeric_limits<float>::quiet_NaN();
    } else {
      in.query.f32[2] = std::numeric_limits<float>::quiet_NaN();
    }
    MultiHeadAttention l = layer(c, w, 1);
    EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{.check_finite = false},
                                       in_key ? "NaN at key (0, 1, 0), B=1 T=1 Tk=2: the reference's row is NaN"
                                              : "NaN at query (0, 0, 2), B=1 T=1 Tk=2: the reference's row is NaN"));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathNaN);

// =============================================================================================================
// 4. CausalSelfAttention (the GPT-2 block) against the reference with a causal config.

class FastPathCausalSelf : public FastPathTest {};

TEST_P(FastPathCausalSelf, MatchesCausalReference) {
  Config c = make_config(64, 4, 48, 0, 0, false);  // causal off here: the block must turn it on
  c.context_length = 128;
  const Weights w = Weights::random(c, 1300);
  CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .isa = isa()});
  ASSERT_EQ(block.layer().isa(), test::kernel_level(isa(), DType::f32));
  ASSERT_TRUE(block.layer().config().causal);
  Config causal = c;
  causal.causal = true;
  for (int64_t T : {int64_t{1}, int64_t{50}, int64_t{128}}) {
    const OwnedInputs in = simple_inputs(c, 2, T, T, true, 1301 + T, 2.0f);
    std::vector<float> got(static_cast<size_t>(2 * T * 64), std::numeric_limits<float>::quiet_NaN());
    block.forward(in.query.f32.data(), 2, T, got.data());
    const std::vector<double> want = reference_forward(causal, w, in.inputs());
    EXPECT_TRUE(
        all_close(got, want, Dtype::f32, reduction_length(causal, T),
                  test::fast_context(block.layer(), {},
                                     "CausalSelfAttention T=" + std::to_string(T) + " | " + test::describe(causal))));
  }
}

TEST_P(FastPathCausalSelf, LongerThanContextIsRefused) {
  Config c = make_config(32, 2);
  c.context_length = 64;
  const Weights w = Weights::random(c, 1400);
  CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .isa = isa()});
  const int64_t T = 65;
  std::mt19937_64 rng(1401);
  const std::vector<float> x = random_uniform(T * 32, rng);
  std::vector<float> out(T * 32, 12345.0f);
  try {
    block.forward(x.data(), 1, T, out.data());
    ADD_FAILURE() << "[isa=" << to_string(isa()) << "] T=65 > context_length=64 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("context_length"), std::string::npos) << e.what();
  }
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], 12345.0f) << "[isa=" << to_string(isa()) << "] refused call wrote out[" << i << "]";
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathCausalSelf);

// =============================================================================================================
// 6. bf16 activations in and out: TensorView dtype bf16 for query, key and value, and forward(in, out, bf16).

class FastPathBf16Io : public FastPathTest {
 protected:
  // A bf16 copy of an f32 tensor's (already bf16-exact) values, rows `gap` elements apart beyond their width.
  static TensorView bf16_copy(const OwnedTensor& t, int64_t gap, std::vector<kernels::bf16>& store) {
    const int64_t B = t.view.shape[0], N = t.view.shape[1], W = t.view.shape[2], ld = W + gap;
    store.assign(static_cast<size_t>(B * N * ld), kernels::to_bf16(std::nanf("")));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t w = 0; w < W; ++w) store[(b * N + n) * ld + w] = kernels::to_bf16(t.f32[(b * N + n) * W + w]);
    return TensorView::contiguous(store.data(), DType::bf16, {B, N, W}).with_strides({N * ld, ld, 1});
  }
};

// bf16 views of values that bf16 holds exactly give, in either compute type, bitwise the output of f32 views of the
// same values: the layer converts them to its compute type once, exactly, and then computes the same thing.
// Contiguous (a bf16 layer reads it in place) and strided views (packed first), self- and cross-attention.
TEST_P(FastPathBf16Io, Bf16ViewsEqualF32ViewsOfTheSameValues) {
  for (DType compute : {DType::f32, DType::bf16}) {
    for (bool self : {true, false}) {
      const Config c = make_config(48, 4, self ? 0 : 40, self ? 0 : 24, self ? 0 : 32, self);
      const Weights w = Weights::random(c, 900 + self);
      const int64_t B = 2, T = 9, Tk = self ? T : 13;
      const OwnedInputs in = test::rounded_bf16(simple_inputs(c, B, T, Tk, self, 910 + self, 2.0f));
      MultiHeadAttention l(c, w, EngineOptions{.threads = 2, .isa = isa(), .compute = compute});
      std::vector<float> want(static_cast<size_t>(B * T * c.d_model));
      l.forward(in.inputs(), want.data());
      for (int64_t gap : {0, 3}) {
        std::vector<kernels::bf16> q, k, v;
        AttentionInputs b16 = in.inputs();
        b16.query = bf16_copy(in.query, gap, q);
        if (!self) b16.key = bf16_copy(in.key, gap, k), b16.value = bf16_copy(in.value, gap, v);
        std::vector<float> got(want.size(), std::nanf(""));
        l.forward(b16, got.data());
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
            << "[isa=" << to_string(isa()) << "] compute " << to_string(compute) << (self ? " self" : " cross")
            << " bf16 views with row gap " << gap << " differ from f32 views of the same values";
      }
    }
  }
}

// A bf16 layer writes bf16 output straight from its output GEMM: each value is the f32 output rounded to one of
// its two bf16 neighbours (oneDNN rounds to nearest even; allow either neighbour, not a wider error). An f32 layer
// refuses bf16 output, and a NaN in a bf16 input is found by check_finite, with nothing written.
TEST_P(FastPathBf16Io, Bf16OutputAndErrors) {
  const Config c = make_config(64, 4, 0, 0, 0, true);
  const Weights w = Weights::random(c, 920);
  const int64_t B = 2, T = 17;
  const OwnedInputs in = simple_inputs(c, B, T, T, true, 921, 2.0f);
  MultiHeadAttention l(c, w, EngineOptions{.threads = 2, .isa = isa(), .compute = DType::bf16});
  std::vector<float> f(static_cast<size_t>(B * T * c.d_model));
  l.forward(in.inputs(), f.data());
  std::vector<kernels::bf16> h(f.size());
  l.forward(in.inputs(), h.data(), DType::bf16);
  for (size_t i = 0; i < f.size(); ++i) {
    const float got = kernels::widen(h[i]);
    ASSERT_LE(std::fabs(got - f[i]), std::ldexp(std::fabs(f[i]), -7) + 1e-30f)
        << "[isa=" << to_string(isa()) << "] element " << i << ": bf16 output " << got << ", f32 output " << f[i];
  }

  MultiHeadAttention l32(c, w, EngineOptions{.threads = 2, .isa = isa()});
  std::vector<kernels::bf16> untouched(h.size(), kernels::bf16{0x1234});
  try {
    l32.forward(in.inputs(), untouched.data(), DType::bf16);
    ADD_FAILURE() << "an f32 layer wrote bf16 output";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("compute = bf16"), std::string::npos) << e.what();
  }
  std::vector<kernels::bf16> q;
  AttentionInputs bad = in.inputs();
  bad.query = bf16_copy(in.query, 0, q);
  q[5 * c.d_model + 7] = kernels::to_bf16(std::nanf(""));  // (b, t, e) = (0, 5, 7)
  try {
    l.forward(bad, untouched.data(), DType::bf16);
    ADD_FAILURE() << "a NaN in a bf16 query was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("query contains NaN at (b, t, e) = (0, 5, 7)"), std::string::npos) << e.what();
  }
  for (const kernels::bf16& x : untouched) ASSERT_EQ(x.bits, 0x1234) << "a refused call wrote its output";
}
// implementation() names the bf16 row the layer runs and oneDNN's kernel for its projections: a bf16 GEMM, never
// oneDNN's reference loops (and on a CPU with AVX512-BF16, one of oneDNN's bf16 kernels: avx512_core_bf16, or
// avx512_core_amx_bf16 where the CPU has AMX).
TEST_P(FastPathBf16Io, ImplementationNamesTheBf16Kernels) {
  const Config c = make_config(64, 4, 0, 0, 0, true);
  MultiHeadAttention l(c, Weights::random(c, 930), EngineOptions{.threads = 2, .isa = isa(), .compute = DType::bf16});
  const std::string impl = l.implementation();
  EXPECT_NE(impl.find(std::string("kernels bf16/") + to_string(test::kernel_level(isa(), DType::bf16))),
            std::string::npos)
      << impl;
  EXPECT_EQ(impl.find("onednn-matmul/ref"), std::string::npos) << "oneDNN fell back to its reference GEMM: " << impl;
  if (isa_supported(Isa::avx512_bf16) && onednn_cap().empty()) {
    EXPECT_TRUE(impl.find("brg:avx512_core_bf16") != std::string::npos ||
                impl.find("brg:avx512_core_amx_bf16") != std::string::npos)
        << impl;
  }
}

// Below AVX-512 oneDNN 2.6 has no bf16 matmul (a CPU without it, or oneDNN capped by ONEDNN_MAX_CPU_ISA, as ctest's
// `bf16_on_f32_gemms` runs the bf16 suites): a bf16 layer's projections then multiply its bf16-rounded weights and
// activations in f32 GEMMs (engine/linear.hpp, gemm_), and agree with the reference run on the rounded inputs within
// the bf16 bound, self- and cross-attention with d_in, kdim and vdim of their own. The GEMM itself, strides and bf16
// output: Bf16Linear below.
TEST_P(FastPathBf16Io, ProjectionsWithoutOneDnnBf16MultiplyInF32) {
  if (!onednn_below_avx512()) GTEST_SKIP() << "oneDNN runs bf16 GEMMs here; ctest's bf16_on_f32_gemms runs this";
  for (bool self : {true, false}) {
    const Config c = make_config(48, 4, self ? 0 : 40, self ? 0 : 24, self ? 0 : 32, self);
    const Weights w = Weights::random(c, 960 + self);
    MultiHeadAttention l(c, w, EngineOptions{.threads = 2, .isa = isa(), .compute = DType::bf16});
    EXPECT_NE(l.implementation().find("(f32 on bf16 values)"), std::string::npos) << l.implementation();
    const OwnedInputs in = simple_inputs(c, 2, 33, self ? 33 : 7, self, 970 + self, 2.0f);
    EXPECT_TRUE(test::bf16_matches_reference(l, w, in, RunOptions{}, self ? "self, f32 GEMMs" : "cross, f32 GEMMs"));
  }
}

// oneDNN 2.6's AMX bf16 GEMM kills the process (SIGILL) for some inner dimensions that are not a multiple of 32
// (engine/linear.cpp, skip_amx): on an AMX CPU this case did, at one thread, in its 200x63 times 63x2 query
// projection. Such projections run on a kernel without AMX, and agree with the reference. Elsewhere it runs as any
// bf16 case.
TEST_P(FastPathBf16Io, RaggedInnerDimensionStaysOffAmx) {
  const Config c = make_config(6, 3, 63, 3, 84, false);
  const Weights w = Weights::random(c, 940);
  const OwnedInputs in = simple_inputs(c, 3, 200, 16, false, 941);
  for (int threads : {1, 2}) {
    MultiHeadAttention l(c, w, EngineOptions{.threads = threads, .isa = isa(), .compute = DType::bf16});
    EXPECT_EQ(l.implementation().find("amx"), std::string::npos) << l.implementation();
    EXPECT_TRUE(test::bf16_matches_reference(l, w, in, RunOptions{}, "inner dimensions 63, 3 and 84"));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathBf16Io);

// oneDNN 2.6 runs a GEMM none of its JIT kernels takes on its reference loop ("ref:any"), hundreds of times slower: on an
// Intel Xeon (model 207) the output projection's strided panels did, 20.4 s of gpt2-small's prefill. No projection of
// forward (a dense and a row-strided input), extend or a long ragged step may land there, in f32 and bf16 compute,
// with compute-type, int8 and int4 weights (oneDNN's choices do not depend on the layer's instruction set).
TEST(OneDnnGemms, NoneRunsOnTheReferenceImplementation) {
  Config c = make_config(128, 2, 0, 0, 0, true);
  c.context_length = 256;
  const Weights w = Weights::random(c, 77);
  std::mt19937_64 rng(78);
  const int64_t T = 70, W = 128, ld = W + 2;
  const std::vector<float> x = test::random_uniform(static_cast<size_t>(2 * T * ld), rng);
  for (DType compute : {DType::f32, DType::bf16}) {
    for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
      CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .compute = compute, .weights = f});
      Workspace ws;
      std::vector<float> out(static_cast<size_t>(2 * T * W));
      block.forward(x.data(), 2, T, out.data(), {}, &ws);
      AttentionInputs in;
      in.query = TensorView::f32(x.data(), {2, T, W}).with_strides({T * ld, ld, 1});
      block.layer().forward(in, out.data(), {}, &ws);
      KvCacheOptions opts;
      opts.capacity_tokens = 512;
      KvCache cache(block.config(), opts);
      const SequenceId ids[2] = {cache.create(), cache.create()};
      block.extend(cache, ids[0], x.data(), T, out.data(), {}, &ws);
      const int64_t tokens[2] = {1, 79};
      block.step(cache, ids, tokens, 2, x.data(), out.data(), {}, &ws);
      EXPECT_EQ(ws.impl().exec.reference_entries(), 0u)
          << to_string(compute) << " compute, " << to_string(f) << " weights: " << block.layer().implementation();
    }
  }
}

// A bf16 Linear multiplies the bf16-rounded weights and inputs and sums the products in f32, whichever GEMM oneDNN has:
// a bf16 one, or f32 on the bf16 values where it has none (ctest's bf16_on_f32_gemms). Checked against a double sum of
// the same rounded products within an f32 summation bound, (K + 1) 2^-24 sum |terms|, which unrounded weights break
// (checked too), with row strides past the widths (lda = K + 3, ldc = N + 5: the padding is never written), in f32
// and in bf16 output.
TEST(Bf16Linear, SumsTheProductsOfRoundedValuesInF32) {
  const int64_t M = 37, K = 70, N = 45, lda = K + 3, ldc = N + 5;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(N * K)), bias(static_cast<size_t>(N));
  for (float& v : w) v = nd(rng);  // not bf16 values: the Linear rounds them once
  for (float& v : bias) v = nd(rng);
  std::vector<kernels::bf16> x(static_cast<size_t>(M * lda));
  for (kernels::bf16& v : x) v = kernels::to_bf16(nd(rng));
  const detail::Linear lin(TensorView::f32(w.data(), {N, K}), bias.data(), DType::bf16);
  // x as the Linear reads it (operand()): bf16, or the same values widened to f32 on f32 GEMMs.
  std::vector<float> x_wide(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_wide[i] = kernels::widen(x[i]);
  const void* x_in = lin.operand() == DType::bf16 ? static_cast<const void*>(x.data()) : x_wide.data();
  detail::ExecContext ctx;
  constexpr uint16_t kPad = 0x7fc1;
  std::vector<float> y(static_cast<size_t>(M * ldc), std::nanf(""));
  std::vector<kernels::bf16> yb(y.size(), kernels::bf16{kPad});
  lin.run(ctx, x_in, M, lda, y.data(), ldc, 1, 0, DType::f32);
  lin.run(ctx, x_in, M, lda, yb.data(), ldc, 1, 0, DType::bf16);
  double worst_unrounded = 0;  // how far unrounded weights would land, in units of the bound
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t n = 0; n < ldc; ++n) {
      const size_t at = static_cast<size_t>(i * ldc + n);
      if (n >= N) {
        ASSERT_TRUE(std::isnan(y[at]) && yb[at].bits == kPad) << "row " << i << " padding column " << n << " written";
        continue;
      }
      double sum = bias[static_cast<size_t>(n)], unrounded = sum, mag = std::fabs(sum);
      for (int64_t k = 0; k < K; ++k) {
        const double xv = kernels::widen(x[static_cast<size_t>(i * lda + k)]);
        const float wv = w[static_cast<size_t>(n * K + k)];
        const double t = static_cast<double>(kernels::widen(kernels::to_bf16(wv))) * xv;
        sum += t, unrounded += static_cast<double>(wv) * xv, mag += std::fabs(t);
      }
      const double bound = static_cast<double>(K + 1) * std::ldexp(mag, -24);
      ASSERT_LE(std::fabs(y[at] - sum), bound) << "(" << i << ", " << n << "): " << y[at] << " against " << sum;
      ASSERT_LE(std::fabs(kernels::widen(yb[at]) - y[at]), std::ldexp(std::fabs(y[at]), -8) + bound)
          << "(" << i << ", " << n << "): bf16 output " << kernels::widen(yb[at]) << ", f32 output " << y[at];
      worst_unrounded = std::max(worst_unrounded, std::fabs(unrounded - sum) / bound);
    }
  }
  EXPECT_GT(worst_unrounded, 10.0) << "the bound would not tell rounded weights from unrounded ones";
}

}  // namespace
}  // namespace gpt2attn
