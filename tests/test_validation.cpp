// tests/test_validation.cpp: every class of bad input is refused, with invalid_argument and a message naming the
// culprit, by BOTH the naive reference and MultiHeadAttention, and the layer's output buffer is left untouched.
// What valid inputs compute is tested elsewhere (test_reference.cpp and the parity tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/validate.hpp"
#include "gpt2attn/attention.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/reference.hpp"
#include "kernels/bf16.hpp"

namespace gpt2attn {
namespace {

constexpr float kSentinel = -12345.5f;

// Small sizes in the B, T, Tk, E, H vocabulary; cross-attention key/value have Tk != T.
constexpr int64_t B = 2, T = 3, Tk = 4, E = 8, H = 2;

Config small_config() {
  Config c;
  c.d_model = E;
  c.num_heads = H;
  c.context_length = 16;
  return c;
}

::testing::AssertionResult message_has(const Error& e, const std::vector<std::string>& words) {
  if (e.code() != ErrorCode::invalid_argument) {
    return ::testing::AssertionFailure() << "code " << static_cast<int>(e.code()) << " (want invalid_argument) for: "
                                         << e.what();
  }
  const std::string msg = e.what();
  for (const std::string& w : words) {
    if (msg.find(w) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << w << "\": " << msg;
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs the call through the reference and through a layer; both must throw Error(invalid_argument) whose
// message contains every word, and the layer must not have written a single output element.
void expect_rejected(const Config& c, const AttentionInputs& in, const RunOptions& run,
                     const std::vector<std::string>& words) {
  const Weights w = Weights::random(c, 1);
  try {
    reference_forward(c, w, in, run);
    ADD_FAILURE() << "reference_forward accepted the input";
  } catch (const Error& e) {
    EXPECT_TRUE(message_has(e, words)) << "reference_forward";
  }

  // Large enough for whatever (B, T, E) the query claims, so a wrongly accepted call cannot overflow it.
  size_t n = 4096;
  if (in.query.rank == 3 && in.query.shape[0] > 0 && in.query.shape[1] > 0) {
    n = std::max(n, static_cast<size_t>(in.query.shape[0] * in.query.shape[1] * c.d_model));
  }
  std::vector<float> out(n, kSentinel);
  MultiHeadAttention layer(c, w);
  try {
    layer.forward(in, out.data(), run);
    ADD_FAILURE() << "MultiHeadAttention::forward accepted the input";
  } catch (const Error& e) {
    EXPECT_TRUE(message_has(e, words)) << "MultiHeadAttention::forward";
  }
  const auto touched = std::find_if(out.begin(), out.end(), [](float x) {
    return std::memcmp(&x, &kSentinel, sizeof x) != 0;
  });
  EXPECT_TRUE(touched == out.end()) << "output written at element " << (touched - out.begin())
                                    << " although the call was refused";
}

// A config or weights problem is refused by the layer's constructor and by the reference.
void expect_construction_rejected(const Config& c, const Weights& w, const AttentionInputs& in,
                                  const std::vector<std::string>& words) {
  try {
    MultiHeadAttention layer(c, w);
    ADD_FAILURE() << "MultiHeadAttention constructor accepted it";
  } catch (const Error& e) {
    EXPECT_TRUE(message_has(e, words)) << "MultiHeadAttention constructor";
  }
  try {
    reference_forward(c, w, in);
    ADD_FAILURE() << "reference_forward accepted it";
  } catch (const Error& e) {
    EXPECT_TRUE(message_has(e, words)) << "reference_forward";
  }
}

// Valid inputs of every kind the cases below break one at a time.
class Validation : public ::testing::Test {
 protected:
  Config cfg = small_config();
  std::vector<float> q = filled(B * T * E), k = filled(B * Tk * E), v = filled(B * Tk * E);
  std::vector<float> add = std::vector<float>(B * H * T * Tk + 8, 0.0f);
  std::vector<uint8_t> u8 = std::vector<uint8_t>(B * H * T * Tk + 8, 1);
  RunOptions run;

  static std::vector<float> filled(int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
    return x;
  }
  AttentionInputs self() const {
    AttentionInputs in;
    in.query = TensorView::f32(q.data(), {B, T, E});
    return in;
  }
  AttentionInputs cross() const {
    AttentionInputs in = self();
    in.key = TensorView::f32(k.data(), {B, Tk, E});
    in.value = TensorView::f32(v.data(), {B, Tk, E});
    return in;
  }
};

// The harness itself: valid inputs pass both paths, and the layer does write its output, so "untouched" above
// means something.
TEST_F(Validation, ValidInputsAreAccepted) {
  const Weights w = Weights::random(cfg, 1);
  AttentionInputs in = cross();
  in.attn_mask = TensorView::u8(u8.data(), {B, H, T, Tk});
  in.key_padding = TensorView::f32(add.data(), {B, Tk});
  EXPECT_EQ(reference_forward(cfg, w, in, run).size(), static_cast<size_t>(B * T * E));
  std::vector<float> out(B * T * E, kSentinel);
  MultiHeadAttention layer(cfg, w);
  layer.forward(in, out.data(), run);
  for (float x : out) ASSERT_TRUE(std::isfinite(x) && x != kSentinel);
}

TEST_F(Validation, MissingQuery) {
  AttentionInputs in;
  expect_rejected(cfg, in, run, {"query", "missing"});
  in = cross();
  in.query = {};
  expect_rejected(cfg, in, run, {"query", "missing"});
}

TEST_F(Validation, QueryWrongRank) {
  AttentionInputs in = self();
  in.query = TensorView::f32(q.data(), {B * T, E});
  expect_rejected(cfg, in, run, {"query", "rank 3", "(6, 8)"});
  in.query = TensorView::f32(q.data(), {1, B, T, E});
  expect_rejected(cfg, in, run, {"query", "rank 3", "(1, 2, 3, 8)"});
}

TEST_F(Validation, QueryWrongWidth) {
  AttentionInputs in = self();
  in.query = TensorView::f32(q.data(), {B, 4, 6});
  expect_rejected(cfg, in, run, {"query", "(B, T, d_in) = (*, *, 8)", "(2, 4, 6)"});
  // d_in set explicitly: an E-wide query is now the wrong width.
  Config c = cfg;
  c.d_in = 6;
  expect_rejected(c, self(), run, {"query", "(*, *, 6)", "(2, 3, 8)"});
}

TEST_F(Validation, QueryWrongDtypeOrEmptyDimension) {
  AttentionInputs in = self();
  in.query.dtype = DType::u8;
  expect_rejected(cfg, in, run, {"query", "f32", "u8"});
  in = self();
  in.query = TensorView::f32(q.data(), {B, 0, E});
  expect_rejected(cfg, in, run, {"query", "(2, 0, 8)"});
}

TEST_F(Validation, BatchMismatchBetweenQueryAndKey) {
  AttentionInputs in = cross();
  in.key = TensorView::f32(k.data(), {1, Tk, E});
  expect_rejected(cfg, in, run, {"key", "(B, Tk, kdim) = (2, *, 8)", "(1, 4, 8)"});
  in = cross();
  in.value = TensorView::f32(v.data(), {1, Tk, E});
  expect_rejected(cfg, in, run, {"value", "(2, 4, 8)", "(1, 4, 8)"});
}

TEST_F(Validation, KeyLengthMismatchBetweenKeyAndValue) {
  AttentionInputs in = cross();
  in.value = TensorView::f32(v.data(), {B, Tk - 1, E});
  expect_rejected(cfg, in, run, {"value", "Tk", "(2, 4, 8)", "(2, 3, 8)"});
}

TEST_F(Validation, KeyWidthMustBeKdim) {
  Config c = cfg;
  c.kdim = 5;
  expect_rejected(c, cross(), run, {"key", "kdim", "(2, *, 5)", "(2, 4, 8)"});
  // Self-attention cannot feed a query of width d_in into a kdim-wide key projection.
  expect_rejected(c, self(), run, {"kdim"});
}

TEST_F(Validation, KeyWithoutValueAndValueWithoutKey) {
  AttentionInputs in = cross();
  in.value = {};
  expect_rejected(cfg, in, run, {"key given without value"});
  in = cross();
  in.key = {};
  expect_rejected(cfg, in, run, {"value given without key"});
}

TEST_F(Validation, MaskOfWrongShape) {
  AttentionInputs in = cross();
  in.attn_mask = TensorView::u8(u8.data(), {T, T});  // (T, T) where (T, Tk) is due
  expect_rejected(cfg, in, run, {"attn_mask", "(T, Tk) = (3, 4)", "got (3, 3)"});
  in.attn_mask = TensorView::u8(u8.data(), {B + 1, T, Tk});
  expect_rejected(cfg, in, run, {"attn_mask", "(B, T, Tk) = (2, 3, 4)", "got (3, 3, 4)"});
  in.attn_mask = TensorView::u8(u8.data(), {B, 1, T, Tk});  // no broadcast over H by shape: use a 0 stride
  expect_rejected(cfg, in, run, {"attn_mask", "(B, H, T, Tk) = (2, 2, 3, 4)", "got (2, 1, 3, 4)"});
  in.attn_mask = TensorView::u8(u8.data(), {Tk});
  expect_rejected(cfg, in, run, {"attn_mask", "got (4,)"});
}

// torch_mask_view: torch's and numpy's mask layouts as the exact shapes, read in place. A size-1 B or H axis and
// torch's (B * H, T, Tk) give bit-identical outputs to the same mask spelled out in full; other shapes pass through
// for forward() to refuse as above.
TEST_F(Validation, TorchMaskLayoutsReadAsTheExactShapes) {
  const Weights w = Weights::random(cfg, 4);
  MultiHeadAttention layer(cfg, w);
  auto run_with = [&](const TensorView& mask) {
    AttentionInputs in = cross();
    in.attn_mask = mask;
    in.mask_kind = MaskKind::additive;
    std::vector<float> out(static_cast<size_t>(B * T * E));
    layer.forward(in, out.data(), run);
    return out;
  };
  std::vector<float> full(static_cast<size_t>(B * H * T * Tk));  // (B, H, T, Tk)
  for (size_t i = 0; i < full.size(); ++i) full[i] = std::cos(0.71f * static_cast<float>(i));

  const TensorView bh = torch_mask_view(TensorView::f32(full.data(), {B * H, T, Tk}), B, H);
  ASSERT_EQ(bh.shape_str(), "(2, 2, 3, 4)");
  EXPECT_EQ(run_with(bh), run_with(TensorView::f32(full.data(), {B, H, T, Tk})));

  // (1, H, T, Tk): batch 0's rows for every batch; (B, 1, T, Tk): head 0's rows for every head.
  std::vector<float> over_b(full), over_h(full);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T * Tk; ++i) {
        over_b[(b * H + h) * T * Tk + i] = full[h * T * Tk + i];
        over_h[(b * H + h) * T * Tk + i] = full[b * H * T * Tk + i];
      }
  const TensorView one_b = torch_mask_view(TensorView::f32(full.data(), {1, H, T, Tk}), B, H);
  EXPECT_EQ(one_b.strides[0], 0);
  EXPECT_EQ(run_with(one_b), run_with(TensorView::f32(over_b.data(), {B, H, T, Tk})));
  const TensorView one_h =
      torch_mask_view(TensorView::f32(full.data(), {B, 1, T, Tk}).with_strides({H * T * Tk, T * Tk, Tk, 1}), B, H);
  EXPECT_EQ(run_with(one_h), run_with(TensorView::f32(over_h.data(), {B, H, T, Tk})));
  const TensorView one_b3 = torch_mask_view(TensorView::f32(full.data(), {1, T, Tk}), B, H);
  EXPECT_EQ(one_b3.shape_str(), "(2, 3, 4)");
  EXPECT_EQ(one_b3.strides[0], 0);

  // Not a torch layout: unchanged, and forward() names the problem.
  const TensorView odd = torch_mask_view(TensorView::u8(u8.data(), {B + 1, T, Tk}), B, H);
  EXPECT_EQ(odd.shape_str(), "(3, 3, 4)");
  AttentionInputs in = cross();
  in.attn_mask = odd;
  expect_rejected(cfg, in, run, {"attn_mask", "got (3, 3, 4)"});
}

// A view from a runtime shape (a file's): the same strides as from a braced list, and a shape whose strides would
// overflow int64 refused rather than wrapped.
TEST(TensorViewShape, ContiguousFromAVectorChecksItsStrides) {
  const float x = 0.0f;
  const TensorView a = TensorView::contiguous(&x, DType::f32, std::vector<int64_t>{2, 3, 4});
  const TensorView b = TensorView::contiguous(&x, DType::f32, {2, 3, 4});
  EXPECT_EQ(a.strides, b.strides);
  EXPECT_EQ(a.strides, (std::array<int64_t, 4>{12, 4, 1, 0}));
  EXPECT_NO_THROW(TensorView::contiguous(&x, DType::f32, std::vector<int64_t>{int64_t{1} << 40, 1 << 20}));
  EXPECT_THROW(TensorView::contiguous(&x, DType::f32, std::vector<int64_t>{0, int64_t{1} << 32, int64_t{1} << 32}),
               Error);
  EXPECT_THROW(TensorView::contiguous(&x, DType::f32, std::vector<int64_t>{1, 1, 1, 1, 1}), Error);
}

TEST_F(Validation, AdditiveMaskMustBeFloat) {
  AttentionInputs in = self();
  in.attn_mask = TensorView::u8(u8.data(), {T, T});
  in.mask_kind = MaskKind::additive;
  expect_rejected(cfg, in, run, {"attn_mask", "additive", "f32", "u8"});
}

TEST_F(Validation, KeyPaddingWrongShape) {
  AttentionInputs in = cross();
  in.key_padding = TensorView::u8(u8.data(), {B, Tk + 1});
  expect_rejected(cfg, in, run, {"key_padding", "(B, Tk) = (2, 4)", "got (2, 5)"});
  in.key_padding = TensorView::u8(u8.data(), {B, T, Tk});
  expect_rejected(cfg, in, run, {"key_padding", "(B, Tk) = (2, 4)", "got (2, 3, 4)"});
  in = self();  // self-attention: Tk is T
  in.key_padding = TensorView::u8(u8.data(), {B, Tk});
  expect_rejected(cfg, in, run, {"key_padding", "(B, Tk) = (2, 3)", "got (2, 4)"});
}

TEST_F(Validation, SequenceLongerThanContextLength) {
  Config c = cfg;
  c.context_length = T - 1;
  expect_rejected(c, self(), run, {"query", "sequence length T=3", "exceeds context_length=2"});
  c.context_length = Tk - 1;  // T fits, Tk does not
  expect_rejected(c, cross(), run, {"key", "Tk=4", "context_length=3"});
}

TEST_F(Validation, NonFiniteQueryKeyValue) {
  q[(1 * T + 2) * E + 5] = NAN;
  expect_rejected(cfg, self(), run, {"query", "NaN", "(b, t, e) = (1, 2, 5)"});
  q[(1 * T + 2) * E + 5] = INFINITY;
  expect_rejected(cfg, self(), run, {"query", "Inf", "(1, 2, 5)"});
  q[(1 * T + 2) * E + 5] = -INFINITY;
  expect_rejected(cfg, self(), run, {"query", "Inf", "(1, 2, 5)"});
  q[(1 * T + 2) * E + 5] = 0.0f;
  k[(0 * Tk + 3) * E + 1] = NAN;
  expect_rejected(cfg, cross(), run, {"key", "NaN", "(0, 3, 1)"});
  k[(0 * Tk + 3) * E + 1] = 0.0f;
  v[(1 * Tk + 0) * E + 7] = INFINITY;
  expect_rejected(cfg, cross(), run, {"value", "Inf", "(1, 0, 7)"});
}

// The scan reads through the strides: a NaN in a gap that the view skips is not an input, and is accepted.
TEST_F(Validation, FinitenessScanFollowsStrides) {
  std::vector<float> wide(B * T * 2 * E, NAN);
  for (size_t i = 0; i < wide.size(); i += 2) wide[i] = 0.25f;
  AttentionInputs in;
  in.query = TensorView::f32(wide.data(), {B, T, E}).with_strides({T * 2 * E, 2 * E, 2});
  const Weights w = Weights::random(cfg, 1);
  EXPECT_NO_THROW(reference_forward(cfg, w, in, run));
  wide[(1 * T + 1) * 2 * E + 2 * 3] = NAN;  // element (1, 1, 3) of the view
  expect_rejected(cfg, in, run, {"query", "NaN", "(1, 1, 3)"});
}

// The scan tests exponent bits a row at a time: the largest finite values, subnormals and -0 pass, and every kind of
// non-finite value is found and named wherever it sits in a row (the vectorised body or the tail of an odd width),
// for f32 and bf16 rows, contiguous or strided.
TEST(FinitenessScan, EdgeValuesBothDtypesAndStrides) {
  constexpr int64_t kE = 37;  // odd: a vector body and a scalar tail
  const float bad[] = {NAN, INFINITY, -INFINITY};
  const char* bad_name[] = {"NaN", "+Inf", "-Inf"};
  for (const int64_t stride : {int64_t{1}, int64_t{3}}) {
    for (const bool bf : {false, true}) {
      // The largest finite value and the smallest subnormal of the row's dtype (both exact in bf16 for bf16 rows).
      const float big = bf ? kernels::widen(kernels::bf16{0x7f7f}) : std::numeric_limits<float>::max();
      const float tiny = bf ? kernels::widen(kernels::bf16{0x0001}) : std::numeric_limits<float>::denorm_min();
      const float fine[] = {big, -big, tiny, -tiny, -0.0f, 1.0f};
      std::vector<float> f(2 * 2 * kE * stride);
      for (size_t i = 0; i < f.size(); ++i) f[i] = fine[i % std::size(fine)];
      std::vector<kernels::bf16> h(f.size());
      const auto view = [&] {
        const void* data = bf ? static_cast<const void*>(h.data()) : static_cast<const void*>(f.data());
        return TensorView::contiguous(data, bf ? DType::bf16 : DType::f32, {2, 2, kE})
            .with_strides({2 * kE * stride, kE * stride, stride});
      };
      const auto sync = [&] {
        for (size_t i = 0; i < f.size(); ++i) h[i] = kernels::to_bf16(f[i]);
      };
      sync();
      EXPECT_NO_THROW(detail::check_finite(view(), "x", "t")) << "stride " << stride << (bf ? " bf16" : " f32");
      for (int k = 0; k < 3; ++k) {
        for (const int64_t e : {int64_t{0}, int64_t{17}, kE - 1}) {
          const size_t at = static_cast<size_t>((1 * 2 * kE + 1 * kE + e) * stride);  // element (1, 1, e)
          const float keep = f[at];
          f[at] = bad[k];
          sync();
          try {
            detail::check_finite(view(), "x", "t");
            ADD_FAILURE() << bad_name[k] << " at e=" << e << " not found, stride " << stride << (bf ? " bf16" : " f32");
          } catch (const Error& err) {
            const std::string want = std::string("x contains ") + bad_name[k] + " at (b, t, e) = (1, 1, " +
                                     std::to_string(e) + ")";
            EXPECT_NE(std::string(err.what()).find(want), std::string::npos) << err.what();
          }
          f[at] = keep;
        }
      }
    }
  }
}

// With a team the scan still names the first offender in (b, t) order, wherever the others fall among the threads'
// rows; and a clean view passes. 2 x 600 rows of 128: past the size that starts a team.
TEST(FinitenessScan, TeamNamesTheFirstOffender) {
  constexpr int64_t kB = 2, kT = 600, kE = 128;
  std::vector<float> x(kB * kT * kE, 0.5f);
  const TensorView view = TensorView::f32(x.data(), {kB, kT, kE});
  for (const int threads : {1, 2, 3}) {
    EXPECT_NO_THROW(detail::check_finite(view, "x", "t", threads));
    x[(1 * kT + 550) * kE + 9] = NAN;     // the last thread's rows
    x[(1 * kT + 20) * kE + 127] = -INFINITY;
    x[(0 * kT + 599) * kE + 64] = INFINITY;  // the first offender: (0, 599, 64)
    try {
      detail::check_finite(view, "x", "t", threads);
      ADD_FAILURE() << "not refused with " << threads << " threads";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("x contains +Inf at (b, t, e) = (0, 599, 64)"), std::string::npos)
          << threads << " threads: " << err.what();
    }
    std::fill(x.begin(), x.end(), 0.5f);
  }
}

TEST_F(Validation, NaNInAdditiveMask) {
  AttentionInputs in = cross();
  in.mask_kind = MaskKind::additive;
  add[2 * Tk + 1] = -INFINITY;  // -inf is how an additive mask blocks: allowed
  in.attn_mask = TensorView::f32(add.data(), {T, Tk});
  const Weights w = Weights::random(cfg, 1);
  EXPECT_NO_THROW(reference_forward(cfg, w, in, run));
  add[1 * Tk + 3] = NAN;
  expect_rejected(cfg, in, run, {"attn_mask", "NaN", "(t, j) = (1, 3)"});
  in.attn_mask = TensorView::f32(add.data(), {B, H, T, Tk}).with_strides({0, 0, Tk, 1});
  expect_rejected(cfg, in, run, {"attn_mask", "NaN", "(b, h, t, j) = (0, 0, 1, 3)"});
}

// A float keep/block mask or key_padding reads nonzero as its decision; a NaN is refused rather than read as one
// (before, it blocked silently). Infinities are nonzero and stay decisions; u8 masks have no such value.
TEST_F(Validation, NaNInFloatDecisionMasks) {
  for (const MaskKind kind : {MaskKind::block, MaskKind::keep}) {
    SCOPED_TRACE(to_string(kind));
    AttentionInputs in = cross();
    std::vector<float> m(static_cast<size_t>(T * Tk), kind == MaskKind::keep ? 1.0f : 0.0f);
    in.mask_kind = kind;
    in.attn_mask = TensorView::f32(m.data(), {T, Tk});
    m[2] = INFINITY;  // nonzero: a decision
    EXPECT_NO_THROW(reference_forward(cfg, Weights::random(cfg, 1), in, run));
    m[static_cast<size_t>(2 * Tk + 1)] = NAN;
    expect_rejected(cfg, in, run, {std::string("attn_mask (") + to_string(kind) + ")", "NaN", "(t, j) = (2, 1)"});
  }
  AttentionInputs in = cross();
  std::vector<float> kp(static_cast<size_t>(B * Tk), 0.0f);
  in.key_padding = TensorView::f32(kp.data(), {B, Tk});
  EXPECT_NO_THROW(reference_forward(cfg, Weights::random(cfg, 1), in, run));
  kp[static_cast<size_t>(Tk + 3)] = NAN;
  expect_rejected(cfg, in, run, {"key_padding", "NaN", "(b, j) = (1, 3)"});
}

TEST_F(Validation, NonFiniteAcceptedWhenCheckIsOff) {
  q[3] = NAN;
  run.check_finite = false;
  EXPECT_NO_THROW(reference_forward(cfg, Weights::random(cfg, 1), self(), run));
}

TEST_F(Validation, NegativeThreads) {
  run.threads = -1;
  expect_rejected(cfg, self(), run, {"threads", "-1"});
}

TEST_F(Validation, NegativeStrideOrNullData) {
  AttentionInputs in = self();
  in.query = TensorView::f32(q.data() + (T - 1) * E, {B, T, E}).with_strides({T * E, -E, 1});
  expect_rejected(cfg, in, run, {"query", "negative stride"});
  in = cross();
  in.key.data = nullptr;
  expect_rejected(cfg, in, run, {"key", "null"});
  in = cross();
  in.attn_mask = TensorView::u8(nullptr, {T, Tk});
  expect_rejected(cfg, in, run, {"attn_mask", "null"});
}

// ---------------------------------------------------------------------------------------------------------------
// Config::validate and Weights::validate, reached through the layer's constructor and through the reference.
TEST_F(Validation, BadConfig) {
  const Weights w = Weights::random(cfg, 1);
  const AttentionInputs in = self();
  struct Case {
    const char* what;
    void (*edit)(Config&);
    std::vector<std::string> words;
  };
  const Case cases[] = {
      {"E not divisible by H", [](Config& c) { c.num_heads = 3; }, {"num_heads", "d_model"}},
      {"d_model 0", [](Config& c) { c.d_model = 0; }, {"d_model"}},
      {"num_heads 0", [](Config& c) { c.num_heads = 0; }, {"num_heads"}},
      {"negative d_model", [](Config& c) { c.d_model = -8; }, {"d_model"}},
      {"negative dropout", [](Config& c) { c.dropout = -0.1f; }, {"dropout"}},
      {"dropout 1", [](Config& c) { c.dropout = 1.0f; }, {"dropout"}},
      {"dropout NaN", [](Config& c) { c.dropout = NAN; }, {"dropout"}},
      {"context_length 0", [](Config& c) { c.context_length = 0; }, {"context_length"}},
      {"num_kv_heads not dividing num_heads", [](Config& c) { c.num_heads = 4, c.num_kv_heads = 3; },
       {"num_kv_heads", "num_heads"}},
      {"num_kv_heads above num_heads", [](Config& c) { c.num_kv_heads = 2 * c.num_heads; }, {"num_kv_heads"}},
      {"negative num_kv_heads", [](Config& c) { c.num_kv_heads = -1; }, {"num_kv_heads"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Config c = cfg;
    k.edit(c);
    expect_construction_rejected(c, w, in, k.words);
  }
}

TEST_F(Validation, BadWeights) {
  Weights w = Weights::random(cfg, 1);
  w.w_q.pop_back();
  expect_construction_rejected(cfg, w, self(), {"w_q"});
  w = Weights::random(cfg, 1);
  w.b_o.clear();
  expect_construction_rejected(cfg, w, self(), {"b_o"});
  // Multi-head K/V weights for a config with one K/V head (a GQA checkpoint and config that disagree).
  Config mq = cfg;
  mq.num_kv_heads = 1;
  expect_construction_rejected(mq, Weights::random(cfg, 1), self(), {"w_k"});
}

// A NaN or an infinity in any weight or bias refuses the layer, naming the tensor and the element; before, the
// layer was built and every output was NaN or Inf with no error. Checked in f32 (Weights), in bf16 and f16 views,
// and through a strided view, where the element's index is the view's, not the memory's.
TEST_F(Validation, NonFiniteWeights) {
  const AttentionInputs in = self();
  struct Case {
    std::vector<float> Weights::*tensor;
    const char* name;
    size_t at;
    const char* index;  // for rows of width E (every tensor here: the config has d_in = E)
  };
  const size_t last = static_cast<size_t>(E) - 1;
  const Case cases[] = {{&Weights::w_q, "w_q", 5, "(0, 5)"},
                        {&Weights::w_k, "w_k", static_cast<size_t>(E) + 2, "(1, 2)"},
                        {&Weights::w_v, "w_v", 0, "(0, 0)"},
                        {&Weights::w_o, "w_o", static_cast<size_t>(E * E) - 1, nullptr},
                        {&Weights::b_q, "b_q", 3, "(3)"},
                        {&Weights::b_o, "b_o", last, nullptr}};
  for (const Case& k : cases) {
    for (const float bad : {NAN, INFINITY, -INFINITY}) {
      SCOPED_TRACE(std::string(k.name) + " " + std::to_string(bad));
      Weights w = Weights::random(cfg, 1);
      (w.*k.tensor)[k.at] = bad;
      const char* word = std::isnan(bad) ? "NaN" : bad > 0 ? "+Inf" : "-Inf";
      std::vector<std::string> words{k.name, word, "finite"};
      if (k.index) words.push_back(k.index);
      expect_construction_rejected(cfg, w, in, words);
    }
  }
  // bf16 and f16 views: w_v's element (2, 7) holds the format's infinity / NaN bits.
  const Weights w = Weights::random(cfg, 1);
  const std::pair<DType, uint16_t> formats[] = {{DType::bf16, 0x7f80}, {DType::f16, 0x7e00}};  // +Inf, NaN
  for (const auto& [dtype, bits] : formats) {
    SCOPED_TRACE(to_string(dtype));
    std::vector<uint16_t> halves(static_cast<size_t>(E * E), 0);  // zeros: finite in both formats
    halves[static_cast<size_t>(2 * E + 7)] = bits;
    WeightsView view = w.view(cfg);
    view.w_v = TensorView::contiguous(halves.data(), dtype, {E, E});
    EXPECT_THROW(
        {
          try {
            MultiHeadAttention layer(cfg, view);
          } catch (const Error& e) {
            EXPECT_TRUE(message_has(e, {"w_v", dtype == DType::bf16 ? "+Inf" : "NaN", "(2, 7)"}));
            throw;
          }
        },
        Error);
  }
  // A strided view (every other column of a wider matrix): a NaN in a skipped column is not part of the weights.
  std::vector<float> wide(static_cast<size_t>(2 * E * E), 0.25f);
  wide[1] = NAN;  // column 1 of the wide matrix: not in the view
  WeightsView view = w.view(cfg);
  view.w_o = TensorView::f32(wide.data(), {E, E}).with_strides({2 * E, 2});
  EXPECT_NO_THROW(MultiHeadAttention(cfg, view));
  wide[static_cast<size_t>(2 * E * 3 + 2 * 4)] = INFINITY;  // view element (3, 4)
  EXPECT_THROW(
      {
        try {
          MultiHeadAttention layer(cfg, view);
        } catch (const Error& e) {
          EXPECT_TRUE(message_has(e, {"w_o", "+Inf", "(3, 4)"}));
          throw;
        }
      },
      Error);
}

// num_kv_heads survives the JSON round trip, and 0 (the default) reads back as num_heads.
TEST_F(Validation, KvHeadsInConfigJson) {
  Config c = cfg;
  c.num_kv_heads = 1;
  EXPECT_EQ(config_from_json(to_json(c)).kv_heads(), 1);
  c.num_kv_heads = 0;
  EXPECT_EQ(config_from_json(to_json(c)).num_kv_heads, c.num_heads);
  EXPECT_THROW(config_from_json(R"({"d_model": 8, "num_heads": 4, "num_kv_heads": 3})"), Error);
}

// ---------------------------------------------------------------------------------------------------------------
// A zero-element input, as a zero-element .npy file gives the CLI (an empty std::vector's data() is null): the
// message names the empty shape and the dimensions that must be >= 1, never a "null data pointer" the user did not
// pass; and a null, zero-length key and value must not pass for absent ones (which would mean self-attention).
TEST_F(Validation, ZeroElementInputIsNamedNotCalledNull) {
  const auto expect_no_null_word = [&](const AttentionInputs& in) {
    try {
      reference_forward(cfg, Weights::random(cfg, 1), in, run);
      ADD_FAILURE() << "reference_forward accepted the input";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("null"), std::string::npos) << e.what();
    }
  };
  AttentionInputs in;
  in.query = TensorView::f32(nullptr, {0, 5});
  expect_rejected(cfg, in, run, {"query: shape (0, 5) has no elements; B, T and the width d_in must be >= 1"});
  expect_no_null_word(in);
  in.query = TensorView::f32(nullptr, {B, 0, E});
  expect_rejected(cfg, in, run, {"query: shape (2, 0, 8) has no elements"});
  expect_no_null_word(in);
  in.query = TensorView::f32(q.data(), {0, T, E});  // the same words whether or not the pointer is null
  expect_rejected(cfg, in, run, {"query: shape (0, 3, 8) has no elements"});

  in = cross();
  in.key = TensorView::f32(nullptr, {B, 0, E});
  in.value = TensorView::f32(nullptr, {B, 0, E});
  expect_rejected(cfg, in, run, {"key: shape (2, 0, 8) has no elements; B, Tk and the width kdim must be >= 1"});
  expect_no_null_word(in);
  in = cross();
  in.attn_mask = TensorView::u8(nullptr, {T, 0});
  expect_rejected(cfg, in, run, {"attn_mask: shape (3, 0) has no elements"});
  in = cross();
  in.key_padding = TensorView::u8(nullptr, {0, Tk});
  expect_rejected(cfg, in, run, {"key_padding: shape (0, 4) has no elements; B and Tk must be >= 1"});

  // A null pointer behind a shape with elements is still that.
  in = self();
  in.query.data = nullptr;
  expect_rejected(cfg, in, run, {"query: null data pointer with non-empty shape (2, 3, 8)"});
}

}  // namespace
}  // namespace gpt2attn
