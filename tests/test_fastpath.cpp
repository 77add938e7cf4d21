// tests/test_fastpath.cpp: the fast path (MultiHeadAttention: oneDNN projections + tiled SIMD kernel) against the
// naive reference_forward, on every instruction set this CPU runs: a seeded random sweep over shapes, masks,
// strides and options; tile-boundary shapes; a long causal sequence; dropout; threads and determinism; NaN
// isolation; CausalSelfAttention; additive masks at float32's extremes; accuracy with large heads and scores.
// It does not test the reference itself (test_reference.cpp does that), beyond its uniform rows in section 8.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/dispatch.hpp"
#include "gpt2attn/error.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::Rng;
using test::all_close;
using test::Dtype;
using test::fast_matches_reference;
using test::Layout;
using test::make_tensor;
using test::OwnedInputs;
using test::OwnedTensor;
using test::random_uniform;
using test::reduction_length;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Every test is parameterised over the forced instruction set, so ctest lists each ISA separately.
class FastPathTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU lacks " << to_string(GetParam());
  }
  Isa isa() const { return GetParam(); }
  // A layer forced onto this test's ISA; fails the test if the engine chose something else.
  MultiHeadAttention layer(const Config& c, const Weights& w, int threads) const {
    MultiHeadAttention l(c, w, EngineOptions{.threads = threads, .isa = isa()});
    EXPECT_EQ(l.isa(), isa()) << "forced " << to_string(isa()) << ", engine chose " << to_string(l.isa());
    return l;
  }
  // The kernel's own tile geometry for this ISA (query tile BQ, key tile BK), so shapes follow any retuning.
  kernels::TileShape tiles() const { return detail::attention_kernel(isa()).tiles; }
};

std::string isa_name(const ::testing::TestParamInfo<Isa>& info) { return to_string(info.param); }

#define GPT2ATTN_INSTANTIATE_ISAS(Suite) \
  INSTANTIATE_TEST_SUITE_P(Isa, Suite, ::testing::Values(Isa::avx512, Isa::avx2, Isa::scalar), isa_name)

Config make_config(int64_t E, int64_t H, int64_t d_in = 0, int64_t kdim = 0, int64_t vdim = 0, bool causal = false) {
  Config c;
  c.d_model = E;
  c.num_heads = H;
  c.d_in = d_in;
  c.kdim = kdim;
  c.vdim = vdim;
  c.causal = causal;
  return c;
}

// Contiguous random inputs: self-attention when `self`, else key (B, Tk, kdim) and value (B, Tk, vdim).
OwnedInputs simple_inputs(const Config& c, int64_t B, int64_t T, int64_t Tk, bool self, uint64_t seed,
                          float amp = 1.0f) {
  std::mt19937_64 rng(seed);
  OwnedInputs in;
  in.query = make_tensor(random_uniform(B * T * c.query_width(), rng, -amp, amp), {B, T, c.query_width()}, DType::f32);
  if (!self) {
    in.key = make_tensor(random_uniform(B * Tk * c.key_width(), rng, -amp, amp), {B, Tk, c.key_width()}, DType::f32);
    in.value =
        make_tensor(random_uniform(B * Tk * c.value_width(), rng, -amp, amp), {B, Tk, c.value_width()}, DType::f32);
  }
  return in;
}

// =============================================================================================================
// 1. Random sweep. Case i is generated from its own fixed seed, so a failing case reproduces alone.

struct SweepCase {
  Config cfg;
  Weights w;
  OwnedInputs in;
  int threads = 1;
  std::string desc;
  // What the case exercises, for the coverage check at the end of the sweep.
  bool self = true, strided_qkv = false, strided_mask = false, fully_masked = false;
  int mask_rank = 0;
  int mask_variant = -1;  // index into kMaskVariants, -1 = no mask
  int padding = 0;        // 0 none, 1 u8, 2 f32
};

struct MaskVariant {
  const char* name;
  MaskKind kind;
  DType dtype;
};
constexpr MaskVariant kMaskVariants[] = {{"keep/u8", MaskKind::keep, DType::u8},
                                         {"keep/f32", MaskKind::keep, DType::f32},
                                         {"block/u8", MaskKind::block, DType::u8},
                                         {"block/f32", MaskKind::block, DType::f32},
                                         {"additive/f32", MaskKind::additive, DType::f32}};
constexpr int kNumMaskVariants = 5;

// A random layout for a tensor of `rank`: half contiguous, else row gaps, element stride 2, batch gaps,
// transposed matrices, a stride-0 (broadcast) leading dimension, or a mix.
Layout random_layout(Rng& r, int rank, bool may_broadcast_heads = false) {
  Layout l;
  switch (r.between(0, 11)) {
    case 6: l.pad[rank - 2] = r.between(1, 7); break;
    case 7: l.elem_stride = 2; break;
    case 8: l.pad[0] = r.between(1, 33); break;
    case 9: l.transpose_last2 = true; break;
    case 10:
      l.broadcast[0] = true;
      if (may_broadcast_heads && rank == 4 && r.chance(0.5)) l.broadcast = {false, true, false, false};
      break;
    case 11:
      l.elem_stride = 2;
      l.pad[rank - 2] = r.between(1, 5);
      l.pad[0] = r.between(0, 9);
      break;
    default: break;
  }
  return l;
}

SweepCase make_sweep_case(int index) {
  constexpr int64_t kLens[] = {1, 2, 7, 33, 64, 113, 130};
  constexpr int64_t kHeadDims[] = {1, 4, 16, 64, 80, 128};
  const uint64_t seed = 0x5eed0000ull + static_cast<uint64_t>(index);
  Rng r(seed);
  SweepCase k;
  const int64_t B = r.between(1, 3);
  const int64_t D = r.pick(kHeadDims);
  const int64_t H = r.between(1, std::min<int64_t>(16, 512 / D));
  k.self = r.chance(0.45);
  const int64_t T = r.pick(kLens);
  const int64_t Tk = k.self ? T : r.pick(kLens);
  Config& c = k.cfg;
  c.d_model = H * D;
  c.num_heads = H;
  c.d_in = r.chance(0.5) ? 0 : r.between(3, 96);
  if (!k.self) {
    c.kdim = r.chance(0.25) ? 0 : r.between(3, 96);
    c.vdim = r.chance(0.25) ? 0 : r.between(3, 96);
  }
  c.causal = r.chance(0.4);
  c.qkv_bias = r.chance(0.7);
  c.out_bias = r.chance(0.7);
  k.threads = 1 + index % 2;
  k.w = Weights::random(c, seed * 31 + 7);
  const float amp = r.chance(0.3) ? 3.0f : 1.0f;  // larger inputs: peakier softmax

  // Inputs, each through its own random layout.
  auto input = [&](int64_t L, int64_t W) {
    const Layout lay = random_layout(r, 3);
    if (!lay.contiguous()) k.strided_qkv = true;
    return make_tensor(random_uniform(B * L * W, r.g, -amp, amp), {B, L, W}, DType::f32, lay);
  };
  k.in.query = input(T, c.query_width());
  if (!k.self) {
    k.in.key = input(Tk, c.key_width());
    k.in.value = input(Tk, c.value_width());
  }

  // attn_mask: one of five kinds, rank 2/3/4, strided; some rows fully masked.
  std::ostringstream mdesc;
  if (r.chance(5.0 / 6.0)) {
    k.mask_variant = static_cast<int>(r.between(0, kNumMaskVariants - 1));
    const MaskVariant& mv = kMaskVariants[k.mask_variant];
    k.mask_rank = static_cast<int>(r.between(2, 4));
    std::vector<int64_t> shape = k.mask_rank == 2   ? std::vector<int64_t>{T, Tk}
                                 : k.mask_rank == 3 ? std::vector<int64_t>{B, T, Tk}
                                                    : std::vector<int64_t>{B, H, T, Tk};
    const Layout lay = k.mask_rank == 2 ? random_layout(r, 2) : random_layout(r, k.mask_rank, true);
    k.strided_mask = !lay.contiguous();
    constexpr double kMaskedShare[] = {0.05, 0.3, 0.6};
    const double share = r.pick(kMaskedShare);
    constexpr float kNonzero[] = {1.0f, 0.5f, -2.0f, 7.0f, 255.0f};
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> m(static_cast<size_t>(n));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    auto value = [&](bool masked) -> float {
      const bool u8 = mv.dtype == DType::u8;
      switch (mv.kind) {
        case MaskKind::keep:
          if (masked) return r.chance(0.5) && !u8 ? -0.0f : 0.0f;
          return u8 ? static_cast<float>(r.between(1, 255)) : r.pick(kNonzero);
        case MaskKind::block:
          if (masked) return u8 ? static_cast<float>(r.between(1, 255)) : r.pick(kNonzero);
          return r.chance(0.5) && !u8 ? -0.0f : 0.0f;
        case MaskKind::additive: return masked ? -kInf : normal(r.g);
      }
      return 0.0f;
    };
    for (float& x : m) x = value(r.chance(share));
    // Fully masked rows: a few (b, h, i) rows masked end to end, placed where a broadcast layout keeps them.
    if (r.chance(0.4)) {
      const int64_t rows = r.between(1, 3);
      for (int64_t q = 0; q < rows; ++q) {
        const int64_t i = k.mask_rank == 2 && lay.broadcast[0] ? 0 : r.between(0, T - 1);
        int64_t base = i * Tk;
        if (k.mask_rank >= 3)
          base += (lay.broadcast[0] ? 0 : r.between(0, B - 1)) * (k.mask_rank == 4 ? H : 1) * T * Tk;
        if (k.mask_rank == 4) base += (lay.broadcast[1] ? 0 : r.between(0, H - 1)) * T * Tk;
        for (int64_t j = 0; j < Tk; ++j) m[base + j] = value(true);
      }
      k.fully_masked = true;
    }
    k.in.attn_mask = make_tensor(m, shape, mv.dtype, lay);
    k.in.mask_kind = mv.kind;
    mdesc << " mask=" << mv.name << " rank " << k.mask_rank << " " << lay.str() << " masked~" << share;
  }

  // key_padding (B, Tk): u8 or f32, nonzero = padding; sometimes one batch element padded entirely.
  k.padding = static_cast<int>(r.between(0, 3)) % 3;  // 0 none (half), 1 u8, 2 f32
  if (k.padding) {
    const DType dt = k.padding == 1 ? DType::u8 : DType::f32;
    Layout lay = random_layout(r, 2);
    std::vector<float> p(static_cast<size_t>(B * Tk));
    for (float& x : p) x = r.chance(0.25) ? (dt == DType::u8 ? static_cast<float>(r.between(1, 255)) : -3.5f) : 0.0f;
    if (r.chance(0.35)) {
      const int64_t b = lay.broadcast[0] ? 0 : r.between(0, B - 1);
      for (int64_t j = 0; j < Tk; ++j) p[b * Tk + j] = 1.0f;
      k.fully_masked = true;
    }
    k.in.key_padding = make_tensor(p, {B, Tk}, dt, lay);
    mdesc << " key_padding=" << (dt == DType::u8 ? "u8 " : "f32 ") << lay.str();
  }
  if (c.causal && T > Tk) k.fully_masked = true;  // bottom-right: rows i < T - Tk see no key

  std::ostringstream d;
  d << "sweep case " << index << " (seed 0x" << std::hex << seed << std::dec << "): B=" << B << " T=" << T
    << " Tk=" << Tk << (k.self ? " self" : " cross") << " amp=" << amp << " query strides=("
    << k.in.query.view.strides[0] << "," << k.in.query.view.strides[1] << "," << k.in.query.view.strides[2] << ")";
  if (!k.self) {
    d << " key strides=(" << k.in.key.view.strides[0] << "," << k.in.key.view.strides[1] << ","
      << k.in.key.view.strides[2] << ") value strides=(" << k.in.value.view.strides[0] << ","
      << k.in.value.view.strides[1] << "," << k.in.value.view.strides[2] << ")";
  }
  d << mdesc.str();
  k.desc = d.str();
  return k;
}

// Every ISA runs the same cases; the naive reference dominates the time (about 4 s per ISA on 2 cores).
constexpr int kSweepCases = 240;

class FastPathSweep : public FastPathTest {};

TEST_P(FastPathSweep, RandomConfigsMatchReference) {
  const int cases = kSweepCases;
  int self = 0, cross = 0, causal_cross_ragged = 0, d_in_differs = 0, strided_qkv = 0, strided_mask = 0;
  int fully_masked = 0, no_bias = 0, threads2 = 0;
  int by_rank[5] = {}, by_variant[kNumMaskVariants] = {}, by_padding[3] = {};
  int failures = 0;
  for (int i = 0; i < cases; ++i) {
    const SweepCase k = make_sweep_case(i);
    MultiHeadAttention l = layer(k.cfg, k.w, k.threads);
    const ::testing::AssertionResult ok = fast_matches_reference(l, k.w, k.in.inputs(), RunOptions{}, k.desc);
    EXPECT_TRUE(ok);
    if (!ok && ++failures >= 10) FAIL() << "stopping the sweep after 10 failing cases";
    (k.self ? self : cross)++;
    if (!k.self && k.cfg.causal && k.in.query.view.shape[1] != k.in.key.view.shape[1]) ++causal_cross_ragged;
    if (k.cfg.query_width() != k.cfg.d_model) ++d_in_differs;
    strided_qkv += k.strided_qkv;
    strided_mask += k.strided_mask;
    fully_masked += k.fully_masked;
    no_bias += !k.cfg.qkv_bias || !k.cfg.out_bias;
    threads2 += k.threads == 2;
    by_rank[k.mask_rank]++;
    if (k.mask_variant >= 0) by_variant[k.mask_variant]++;
    by_padding[k.padding]++;
  }
  // The sweep must really reach what it claims to cover; a generator change that loses a feature fails here.
  const int min = cases / 24;  // 10 of 240
  EXPECT_GE(self, 4 * min);
  EXPECT_GE(cross, 4 * min);
  EXPECT_GE(causal_cross_ragged, min);
  EXPECT_GE(d_in_differs, 4 * min);
  EXPECT_GE(strided_qkv, 4 * min);
  EXPECT_GE(strided_mask, min);
  EXPECT_GE(fully_masked, 2 * min);
  EXPECT_GE(no_bias, 2 * min);
  EXPECT_GE(threads2, cases / 2);
  for (int rank = 2; rank <= 4; ++rank) EXPECT_GE(by_rank[rank], 2 * min) << "mask rank " << rank;
  for (int v = 0; v < kNumMaskVariants; ++v) EXPECT_GE(by_variant[v], min) << kMaskVariants[v].name;
  EXPECT_GE(by_padding[1], min) << "key padding u8";
  EXPECT_GE(by_padding[2], min) << "key padding f32";
}
GPT2ATTN_INSTANTIATE_ISAS(FastPathSweep);

// =============================================================================================================
// 2. Tile boundaries: query lengths around the ISA's query tile BQ and key lengths around the key tile BK.

class FastPathTiles : public FastPathTest {
 protected:
  void check(const Config& c, int64_t B, int64_t T, int64_t Tk, bool self, uint64_t seed, const std::string& what,
             int threads = 2) {
    const Weights w = Weights::random(c, seed);
    OwnedInputs in = simple_inputs(c, B, T, Tk, self, seed + 1, 2.0f);
    MultiHeadAttention l = layer(c, w, threads);
    std::ostringstream d;
    d << what << ": B=" << B << " T=" << T << " Tk=" << Tk << (self ? " self" : " cross") << " seed " << seed
      << " BQ=" << tiles().query_tile << " BK=" << tiles().key_tile;
    EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, d.str()));
  }
};

TEST_P(FastPathTiles, QueryAndKeyLengthsAroundTiles) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  uint64_t seed = 100;
  for (int64_t T : {BQ - 1, BQ, BQ + 1, 2 * BQ + 3}) {
    for (int64_t Tk : {BK - 1, BK, BK + 1, 2 * BK + 3}) {
      for (bool causal : {false, true}) {
        check(make_config(32, 2, 0, 24, 40, causal), 2, T, Tk, false, ++seed, causal ? "cross causal" : "cross");
      }
    }
  }
  for (int64_t T : {BQ - 1, BQ, BQ + 1, 2 * BQ + 3, BK - 1, BK, BK + 1, 2 * BK + 3}) {
    for (bool causal : {false, true}) {
      check(make_config(32, 2, 0, 0, 0, causal), 2, T, T, true, ++seed, causal ? "self causal" : "self");
    }
  }
}

TEST_P(FastPathTiles, SingleQueryRow) {
  const int64_t BK = tiles().key_tile;
  uint64_t seed = 200;
  for (int64_t Tk : {int64_t{1}, BK - 1, BK, BK + 1, 2 * BK + 3}) {
    for (bool causal : {false, true}) {
      check(make_config(48, 3, 20, 0, 0, causal), 3, 1, Tk, false, ++seed, "T=1 cross");
    }
  }
  for (bool causal : {false, true}) check(make_config(48, 3, 0, 0, 0, causal), 3, 1, 1, true, ++seed, "T=1 self");
}

// Head sizes that are not a multiple of any vector width (the kernel's scalar tails), and D = 128.
TEST_P(FastPathTiles, HeadSizesWithTails) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  uint64_t seed = 300;
  for (int64_t D : {1, 3, 17, 33, 128}) {
    const int64_t H = D == 128 ? 2 : 3;
    for (bool causal : {false, true}) {
      check(make_config(H * D, H, 0, 0, 0, causal), 2, 2 * BQ + 3, 2 * BQ + 3, true, ++seed,
            "D=" + std::to_string(D) + " self");
      check(make_config(H * D, H, 0, 19, 45, causal), 2, 2 * BQ + 3, 2 * BK + 3, false, ++seed,
            "D=" + std::to_string(D) + " cross");
      check(make_config(H * D, H, 0, 19, 45, causal), 2, BQ + 1, BK - 1, false, ++seed,
            "D=" + std::to_string(D) + " cross");
    }
  }
}

// Key padding exactly on tile edges (first key, last key of a tile, first key of the next, last key).
TEST_P(FastPathTiles, KeyPaddingOnTileEdges) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  const int64_t B = 2, T = 2 * BQ + 3, Tk = 2 * BK + 3;
  for (bool causal : {false, true}) {
    const Config c = make_config(32, 2, 0, 16, 16, causal);
    const Weights w = Weights::random(c, 400 + causal);
    OwnedInputs in = simple_inputs(c, B, T, Tk, false, 410 + causal, 2.0f);
    std::vector<float> pad(B * Tk, 0.0f);
    for (int64_t j : {int64_t{0}, BK - 1, BK, 2 * BK - 1, 2 * BK, Tk - 1}) pad[1 * Tk + j] = 1.0f;
    in.key_padding = make_tensor(pad, {B, Tk}, DType::u8);
    MultiHeadAttention l = layer(c, w, 2);
    EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{},
                                       std::string("key padding on tile edges, causal=") + (causal ? "1" : "0")));
  }
}

// A masked key's score must not matter however large it is: the running max is taken over unmasked keys only,
// otherwise exp(s - m) underflows for every visible key. Key 5 (padded) and row 3's blocked keys get inputs
// of 1e4, scores around 1e7 before masking.
TEST_P(FastPathTiles, HugeScoresOfMaskedKeysDoNotMatter) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  const int64_t B = 2, T = BQ + 1, Tk = BK + 1, kdim = 8;
  const Config c = make_config(32, 2, 0, kdim, kdim);
  const Weights w = Weights::random(c, 450);
  OwnedInputs in = simple_inputs(c, B, T, Tk, false, 451);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < kdim; ++e) {
      in.key.f32[(b * Tk + 5) * kdim + e] = 1e4f * w.w_k[e];  // aligned with the weights: a huge score
      in.key.f32[(b * Tk + BK) * kdim + e] = -1e4f * w.w_k[e];
    }
  }
  std::vector<float> pad(B * Tk, 0.0f);
  for (int64_t b = 0; b < B; ++b) pad[b * Tk + 5] = pad[b * Tk + BK] = 1.0f;
  in.key_padding = make_tensor(pad, {B, Tk}, DType::u8);
  MultiHeadAttention l = layer(c, w, 2);
  EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, "huge scores on padded keys 5 and BK"));

  in.key_padding = OwnedTensor{};
  std::vector<float> keep(T * Tk, 1.0f);
  for (int64_t i = 0; i < T; ++i) keep[i * Tk + 5] = keep[i * Tk + BK] = 0.0f;
  in.attn_mask = make_tensor(keep, {T, Tk}, DType::f32);
  in.mask_kind = MaskKind::keep;
  EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, "huge scores on keep-masked keys 5 and BK"));
}

// Rows whose every key is masked must give exactly the output bias (the reference's p = 0), never NaN.
TEST_P(FastPathTiles, FullyMaskedRowsGiveOutputBias) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  const int64_t B = 2, T = BQ + 1, Tk = BK + 1, E = 32;
  for (bool out_bias : {true, false}) {
    Config c = make_config(E, 4, 0, 12, 12);
    c.out_bias = out_bias;
    const Weights w = Weights::random(c, 500 + out_bias);
    OwnedInputs in = simple_inputs(c, B, T, Tk, false, 510, 2.0f);
    std::vector<float> pad(B * Tk, 0.0f);
    for (int64_t j = 0; j < Tk; ++j) pad[1 * Tk + j] = 1.0f;  // batch 1: every key is padding
    in.key_padding = make_tensor(pad, {B, Tk}, DType::f32);
    std::vector<float> mask(T * Tk, 0.0f);  // additive: row T-1 all -inf
    for (int64_t j = 0; j < Tk; ++j) mask[(T - 1) * Tk + j] = -kInf;
    in.attn_mask = make_tensor(mask, {T, Tk}, DType::f32);
    in.mask_kind = MaskKind::additive;

    MultiHeadAttention l = layer(c, w, 2);
    const std::vector<float> got = test::run_fast(l, in.inputs());
    std::vector<float> want_rows;
    std::vector<double> b_o_rows;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        if (b == 0 && t != T - 1) continue;
        for (int64_t e = 0; e < E; ++e) {
          want_rows.push_back(got[(b * T + t) * E + e]);
          b_o_rows.push_back(out_bias ? w.b_o[e] : 0.0);
        }
      }
    }
    EXPECT_TRUE(all_close(want_rows, b_o_rows, Dtype::f32, reduction_length(c, Tk),
                          test::fast_context(l, {},
                                             std::string("fully masked rows vs b_o, out_bias=") +
                                                 (out_bias ? "1" : "0") + " (rows: batch 0 t=T-1, all of batch 1)")));
    EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, "fully masked rows"));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(FastPathTiles);

// =============================================================================================================
// 3. A long causal sequence on a small width. Causal row t depends only on tokens <= t, so the reference on a
// prefix view must equal the prefix of the fast output; the full sequence is checked once, for B = 1.

class FastPathLong : public FastPathTest {};

constexpr int64_t kLongT = 4096, kLongE = 32, kLongH = 2, kPrefix = 300;

Config long_config() {
  Config c = make_config(kLongE, kLongH, 0, 0, 0, true);
  c.context_length = kLongT;
  return c;
}

TEST_P(FastPathLong, PrefixRowsMatchReferenceOnPrefix) {
  const Config c = long_config();
  const int64_t B = 2, T = kLongT, E = kLongE;
  const Weights w = Weights::random(c, 600);
  const OwnedInputs in = simple_inputs(c, B, T, T, true, 601, 2.0f);
  MultiHeadAttention l = layer(c, w, 2);
  const std::vector<float> full = test::run_fast(l, in.inputs());

  AttentionInputs prefix = in.inputs();
  prefix.query.shape[1] = kPrefix;  // query[:, :300]: same strides, batch stride T*E
  const std::vector<double> want = reference_forward(c, w, prefix);
  std::vector<float> got;
  for (int64_t b = 0; b < B; ++b) got.insert(got.end(), full.begin() + b * T * E, full.begin() + (b * T + kPrefix) * E);
  EXPECT_TRUE(all_close(got, want, Dtype::f32, reduction_length(c, kPrefix),
                        test::fast_context(l, {},
                                           "T=4096 causal, first 300 rows of each batch (B=2) vs reference on "
                                           "query[:, :300]; index into (B, 300, E)")));
}

TEST_P(FastPathLong, FullSequenceMatchesReference) {
  const Config c = long_config();
  const Weights w = Weights::random(c, 700);
  static const OwnedInputs in = simple_inputs(c, 1, kLongT, kLongT, true, 701, 2.0f);
  static const std::vector<double> want = reference_forward(c, w, in.inputs());  // ~1 s, shared by the ISAs
  MultiHeadAttention l = layer(c, w, 2);
  const std::vector<float> got = test::run_fast(l, in.inputs());
  EXPECT_TRUE(all_close(got, want, Dtype::f32, reduction_length(c, kLongT),
                        test::fast_context(l, {}, "T=4096 causal, B=1, full sequence; index into (1, 4096, 32)")));
  // The last rows see the most keys: check them on their own so a failure there is not lost in the count.
  const size_t tail = static_cast<size_t>(kPrefix * kLongE);
  EXPECT_TRUE(all_close(std::vector<float>(got.end() - tail, got.end()),
                        std::vector<double>(want.end() - tail, want.end()), Dtype::f32, reduction_length(c, kLongT),
                        test::fast_context(l, {}, "T=4096 causal, last 300 rows; index into (300, 32)")));
}
GPT2ATTN_INSTANTIATE_ISAS(FastPathLong);

// =============================================================================================================
// 4. Dropout follows the documented hash contract exactly, so training mode matches the reference.

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
GPT2ATTN_INSTANTIATE_ISAS(FastPathDropout);

// =============================================================================================================
// 5. Threads, determinism, and one layer reused across shapes.

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
GPT2ATTN_INSTANTIATE_ISAS(FastPathThreads);

// =============================================================================================================
// 6. NaN isolation: with check_finite off, a NaN in batch 0 stays in batch 0.

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
GPT2ATTN_INSTANTIATE_ISAS(FastPathNaN);

// =============================================================================================================
// 7. CausalSelfAttention (the GPT-2 block) against the reference with a causal config.

class FastPathCausalSelf : public FastPathTest {};

TEST_P(FastPathCausalSelf, MatchesCausalReference) {
  Config c = make_config(64, 4, 48, 0, 0, false);  // causal off here: the block must turn it on
  c.context_length = 128;
  const Weights w = Weights::random(c, 1300);
  CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .isa = isa()});
  ASSERT_EQ(block.layer().isa(), isa());
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
GPT2ATTN_INSTANTIATE_ISAS(FastPathCausalSelf);

// =============================================================================================================
// 8. Additive masks at float32's extremes. torch adds the mask to the scaled scores in fp32, s + x: Hugging Face's
// masked positions hold torch.finfo(float32).min, and a row of it is uniform attention there (s + finfo.min
// rounds to finfo.min for every key), not a masked row; +3e38 and finfo.max are finite results too. Several
// key tiles, so the online rescaling meets the extremes across tiles.

class FastPathExtremeMasks : public FastPathTest {};

constexpr float kFMin = std::numeric_limits<float>::lowest(), kFMax = std::numeric_limits<float>::max();

// (B, T, E) output of uniform attention: row (b, i) averages the value projections of the keys row i sees.
std::vector<double> uniform_attention(const Config& c, const Weights& w, const OwnedInputs& in, int64_t B, int64_t T,
                                      int64_t Tk) {
  const int64_t E = c.d_model, vdim = c.value_width();
  std::vector<double> out(static_cast<size_t>(B * T * E));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> vsum(static_cast<size_t>(E), 0.0);  // sum of the V rows seen so far
    int64_t seen = 0;
    for (int64_t i = 0; i < T; ++i) {
      const int64_t n = c.causal ? std::min(Tk, i + (Tk - T) + 1) : Tk;
      for (; seen < n; ++seen) {
        for (int64_t e = 0; e < E; ++e) {
          double v = w.b_v[e];
          for (int64_t x = 0; x < vdim; ++x) {
            v += static_cast<double>(in.value.f32[(b * Tk + seen) * vdim + x]) * w.w_v[e * vdim + x];
          }
          vsum[e] += v;
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        double o = w.b_o[e];
        for (int64_t x = 0; x < E; ++x) o += vsum[x] / static_cast<double>(n) * w.w_o[e * E + x];
        out[(b * T + i) * E + e] = o;
      }
    }
  }
  return out;
}

TEST_P(FastPathExtremeMasks, MatchReferenceAndTorchSemantics) {
  const int64_t BQ = tiles().query_tile, BK = tiles().key_tile;
  const int64_t B = 2, T = BQ + 1, Tk = 2 * BK + 3;
  std::mt19937_64 rng(1500);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> normals(static_cast<size_t>(T * Tk));
  for (float& x : normals) x = normal(rng);
  // Row patterns for the last mask, by i % 8: extremes that meet across key tiles, and ordinary rows.
  auto mixed_row = [&](int64_t i, int64_t j) -> float {
    switch (i % 8) {
      case 0: return kFMin;                                   // uniform
      case 1: return j == Tk - 1 ? 0.0f : kFMin;              // running max jumps from finfo.min to a score
      case 2: return j < BK ? kFMin : 3e38f;                  // ... from finfo.min to +3e38
      case 3: return j == i % Tk ? 3e38f : kFMin;             // one key outweighs the rest
      case 4: return j % 2 ? kFMin : -kInf;                   // -inf blocks; finfo.min still attends
      case 5: return normals[i * Tk + j];                     // an ordinary additive mask
      case 6: return j < BK ? kFMax : 0.0f;                   // the first tile outweighs the rest
      default: return j >= Tk - 3 ? kFMin : 0.0f;             // Hugging Face padding at the end
    }
  };
  struct Variant {
    const char* name;
    std::function<float(int64_t, int64_t)> value;
    bool uniform;  // torch gives uniform attention over the keys each row sees
  };
  const Variant variants[] = {
      {"finfo.min everywhere", [](int64_t, int64_t) { return kFMin; }, true},
      {"finfo.min on even keys, 0 on odd", [](int64_t, int64_t j) { return j % 2 ? 0.0f : kFMin; }, false},
      {"+3e38 everywhere", [](int64_t, int64_t) { return 3e38f; }, true},
      {"finfo.max everywhere", [](int64_t, int64_t) { return kFMax; }, true},
      {"-inf on the first half of the keys, finfo.min on the rest",
       [&](int64_t, int64_t j) { return j < Tk / 2 ? -kInf : kFMin; }, false},
      {"row patterns (i % 8)", mixed_row, false},
  };
  for (bool causal : {false, true}) {
    const Config c = make_config(32, 2, 0, 24, 40, causal);
    const Weights w = Weights::random(c, 1501 + causal);
    OwnedInputs in = simple_inputs(c, B, T, Tk, false, 1503 + causal, 2.0f);
    MultiHeadAttention l = layer(c, w, 2);
    for (const Variant& v : variants) {
      std::vector<float> m(static_cast<size_t>(T * Tk));
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = 0; j < Tk; ++j) m[i * Tk + j] = v.value(i, j);
      in.attn_mask = make_tensor(m, {T, Tk}, DType::f32);
      in.mask_kind = MaskKind::additive;
      std::ostringstream d;
      d << "additive mask: " << v.name << ", causal=" << causal << " B=" << B << " T=" << T << " Tk=" << Tk;
      EXPECT_TRUE(fast_matches_reference(l, w, in.inputs(), RunOptions{}, d.str()));
      if (v.uniform) {  // the reference itself against torch's semantics, computed without any softmax
        EXPECT_TRUE(all_close(reference_forward(c, w, in.inputs()), uniform_attention(c, w, in, B, T, Tk), Dtype::f32,
                              reduction_length(c, Tk), "reference vs uniform attention: " + d.str()));
      }
    }
  }
}
GPT2ATTN_INSTANTIATE_ISAS(FastPathExtremeMasks);

// =============================================================================================================
// 9. Accuracy where the softmax is ill-conditioned: d_model 512, 2 heads (D = 256), every weight U(-0.5, 0.5),
// inputs N(0, 1), so scores reach ~200 and an error in a score reaches the output ~|s| times larger. Summing
// the score dot product over D = 256 in one fp32 accumulator put this case out of tolerance (seed 16: worst
// error/allowed 1.20 non-causal, 1.17 causal; 16 of 64 seeds at T = 256 failed); summed in chunks
// (tiles::kScoreChunk) 0.50 and 0.54, and no seed failed (worst 0.96). torch fp32 on the same 64: one failed.

class FastPathAccuracy : public FastPathTest {};

TEST_P(FastPathAccuracy, LargeHeadsWithLargeScores) {
  constexpr int64_t E = 512, H = 2, T = 256;
  for (bool causal : {false, true}) {
    const Config c = make_config(E, H, 0, 0, 0, causal);
    std::mt19937_64 rng(16);
    Weights w;
    for (auto* m : {&w.w_q, &w.w_k, &w.w_v, &w.w_o}) *m = random_uniform(E * E, rng, -0.5f, 0.5f);
    for (auto* b : {&w.b_q, &w.b_k, &w.b_v, &w.b_o}) *b = random_uniform(E, rng, -0.5f, 0.5f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(T * E));
    for (float& e : x) e = normal(rng);
    OwnedInputs in;
    in.query = make_tensor(x, {1, T, E}, DType::f32);
    static std::vector<double> want[2];  // the reference (~0.5 s each), shared by the ISAs
    if (want[causal].empty()) want[causal] = reference_forward(c, w, in.inputs());
    MultiHeadAttention l = layer(c, w, 2);
    EXPECT_TRUE(all_close(test::run_fast(l, in.inputs()), want[causal], Dtype::f32, reduction_length(c, T),
                          test::fast_context(l, {},
                                             std::string("E=512 H=2 weights U(-0.5, 0.5) x N(0, 1) T=256 seed 16, "
                                                         "causal=") + (causal ? "1" : "0"))));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(FastPathAccuracy);

}  // namespace
}  // namespace gpt2attn
