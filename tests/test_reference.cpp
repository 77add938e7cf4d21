// tests/test_reference.cpp: pins the naive reference (reference_forward) to hand-computed values, to numbers from
// torch.nn.MultiheadAttention, and to properties (mask kinds agree, causal alignment, strides, dropout contract).
// The fast path is compared against this reference elsewhere; nothing here runs MultiHeadAttention.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/reference.hpp"
#include "kernels/bf16.hpp"

namespace gpt2attn {
namespace {

// Reference against reference or against float64 torch: both sides accumulate in double, so the allowed error
// is a few double ulps, not tolerance.hpp's float policy (which is for f32 outputs against this reference).
::testing::AssertionResult near(const std::vector<double>& got, const std::vector<double>& want,
                                double tol = 1e-12) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  }
  int bad = 0;
  std::string msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    if (!(err <= tol * (1.0 + std::fabs(want[i])))) {
      if (bad++ < 5) {
        msg += "\n  [" + std::to_string(i) + "] expected " + std::to_string(want[i]) + " got " +
               std::to_string(got[i]);
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ" << msg;
}

bool all_finite(const std::vector<double>& v) {
  for (double x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

std::vector<float> uniform(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Weights filled here (not by Weights::random) so these tests depend on nothing but the reference.
Weights random_weights(const Config& c, uint32_t seed) {
  const size_t E = c.d_model;
  Weights w;
  w.w_q = uniform(E * c.query_width(), seed + 1);
  w.w_k = uniform(E * c.key_width(), seed + 2);
  w.w_v = uniform(E * c.value_width(), seed + 3);
  w.w_o = uniform(E * E, seed + 4);
  if (c.qkv_bias) {
    w.b_q = uniform(E, seed + 5);
    w.b_k = uniform(E, seed + 6);
    w.b_v = uniform(E, seed + 7);
  }
  if (c.out_bias) w.b_o = uniform(E, seed + 8);
  return w;
}

std::vector<float> identity(int64_t n) {
  std::vector<float> m(static_cast<size_t>(n * n), 0.0f);
  for (int64_t i = 0; i < n; ++i) m[i * n + i] = 1.0f;
  return m;
}

Config make_config(int64_t E, int64_t H) {
  Config c;
  c.d_model = E;
  c.num_heads = H;
  c.context_length = 128;
  return c;
}

// Rows [r0, r1) of the (B*T, E) output, flattened: one query position's result for all its features.
std::vector<double> row(const std::vector<double>& out, int64_t E, int64_t r) {
  return std::vector<double>(out.begin() + r * E, out.begin() + (r + 1) * E);
}

std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ---------------------------------------------------------------------------------------------------------------
// Hand-computed: E = 2, H = 1 (D = 2), identity weights, zero biases, so Q = K = V = x and s_ij = x_i.x_j / sqrt 2.
// x0 = (1, 0), x1 = (0, 1), x2 = (1, 1); with a = 1/sqrt 2:
//   row 0: s = (a, 0, a)   -> p = (e^a, 1, e^a) / (1 + 2e^a) -> out = (2e^a, 1 + e^a) / (1 + 2e^a)
//   row 1: s = (0, a, a)   -> out = (1 + e^a, 2e^a) / (1 + 2e^a)
//   row 2: s = (a, a, 2a)  -> p = (1, 1, e^a) / (2 + e^a)    -> out = (1 + e^a, 1 + e^a) / (2 + e^a)
// Causal: row 0 sees x0 only -> (1, 0); row 1: s = (0, a) -> (1, e^a) / (1 + e^a); row 2 as above.
TEST(ReferenceHand, TinyIdentityWeights) {
  Config c = make_config(2, 1);
  Weights w;
  w.w_q = w.w_k = w.w_v = w.w_o = identity(2);
  w.b_q = w.b_k = w.b_v = w.b_o = {0.0f, 0.0f};
  const std::vector<float> x = {1, 0, 0, 1, 1, 1};
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, 3, 2});

  const double ea = std::exp(1.0 / std::sqrt(2.0));
  const std::vector<double> want = {2 * ea / (1 + 2 * ea), (1 + ea) / (1 + 2 * ea),  // row 0
                                    (1 + ea) / (1 + 2 * ea), 2 * ea / (1 + 2 * ea),  // row 1
                                    (1 + ea) / (2 + ea),     (1 + ea) / (2 + ea)};   // row 2
  const std::vector<double> got = reference_forward(c, w, in);
  EXPECT_TRUE(near(got, want));
  // The same numbers written out, in case the closed forms above share a mistake with the code.
  EXPECT_NEAR(got[0], 0.8022241853595719, 1e-15);
  EXPECT_NEAR(got[1], 0.5988879073202141, 1e-15);
  EXPECT_NEAR(got[4], 0.7517449217422769, 1e-15);

  c.causal = true;
  const std::vector<double> want_causal = {1.0, 0.0, 1 / (1 + ea), ea / (1 + ea), want[4], want[5]};
  EXPECT_TRUE(near(reference_forward(c, w, in), want_causal));
  EXPECT_NEAR(want_causal[2], 0.3302384506733431, 1e-15);
}

// ---------------------------------------------------------------------------------------------------------------
// Golden numbers from torch 1.13 in float64, with weights and inputs that are exact in float, so the only error
// is double rounding. The generator (kept out of the repo) used exactly these two fill formulas.
std::vector<float> wfill(int64_t n, int64_t c) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i * 37 + c * 11) % 19) - 9) / 16.0f;
  return v;
}
std::vector<float> xfill(int64_t n, int64_t c) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i * 23 + c * 7) % 17) - 8) / 8.0f;
  return v;
}

// torch.nn.MultiheadAttention(4, 2, bias=True, batch_first=True), in_proj = cat(w_q, w_k, w_v); x (2, 3, 4).
TEST(ReferenceTorchGolden, SelfAttentionWithBlockMaskAndKeyPadding) {
  const int64_t E = 4, B = 2, T = 3;
  Config c = make_config(E, 2);
  Weights w;
  w.w_q = wfill(E * E, 1), w.w_k = wfill(E * E, 2), w.w_v = wfill(E * E, 3), w.w_o = wfill(E * E, 4);
  w.b_q = wfill(E, 5), w.b_k = wfill(E, 6), w.b_v = wfill(E, 7), w.b_o = wfill(E, 8);
  const std::vector<float> x = xfill(B * T * E, 9);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  const std::vector<double> plain = {
      0.057663757016142236, 0.64288956744578285, -0.072062440522222632, -0.13284382323554453,
      0.055839646572567014, 0.64594656343714973, -0.069032710168132533, -0.13157912589878723,
      0.059257910346726672, 0.64084659412450728, -0.074604521694974252, -0.13388181913435579,
      0.055448079758961988, 0.43932616994860008, -0.02600030911228618,  -0.10433725861365048,
      0.052614936856355515, 0.44979257508012271, -0.023802087261369731, -0.10396862394583328,
      0.050214473224979128, 0.44696608573375213, -0.023025544232933348, -0.10434735606641972};
  EXPECT_TRUE(near(reference_forward(c, w, in), plain));

  // attn_mask (bool, True = blocked) and key_padding_mask, as torch takes them.
  const std::vector<uint8_t> block = {0, 1, 0, 0, 0, 1, 1, 0, 0};
  const std::vector<uint8_t> padding = {0, 0, 1, 0, 0, 0};
  in.attn_mask = TensorView::u8(block.data(), {T, T});
  in.mask_kind = MaskKind::block;
  in.key_padding = TensorView::u8(padding.data(), {B, T});
  const std::vector<double> masked = {
      -0.1484375,          1.0126953125,        0.08642578125,        -0.10693359375,
      0.02823956083445911, 0.69105820094477866, -0.074380513693981687, -0.14501866841091232,
      0.2177734375,        0.34326171875,       -0.24560546875,       -0.18505859375,
      0.12920700182415212, 0.34409655039430315, -0.065288980649434475, -0.10251771429540298,
      0.12144956173593044, 0.17167781977008173, -0.061044421753295289, -0.10263751866630412,
      -0.094140475710189686, 0.81226768149697093, 0.055894051736739225, -0.10661850369850767};
  EXPECT_TRUE(near(reference_forward(c, w, in), masked));
}

// torch.nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True); query (2, 2, 4), key (2, 4, 3),
// value (2, 4, 5): cross-attention with Tk != T and key/value widths != E.
TEST(ReferenceTorchGolden, CrossAttentionKdimVdim) {
  const int64_t E = 4, B = 2, T = 2, Tk = 4, kd = 3, vd = 5;
  Config c = make_config(E, 2);
  c.kdim = kd;
  c.vdim = vd;
  Weights w;
  w.w_q = wfill(E * E, 11), w.w_k = wfill(E * kd, 12), w.w_v = wfill(E * vd, 13), w.w_o = wfill(E * E, 14);
  w.b_q = wfill(E, 15), w.b_k = wfill(E, 16), w.b_v = wfill(E, 17), w.b_o = wfill(E, 18);
  const std::vector<float> q = xfill(B * T * E, 19), k = xfill(B * Tk * kd, 20), v = xfill(B * Tk * vd, 21);
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, E});
  in.key = TensorView::f32(k.data(), {B, Tk, kd});
  in.value = TensorView::f32(v.data(), {B, Tk, vd});
  const std::vector<double> want = {
      -0.39739119979475057, 0.41135042506658415, 0.040584971544251808, -0.33018048197808059,
      -0.41203563645243019, 0.42424998997693841, 0.046427174461597165, -0.33139564105374408,
      -0.5880193843989272,  0.47402844692412627, 0.051865526649425592, -0.37029739362527514,
      -0.56947288378611582, 0.45506140777404003, 0.043875313707631897, -0.36731078035877629};
  EXPECT_TRUE(near(reference_forward(c, w, in), want));
}

// Seed 004's MultiHeadAttention(d_in=6, d_out=4, num_heads=2, qkv_bias=False), causal, out_proj with bias.
TEST(ReferenceTorchGolden, Seed004DinDiffersFromE) {
  const int64_t d_in = 6, E = 4, B = 2, T = 3;
  Config c = make_config(E, 2);
  c.d_in = d_in;
  c.causal = true;
  c.qkv_bias = false;
  Weights w;
  w.w_q = wfill(E * d_in, 31), w.w_k = wfill(E * d_in, 32), w.w_v = wfill(E * d_in, 33);
  w.w_o = wfill(E * E, 34), w.b_o = wfill(E, 35);
  const std::vector<float> x = xfill(B * T * d_in, 36);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, d_in});
  const std::vector<double> want = {
      -0.1962890625,        -0.1806640625,        -0.1650390625,        -1.1142578125,
      -0.31798371906043849, -0.27851685405437104, -0.23904998904830363, -0.49878560315885684,
      -0.29110345718108305, -0.33184184633371583, -0.37258023548634861, -0.32890335520026648,
      -0.25390625,          -0.388671875,         -0.5234375,           -0.3427734375,
      -0.22183532995653291, -0.39944924076927785, -0.57706315158202282, -0.1986412564124469,
      -0.19607406228777496, -0.39134485232170751, -0.58661564235564001, -0.2519413339043764};
  EXPECT_TRUE(near(reference_forward(c, w, in), want));
}

// ---------------------------------------------------------------------------------------------------------------
// Heads are independent: with block-diagonal W_q/W_k/W_v/W_o, head h of an H-head layer is a 1-head layer of
// width D run on the query's slice [h*D, (h+1)*D) (read through a strided view of the same buffer).
TEST(ReferenceProperties, HeadsMatchSingleHeadWithBlockDiagonalWeights) {
  const int64_t E = 6, H = 3, D = 2, B = 2, T = 4;
  Config c = make_config(E, H);
  Config c1 = make_config(D, 1);
  std::vector<Weights> per_head;
  Weights w;
  w.w_q.assign(E * E, 0.0f), w.w_k.assign(E * E, 0.0f), w.w_v.assign(E * E, 0.0f), w.w_o.assign(E * E, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    per_head.push_back(random_weights(c1, 100 + 10 * static_cast<uint32_t>(h)));
    const Weights& p = per_head.back();
    for (int64_t r = 0; r < D; ++r) {
      for (int64_t k = 0; k < D; ++k) {
        const int64_t dst = (h * D + r) * E + h * D + k, src = r * D + k;
        w.w_q[dst] = p.w_q[src], w.w_k[dst] = p.w_k[src], w.w_v[dst] = p.w_v[src], w.w_o[dst] = p.w_o[src];
      }
    }
    w.b_q.insert(w.b_q.end(), p.b_q.begin(), p.b_q.end());
    w.b_k.insert(w.b_k.end(), p.b_k.begin(), p.b_k.end());
    w.b_v.insert(w.b_v.end(), p.b_v.begin(), p.b_v.end());
    w.b_o.insert(w.b_o.end(), p.b_o.begin(), p.b_o.end());
  }
  const std::vector<float> x = uniform(B * T * E, 7);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  const std::vector<double> out = reference_forward(c, w, in);
  for (int64_t h = 0; h < H; ++h) {
    AttentionInputs in1;
    in1.query = TensorView::f32(x.data() + h * D, {B, T, D}).with_strides({T * E, E, 1});
    const std::vector<double> out1 = reference_forward(c1, per_head[h], in1);
    std::vector<double> slice;
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t d = 0; d < D; ++d) slice.push_back(out[r * E + h * D + d]);
    }
    EXPECT_TRUE(near(slice, out1)) << "head " << h;
  }
}

// Grouped K/V heads are multi-head attention whose K/V weights repeat across each group: H_kv = 2 K/V heads
// shared by H = 6 query heads (groups of 3) give exactly the MHA output with K/V head g's rows copied to query
// heads 3g, 3g + 1, 3g + 2; and H_kv = 1 (multi-query) likewise. Cross-attention with a causal mask and T != Tk, so
// a wrong head map or a wrong K/V row stride would show.
TEST(ReferenceProperties, GroupedKvHeadsEqualMultiHeadWithRepeatedKvWeights) {
  const int64_t H = 6, D = 3, E = H * D, B = 2, T = 4, Tk = 7, kdim = 5, vdim = 4;
  for (int64_t H_kv : {2, 1}) {
    Config gqa = make_config(E, H);
    gqa.num_kv_heads = H_kv;
    gqa.kdim = kdim, gqa.vdim = vdim;
    gqa.causal = true;
    const Weights w = Weights::random(gqa, 11 + static_cast<uint64_t>(H_kv));
    Config mha = gqa;
    mha.num_kv_heads = 0;
    Weights wm = w;
    wm.w_k.clear(), wm.w_v.clear(), wm.b_k.clear(), wm.b_v.clear();
    const int64_t group = H / H_kv;
    for (int64_t h = 0; h < H; ++h) {  // query head h gets K/V head h / group's D rows
      const int64_t g = h / group;
      wm.w_k.insert(wm.w_k.end(), w.w_k.begin() + g * D * kdim, w.w_k.begin() + (g + 1) * D * kdim);
      wm.w_v.insert(wm.w_v.end(), w.w_v.begin() + g * D * vdim, w.w_v.begin() + (g + 1) * D * vdim);
      wm.b_k.insert(wm.b_k.end(), w.b_k.begin() + g * D, w.b_k.begin() + (g + 1) * D);
      wm.b_v.insert(wm.b_v.end(), w.b_v.begin() + g * D, w.b_v.begin() + (g + 1) * D);
    }
    const std::vector<float> q = uniform(B * T * E, 3), k = uniform(B * Tk * kdim, 4), v = uniform(B * Tk * vdim, 5);
    AttentionInputs in;
    in.query = TensorView::f32(q.data(), {B, T, E});
    in.key = TensorView::f32(k.data(), {B, Tk, kdim});
    in.value = TensorView::f32(v.data(), {B, Tk, vdim});
    EXPECT_TRUE(near(reference_forward(gqa, w, in), reference_forward(mha, wm, in))) << "H_kv=" << H_kv;
  }
}

// keep(m) == block(!m) == additive(m ? 0 : -inf), for u8 and f32 masks, at every rank. Cross-attention with
// T != Tk so that a transposed mask would be caught.
TEST(ReferenceMasks, KeepBlockAdditiveAgreeAtEveryRank) {
  const int64_t E = 8, H = 2, B = 2, T = 3, Tk = 5;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 1);
  const std::vector<float> q = uniform(B * T * E, 2), k = uniform(B * Tk * E, 3), v = uniform(B * Tk * E, 4);
  AttentionInputs base;
  base.query = TensorView::f32(q.data(), {B, T, E});
  base.key = TensorView::f32(k.data(), {B, Tk, E});
  base.value = TensorView::f32(v.data(), {B, Tk, E});
  const std::vector<double> unmasked = reference_forward(c, w, base);

  for (int rank = 2; rank <= 4; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const int64_t n = rank == 2 ? T * Tk : rank == 3 ? B * T * Tk : B * H * T * Tk;
    std::mt19937 rng(50 + rank);
    std::vector<uint8_t> keep_u8(n), block_u8(n);
    std::vector<float> keep_f32(n), block_f32(n), additive(n);
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = rng() % 3 != 0;
      keep_u8[i] = keep ? 1 + rng() % 255 : 0;  // any nonzero value means the same as 1
      block_u8[i] = keep ? 0 : 1;
      keep_f32[i] = keep ? 0.5f : 0.0f;
      block_f32[i] = keep ? 0.0f : -2.0f;
      additive[i] = keep ? 0.0f : -INFINITY;
    }
    auto view = [&](const void* data, DType dt) {
      if (rank == 2) return TensorView::contiguous(data, dt, {T, Tk});
      if (rank == 3) return TensorView::contiguous(data, dt, {B, T, Tk});
      return TensorView::contiguous(data, dt, {B, H, T, Tk});
    };
    auto run = [&](const void* data, DType dt, MaskKind kind) {
      AttentionInputs in = base;
      in.attn_mask = view(data, dt);
      in.mask_kind = kind;
      return reference_forward(c, w, in);
    };
    const std::vector<double> keep = run(keep_u8.data(), DType::u8, MaskKind::keep);
    EXPECT_TRUE(all_finite(keep));
    EXPECT_FALSE(near(keep, unmasked, 1e-6)) << "the mask had no effect";
    EXPECT_TRUE(near(run(block_u8.data(), DType::u8, MaskKind::block), keep));
    EXPECT_TRUE(near(run(keep_f32.data(), DType::f32, MaskKind::keep), keep));
    EXPECT_TRUE(near(run(block_f32.data(), DType::f32, MaskKind::block), keep));
    EXPECT_TRUE(near(run(additive.data(), DType::f32, MaskKind::additive), keep));
  }
}

// A rank-2 mask equals the same pattern given at rank 3 and 4 through zero (broadcast) strides.
TEST(ReferenceMasks, RankTwoEqualsBroadcastRankThreeAndFour) {
  const int64_t E = 8, H = 2, B = 2, T = 4;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 3);
  const std::vector<float> x = uniform(B * T * E, 9);
  const std::vector<float> add = uniform(T * T, 10, -3.0f, 3.0f);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  in.mask_kind = MaskKind::additive;
  in.attn_mask = TensorView::f32(add.data(), {T, T});
  const std::vector<double> r2 = reference_forward(c, w, in);
  in.attn_mask = TensorView::f32(add.data(), {B, T, T}).with_strides({0, T, 1});
  EXPECT_TRUE(near(reference_forward(c, w, in), r2));
  in.attn_mask = TensorView::f32(add.data(), {B, H, T, T}).with_strides({0, 0, T, 1});
  EXPECT_TRUE(near(reference_forward(c, w, in), r2));
}

// key_padding (B, Tk) is the rank-3 block mask m[b, i, j] = padding[b, j].
TEST(ReferenceMasks, KeyPaddingEqualsRankThreeBlockMask) {
  const int64_t E = 8, H = 2, B = 3, T = 2, Tk = 5;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 5);
  const std::vector<float> q = uniform(B * T * E, 2), k = uniform(B * Tk * E, 3), v = uniform(B * Tk * E, 4);
  const std::vector<uint8_t> pad = {0, 0, 0, 1, 1, /**/ 1, 0, 1, 0, 0, /**/ 0, 0, 0, 0, 0};
  const std::vector<float> pad_f32(pad.begin(), pad.end());
  std::vector<uint8_t> block(B * T * Tk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t j = 0; j < Tk; ++j) block[(b * T + i) * Tk + j] = pad[b * Tk + j];
    }
  }
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, E});
  in.key = TensorView::f32(k.data(), {B, Tk, E});
  in.value = TensorView::f32(v.data(), {B, Tk, E});
  const std::vector<double> unpadded = reference_forward(c, w, in);
  in.key_padding = TensorView::u8(pad.data(), {B, Tk});
  const std::vector<double> padded = reference_forward(c, w, in);
  in.key_padding = TensorView::f32(pad_f32.data(), {B, Tk});
  EXPECT_TRUE(near(reference_forward(c, w, in), padded));
  in.key_padding = {};
  in.attn_mask = TensorView::u8(block.data(), {B, T, Tk});
  in.mask_kind = MaskKind::block;
  EXPECT_TRUE(near(reference_forward(c, w, in), padded));
  // Batch 2 has no padding, so it is unchanged; batches 0 and 1 are not.
  const int64_t per_batch = T * E;
  EXPECT_TRUE(near(std::vector<double>(padded.begin() + 2 * per_batch, padded.end()),
                   std::vector<double>(unpadded.begin() + 2 * per_batch, unpadded.end())));
  EXPECT_FALSE(near(std::vector<double>(padded.begin(), padded.begin() + per_batch),
                    std::vector<double>(unpadded.begin(), unpadded.begin() + per_batch), 1e-6));
}

// ---------------------------------------------------------------------------------------------------------------
// Causal with T == Tk is seed 002's keep mask tril(ones(T, T)).
TEST(ReferenceCausal, SelfAttentionEqualsTrilKeepMask) {
  const int64_t E = 8, H = 2, B = 2, T = 5;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 11);
  const std::vector<float> x = uniform(B * T * E, 12);
  std::vector<uint8_t> tril(T * T);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < T; ++j) tril[i * T + j] = j <= i;
  }
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  Config causal = c;
  causal.causal = true;
  const std::vector<double> got = reference_forward(causal, w, in);
  in.attn_mask = TensorView::u8(tril.data(), {T, T});
  EXPECT_TRUE(near(got, reference_forward(c, w, in)));
  // Position 0 sees only itself, so it must differ from the non-causal result; the last position sees all.
  in.attn_mask = {};
  const std::vector<double> full = reference_forward(c, w, in);
  EXPECT_FALSE(near(row(got, E, 0), row(full, E, 0), 1e-6));
  EXPECT_TRUE(near(row(got, E, T - 1), row(full, E, T - 1)));
}

// Causal cross-attention with T < Tk is bottom-right aligned: query i sees keys j <= i + (Tk - T).
TEST(ReferenceCausal, BottomRightWhenQueryIsShorter) {
  const int64_t E = 8, H = 2, B = 2, T = 3, Tk = 7;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 13);
  Config causal = c;
  causal.causal = true;
  const std::vector<float> q = uniform(B * T * E, 2), k = uniform(B * Tk * E, 3), v = uniform(B * Tk * E, 4);
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, E});
  in.key = TensorView::f32(k.data(), {B, Tk, E});
  in.value = TensorView::f32(v.data(), {B, Tk, E});
  const std::vector<double> got = reference_forward(causal, w, in);
  const std::vector<double> full = reference_forward(c, w, in);

  std::vector<uint8_t> keep(T * Tk);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < Tk; ++j) keep[i * Tk + j] = j <= i + (Tk - T);
  }
  AttentionInputs masked = in;
  masked.attn_mask = TensorView::u8(keep.data(), {T, Tk});
  EXPECT_TRUE(near(got, reference_forward(c, w, masked)));

  for (int64_t b = 0; b < B; ++b) {
    // The last query sees every key.
    EXPECT_TRUE(near(row(got, E, b * T + T - 1), row(full, E, b * T + T - 1))) << "batch " << b;
    // The first query sees exactly the first Tk - T + 1 keys: the same as attending to only those keys.
    AttentionInputs first;
    first.query = TensorView::f32(q.data() + b * T * E, {1, 1, E});
    first.key = TensorView::f32(k.data() + b * Tk * E, {1, Tk - T + 1, E});
    first.value = TensorView::f32(v.data() + b * Tk * E, {1, Tk - T + 1, E});
    EXPECT_TRUE(near(row(got, E, b * T), reference_forward(c, w, first))) << "batch " << b;
  }
}

// Causal cross-attention with T > Tk: queries i < T - Tk see no key at all, so they output exactly b_o.
TEST(ReferenceCausal, QueryLongerThanKeysGivesBiasRows) {
  const int64_t E = 4, H = 2, B = 1, T = 5, Tk = 2;
  Config c = make_config(E, H);
  c.causal = true;
  const Weights w = random_weights(c, 17);
  const std::vector<float> q = uniform(B * T * E, 2), k = uniform(B * Tk * E, 3), v = uniform(B * Tk * E, 4);
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, E});
  in.key = TensorView::f32(k.data(), {B, Tk, E});
  in.value = TensorView::f32(v.data(), {B, Tk, E});
  const std::vector<double> got = reference_forward(c, w, in);
  EXPECT_TRUE(all_finite(got));
  for (int64_t i = 0; i < T - Tk; ++i) EXPECT_EQ(row(got, E, i), as_double(w.b_o)) << "row " << i;
  EXPECT_NE(row(got, E, T - Tk), as_double(w.b_o));
}

// ---------------------------------------------------------------------------------------------------------------
// A row with every key masked has p = 0, so its output is exactly b_o (and exactly 0 without an output bias),
// never NaN, whichever way the masking is expressed.
TEST(ReferenceMasks, FullyMaskedRowsGiveExactlyOutputBias) {
  const int64_t E = 8, H = 2, B = 2, T = 3;
  for (bool out_bias : {true, false}) {
    SCOPED_TRACE(out_bias ? "out_bias" : "no out_bias");
    Config c = make_config(E, H);
    c.out_bias = out_bias;
    const Weights w = random_weights(c, 19);
    const std::vector<double> bias = out_bias ? as_double(w.b_o) : std::vector<double>(E, 0.0);
    const std::vector<float> x = uniform(B * T * E, 20);
    AttentionInputs base;
    base.query = TensorView::f32(x.data(), {B, T, E});

    // Row 1 of a rank-2 mask fully masked, each kind; the other rows keep something.
    std::vector<uint8_t> keep(T * T, 1), block(T * T, 0);
    std::vector<float> additive(T * T, 0.0f);
    for (int64_t j = 0; j < T; ++j) keep[1 * T + j] = 0, block[1 * T + j] = 1, additive[1 * T + j] = -INFINITY;
    struct Case {
      const char* name;
      TensorView mask;
      MaskKind kind;
    } cases[] = {{"keep", TensorView::u8(keep.data(), {T, T}), MaskKind::keep},
                 {"block", TensorView::u8(block.data(), {T, T}), MaskKind::block},
                 {"additive", TensorView::f32(additive.data(), {T, T}), MaskKind::additive}};
    for (const Case& k : cases) {
      AttentionInputs in = base;
      in.attn_mask = k.mask;
      in.mask_kind = k.kind;
      const std::vector<double> got = reference_forward(c, w, in);
      EXPECT_TRUE(all_finite(got)) << k.name;
      for (int64_t b = 0; b < B; ++b) {
        EXPECT_EQ(row(got, E, b * T + 1), bias) << k.name << " batch " << b;
        EXPECT_NE(row(got, E, b * T + 0), bias) << k.name << " batch " << b;
      }
    }

    // An additive mask that is -inf everywhere: the whole output is b_o.
    std::vector<float> all_inf(T * T, -INFINITY);
    AttentionInputs in = base;
    in.attn_mask = TensorView::f32(all_inf.data(), {T, T});
    in.mask_kind = MaskKind::additive;
    std::vector<double> got = reference_forward(c, w, in);
    for (int64_t r = 0; r < B * T; ++r) EXPECT_EQ(row(got, E, r), bias) << "all -inf, row " << r;

    // key_padding marking every key of batch 1: batch 1 is b_o, batch 0 is not.
    const std::vector<uint8_t> pad = {0, 0, 0, 1, 1, 1};
    in = base;
    in.key_padding = TensorView::u8(pad.data(), {B, T});
    got = reference_forward(c, w, in);
    EXPECT_TRUE(all_finite(got));
    for (int64_t i = 0; i < T; ++i) {
      EXPECT_EQ(row(got, E, T + i), bias) << "key_padding, row " << i;
      EXPECT_NE(row(got, E, i), bias) << "key_padding, row " << i;
    }

    // Rank 4: row 2 of batch 0 masked in every head gives b_o; masked in one head only it does not.
    std::vector<uint8_t> keep4(B * H * T * T, 1);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < T; ++j) keep4[((0 * H + h) * T + 2) * T + j] = 0;
    }
    for (int64_t j = 0; j < T; ++j) keep4[((1 * H + 1) * T + 2) * T + j] = 0;  // batch 1, head 1 only
    in = base;
    in.attn_mask = TensorView::u8(keep4.data(), {B, H, T, T});
    got = reference_forward(c, w, in);
    EXPECT_TRUE(all_finite(got));
    EXPECT_EQ(row(got, E, 0 * T + 2), bias);
    EXPECT_NE(row(got, E, 1 * T + 2), bias);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Cross-attention with d_in, kdim, vdim and E all different and Tk != T: keys are a set, so permuting key and
// value rows together changes nothing.
TEST(ReferenceShapes, CrossAttentionAllWidthsDifferKeyOrderIrrelevant) {
  const int64_t E = 4, H = 2, B = 2, T = 2, Tk = 5, d_in = 6, kd = 3, vd = 7;
  Config c = make_config(E, H);
  c.d_in = d_in, c.kdim = kd, c.vdim = vd;
  const Weights w = random_weights(c, 23);
  const std::vector<float> q = uniform(B * T * d_in, 2), k = uniform(B * Tk * kd, 3), v = uniform(B * Tk * vd, 4);
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, d_in});
  in.key = TensorView::f32(k.data(), {B, Tk, kd});
  in.value = TensorView::f32(v.data(), {B, Tk, vd});
  const std::vector<double> got = reference_forward(c, w, in);
  ASSERT_EQ(got.size(), static_cast<size_t>(B * T * E));
  EXPECT_TRUE(all_finite(got));

  const int64_t perm[Tk] = {3, 0, 4, 2, 1};
  std::vector<float> kp(k.size()), vp(v.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < Tk; ++j) {
      for (int64_t e = 0; e < kd; ++e) kp[(b * Tk + j) * kd + e] = k[(b * Tk + perm[j]) * kd + e];
      for (int64_t e = 0; e < vd; ++e) vp[(b * Tk + j) * vd + e] = v[(b * Tk + perm[j]) * vd + e];
    }
  }
  in.key = TensorView::f32(kp.data(), {B, Tk, kd});
  in.value = TensorView::f32(vp.data(), {B, Tk, vd});
  EXPECT_TRUE(near(reference_forward(c, w, in), got));
}

// qkv_bias = out_bias = false (empty bias vectors) equals biases present and zero.
TEST(ReferenceShapes, BiasesOffEqualsZeroBiases) {
  const int64_t E = 8, H = 4, B = 2, T = 3;
  Config off = make_config(E, H);
  off.qkv_bias = off.out_bias = false;
  const Weights w_off = random_weights(off, 29);
  ASSERT_TRUE(w_off.b_q.empty() && w_off.b_o.empty());
  Config on = make_config(E, H);
  Weights w_on = w_off;
  w_on.b_q = w_on.b_k = w_on.b_v = w_on.b_o = std::vector<float>(E, 0.0f);
  const std::vector<float> x = uniform(B * T * E, 30);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  EXPECT_TRUE(near(reference_forward(off, w_off, in), reference_forward(on, w_on, in)));
}

// Every view is read through its strides: a query interleaved in a wider buffer (stride 2 along E), a query
// stored time-major (T, B, E), key/value with padded rows, and a mask stored transposed all match contiguous.
TEST(ReferenceShapes, StridedViewsMatchContiguousCopies) {
  const int64_t E = 8, H = 2, B = 2, T = 3, Tk = 4;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 31);
  const std::vector<float> q = uniform(B * T * E, 2), k = uniform(B * Tk * E, 3), v = uniform(B * Tk * E, 4);
  const std::vector<float> add = uniform(T * Tk, 5, -2.0f, 2.0f);
  AttentionInputs in;
  in.query = TensorView::f32(q.data(), {B, T, E});
  const std::vector<double> self_want = reference_forward(c, w, in);

  std::vector<float> wide(B * T * 2 * E, NAN), time_major(T * B * E);  // NaN: a wrong read cannot go unseen
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        wide[(b * T + t) * 2 * E + 2 * e] = q[(b * T + t) * E + e];
        time_major[(t * B + b) * E + e] = q[(b * T + t) * E + e];
      }
    }
  }
  in.query = TensorView::f32(wide.data(), {B, T, E}).with_strides({T * 2 * E, 2 * E, 2});
  EXPECT_TRUE(near(reference_forward(c, w, in), self_want, 0.0));
  in.query = TensorView::f32(time_major.data(), {B, T, E}).with_strides({E, B * E, 1});
  EXPECT_TRUE(near(reference_forward(c, w, in), self_want, 0.0));

  // Cross-attention: key and value rows padded to E + 3, the additive mask stored as (Tk, T) and transposed.
  AttentionInputs cross;
  cross.query = TensorView::f32(q.data(), {B, T, E});
  cross.key = TensorView::f32(k.data(), {B, Tk, E});
  cross.value = TensorView::f32(v.data(), {B, Tk, E});
  cross.attn_mask = TensorView::f32(add.data(), {T, Tk});
  cross.mask_kind = MaskKind::additive;
  const std::vector<double> cross_want = reference_forward(c, w, cross);
  const int64_t P = E + 3;
  std::vector<float> kpad(B * Tk * P, NAN), vpad(B * Tk * P, NAN), add_t(Tk * T);
  for (int64_t r = 0; r < B * Tk; ++r) {
    for (int64_t e = 0; e < E; ++e) kpad[r * P + e] = k[r * E + e], vpad[r * P + e] = v[r * E + e];
  }
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < Tk; ++j) add_t[j * T + i] = add[i * Tk + j];
  }
  cross.key = TensorView::f32(kpad.data(), {B, Tk, E}).with_strides({Tk * P, P, 1});
  cross.value = TensorView::f32(vpad.data(), {B, Tk, E}).with_strides({Tk * P, P, 1});
  cross.attn_mask = TensorView::f32(add_t.data(), {T, Tk}).with_strides({1, T});
  EXPECT_TRUE(near(reference_forward(c, w, cross), cross_want, 0.0));
}

// bf16 views (which forward() accepts) are read as bf16: the result equals that of f32 views holding the same,
// bf16-exact values. (An earlier reference read them as f32: garbage, and reads past the end.)
TEST(ReferenceShapes, Bf16ViewsReadAsTheirValues) {
  const int64_t E = 8, H = 2, B = 1, T = 3, Tk = 5;
  const Config c = make_config(E, H);
  const Weights w = random_weights(c, 32);
  std::vector<float> q = uniform(B * T * E, 6), k = uniform(B * Tk * E, 7), v = uniform(B * Tk * E, 8);
  std::vector<kernels::bf16> qb, kb, vb;
  for (auto [src, dst] : {std::pair{&q, &qb}, {&k, &kb}, {&v, &vb}}) {
    for (float& x : *src) {
      dst->push_back(kernels::to_bf16(x));
      x = kernels::widen(dst->back());  // the f32 twin holds exactly the bf16 values
    }
  }
  AttentionInputs f32_in, bf16_in;
  f32_in.query = TensorView::f32(q.data(), {B, T, E});
  f32_in.key = TensorView::f32(k.data(), {B, Tk, E});
  f32_in.value = TensorView::f32(v.data(), {B, Tk, E});
  bf16_in.query = TensorView::contiguous(qb.data(), DType::bf16, {B, T, E});
  bf16_in.key = TensorView::contiguous(kb.data(), DType::bf16, {B, Tk, E});
  bf16_in.value = TensorView::contiguous(vb.data(), DType::bf16, {B, Tk, E});
  EXPECT_TRUE(near(reference_forward(c, w, bf16_in), reference_forward(c, w, f32_in), 0.0));
}

// ---------------------------------------------------------------------------------------------------------------
// The dropout contract of attention.hpp, written out again here from the header's text.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
double dropout_uniform(uint64_t seed, uint64_t n) {
  return static_cast<double>(splitmix64(seed ^ splitmix64(n)) >> 40) * 0x1p-24;
}

TEST(ReferenceDropout, TrainingWithZeroProbabilityEqualsInference) {
  const int64_t E = 8, H = 2, B = 2, T = 4;
  Config c = make_config(E, H);
  const Weights w = random_weights(c, 37);
  const std::vector<float> x = uniform(B * T * E, 38);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  RunOptions train;
  train.training = true;
  train.dropout_seed = 1234;
  EXPECT_TRUE(near(reference_forward(c, w, in, train), reference_forward(c, w, in), 0.0));
  // And p > 0 outside training is inference too.
  Config cd = c;
  cd.dropout = 0.5f;
  EXPECT_TRUE(near(reference_forward(cd, w, in), reference_forward(c, w, in), 0.0));
}

TEST(ReferenceDropout, SameSeedReproducesDifferentSeedDiffers) {
  const int64_t E = 8, H = 2, B = 2, T = 6;
  Config c = make_config(E, H);
  c.dropout = 0.5f;
  const Weights w = random_weights(c, 41);
  const std::vector<float> x = uniform(B * T * E, 42);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  RunOptions run;
  run.training = true;
  run.dropout_seed = 7;
  const std::vector<double> a = reference_forward(c, w, in, run);
  EXPECT_TRUE(all_finite(a));
  EXPECT_EQ(a, reference_forward(c, w, in, run));
  run.dropout_seed = 8;
  EXPECT_FALSE(near(reference_forward(c, w, in, run), a, 1e-6));
  EXPECT_FALSE(near(reference_forward(c, w, in), a, 1e-6));
}

// Decodes which weights were dropped: W_q = 0 makes every score 0, so with Tk = 2 each p is 1/2; value inputs
// (1) and (10) with W_v = ones and W_o = I give out[b, i, h*D + d] = (keep_0 * 1 + keep_1 * 10) * (1/2)/(1-p).
// This pins the index n = ((b*H + h)*T + i)*Tk + j, the comparison u >= p and the 1/(1-p) scale.
TEST(ReferenceDropout, FollowsTheDocumentedHashContract) {
  ASSERT_EQ(splitmix64(0), 0xe220a8397b1dcdafULL);  // the published first output of SplitMix64 from state 0
  const int64_t E = 6, H = 3, D = 2, B = 2, T = 4, Tk = 2;
  for (float p : {0.5f, 0.25f}) {
    Config c = make_config(E, H);
    c.kdim = 1, c.vdim = 1;
    c.qkv_bias = c.out_bias = false;
    c.dropout = p;
    Weights w;
    w.w_q.assign(E * E, 0.0f);
    w.w_k.assign(E, 0.5f);
    w.w_v.assign(E, 1.0f);
    w.w_o = identity(E);
    const std::vector<float> q = uniform(B * T * E, 43), k = {1, 2, 3, 4}, v = {1, 10, 1, 10};
    AttentionInputs in;
    in.query = TensorView::f32(q.data(), {B, T, E});
    in.key = TensorView::f32(k.data(), {B, Tk, 1});
    in.value = TensorView::f32(v.data(), {B, Tk, 1});
    RunOptions run;
    run.training = true;
    run.dropout_seed = 0x5eed;
    const std::vector<double> got = reference_forward(c, w, in, run);
    const double scale = 0.5 / (1.0 - static_cast<double>(p));
    int dropped = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < T; ++i) {
          double want = 0.0;
          for (int64_t j = 0; j < Tk; ++j) {
            const uint64_t n = static_cast<uint64_t>(((b * H + h) * T + i) * Tk + j);
            if (dropout_uniform(run.dropout_seed, n) >= p) {
              want += scale * (j == 0 ? 1.0 : 10.0);
            } else {
              ++dropped;
            }
          }
          for (int64_t d = 0; d < D; ++d) {
            EXPECT_NEAR(got[(b * T + i) * E + h * D + d], want, 1e-12)
                << "p " << p << " (b, h, i, d) = (" << b << ", " << h << ", " << i << ", " << d << ")";
          }
        }
      }
    }
    EXPECT_GT(dropped, 0) << "p " << p;  // 48 draws: some must be dropped, or the test shows nothing
  }
}

// The boundary of "kept iff u >= p": seed 55257607 draws exactly u = 0.5 for n = 0 (found by search), so with
// p = 0.5 the single weight of a T = Tk = 1 call is kept and scaled by 2.
TEST(ReferenceDropout, DrawEqualToProbabilityIsKept) {
  const uint64_t seed = 55257607;
  ASSERT_EQ(dropout_uniform(seed, 0), 0.5);
  Config c = make_config(2, 1);
  c.dropout = 0.5f;
  c.qkv_bias = c.out_bias = false;
  Weights w;
  w.w_q = w.w_k = w.w_v = w.w_o = identity(2);
  const std::vector<float> x = {3.0f, -1.0f};
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {1, 1, 2});
  RunOptions run;
  run.training = true;
  run.dropout_seed = seed;
  EXPECT_EQ(reference_forward(c, w, in, run), (std::vector<double>{6.0, -2.0}));
  run.dropout_seed = seed + 1;  // any other draw either drops (0) or keeps (x / (1 - p)): never anything else
  const std::vector<double> other = reference_forward(c, w, in, run);
  EXPECT_TRUE(other == (std::vector<double>{6.0, -2.0}) || other == (std::vector<double>{0.0, 0.0}));
}

// With V = 1 everywhere (W_v = 0, b_v = 1) and uniform scores (W_q = 0), a row's attention output is
// (1/Tk) * sum_j keep_j / (1-p): mean 1 with the 1/(1-p) scale (0.5 without it, at p = 0.5), variance
// p/((1-p) Tk) = 1/Tk per row with independent per-(i, j) draws. Over N = B*H*T rows the mean's standard
// deviation is 1/sqrt(Tk N) = 1/181; the bound is 6 of those. The per-row variance is checked too, within a
// factor 2: dropping whole rows instead of single weights would give variance ~1.
TEST(ReferenceDropout, PreservesTheMeanStatistically) {
  const int64_t E = 8, H = 2, D = 4, B = 4, T = 64;
  Config c = make_config(E, H);
  c.dropout = 0.5f;
  c.out_bias = false;
  Weights w = random_weights(c, 47);
  std::fill(w.w_q.begin(), w.w_q.end(), 0.0f);
  std::fill(w.w_v.begin(), w.w_v.end(), 0.0f);
  std::fill(w.b_v.begin(), w.b_v.end(), 1.0f);
  w.w_o = identity(E);
  const std::vector<float> x = uniform(B * T * E, 48);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  EXPECT_TRUE(near(reference_forward(c, w, in), std::vector<double>(B * T * E, 1.0)));  // inference: exactly 1

  for (uint64_t seed : {1ULL, 2ULL, 3ULL}) {
    RunOptions run;
    run.training = true;
    run.dropout_seed = seed;
    const std::vector<double> got = reference_forward(c, w, in, run);
    const int64_t N = B * T * H;
    double sum = 0.0, sum_sq = 0.0;
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        const double y = got[r * E + h * D];  // the D features of one head share the same weights
        sum += y;
        sum_sq += y * y;
      }
    }
    const double mean = sum / N, var = sum_sq / N - mean * mean;
    const double sigma = 1.0 / std::sqrt(static_cast<double>(T * N));
    EXPECT_NEAR(mean, 1.0, 6.0 * sigma) << "seed " << seed;
    EXPECT_GT(var, 0.5 / T) << "seed " << seed;
    EXPECT_LT(var, 2.0 / T) << "seed " << seed;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// With check_finite off, a NaN in batch 0's query stays in batch 0: batch 1 is bit-identical to a clean run.
TEST(ReferenceNaN, NaNInOneBatchDoesNotLeak) {
  const int64_t E = 8, H = 2, B = 2, T = 4;
  Config c = make_config(E, H);
  c.causal = true;
  const Weights w = random_weights(c, 53);
  std::vector<float> x = uniform(B * T * E, 54);
  AttentionInputs in;
  in.query = TensorView::f32(x.data(), {B, T, E});
  const std::vector<double> clean = reference_forward(c, w, in);
  x[(0 * T + 1) * E + 2] = NAN;
  RunOptions run;
  run.check_finite = false;
  const std::vector<double> got = reference_forward(c, w, in, run);
  const std::vector<double> b1(got.begin() + T * E, got.end());
  EXPECT_TRUE(all_finite(b1));
  EXPECT_EQ(b1, std::vector<double>(clean.begin() + T * E, clean.end()));
  EXPECT_FALSE(all_finite(std::vector<double>(got.begin(), got.begin() + T * E)))
      << "a NaN input should show in its own batch, not be silently replaced";
  // Causal: position 0 of batch 0 never sees position 1, so it is untouched as well.
  EXPECT_EQ(row(got, E, 0), row(clean, E, 0));

  try {
    reference_forward(c, w, in);
    ADD_FAILURE() << "NaN query accepted with check_finite on";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("query contains NaN at (b, t, e) = (0, 1, 2)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace gpt2attn
