// tests/test_fastpath_sweep.cpp: the fast path (MultiHeadAttention: oneDNN projections + tiled SIMD kernel) against
// the naive reference_forward over a seeded random sweep of shapes, masks, key padding, strides and options, on
// every instruction set this CPU runs. Its own file because the generator and its coverage check are one unit;
// hand-picked shapes live in test_fastpath_tiles.cpp and run options in test_fastpath_run.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/attn_case.hpp"
#include "tests/fastpath_util.hpp"

namespace gpt2attn {
namespace {

using test::AttnCase;
using test::fast_matches_reference;
using test::FastPathTest;
using test::KeyPadding;
using test::kInf;
using test::Layout;
using test::make_tensor;
using test::MaskVariant;
using test::OwnedInputs;
using test::random_uniform;
using test::Rng;

// Case i is generated from its own fixed seed, so a failing case reproduces alone.
struct SweepCase {
  AttnCase axes;  // the axes every case has; name() heads the failure message
  Config cfg;
  Weights w;
  OwnedInputs in;
  std::string desc;  // "sweep case i: " + axes.name() + what AttnCase does not hold (amp, strides, mask layout)
  // What the case exercises beyond its axes, for the coverage check at the end of the sweep.
  bool strided_qkv = false, strided_mask = false, fully_masked = false;
  int mask_rank = 0;  // 0 = no mask
};

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
  AttnCase& a = k.axes;
  a.seed = seed;
  const int64_t B = a.B = r.between(1, 3);
  const int64_t D = a.D = r.pick(kHeadDims);
  const int64_t H = a.H = r.between(1, std::min<int64_t>(16, 512 / D));
  a.H_kv = test::kv_heads_for(H, index);
  a.self = r.chance(0.45);
  const int64_t T = a.T = r.pick(kLens);
  const int64_t Tk = a.Tk = a.self ? T : r.pick(kLens);
  Config& c = k.cfg;
  c.d_model = H * D;
  c.num_heads = H;
  c.num_kv_heads = a.H_kv;
  c.d_in = r.chance(0.5) ? 0 : r.between(3, 96);
  if (!a.self) {
    c.kdim = r.chance(0.25) ? 0 : r.between(3, 96);
    c.vdim = r.chance(0.25) ? 0 : r.between(3, 96);
  }
  c.causal = a.causal = r.chance(0.4);
  c.qkv_bias = r.chance(0.7);
  c.out_bias = r.chance(0.7);
  a.threads = 1 + index % 2;
  k.w = Weights::random(c, seed * 31 + 7);
  const float amp = r.chance(0.3) ? 3.0f : 1.0f;  // larger inputs: peakier softmax

  // Inputs, each through its own random layout.
  auto input = [&](int64_t L, int64_t W) {
    const Layout lay = random_layout(r, 3);
    if (!lay.contiguous()) k.strided_qkv = true;
    return make_tensor(random_uniform(B * L * W, r.g, -amp, amp), {B, L, W}, DType::f32, lay);
  };
  k.in.query = input(T, c.query_width());
  if (!a.self) {
    k.in.key = input(Tk, c.key_width());
    k.in.value = input(Tk, c.value_width());
  }

  // attn_mask: one of five kinds, rank 2/3/4, strided; some rows fully masked.
  std::ostringstream mdesc;
  if (r.chance(5.0 / 6.0)) {
    a.mask = test::kMaskVariants[r.between(0, static_cast<int64_t>(std::size(test::kMaskVariants)) - 1)];
    const MaskKind kind = test::mask_kind(a.mask);
    const DType dtype = test::mask_dtype(a.mask);
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
      const bool u8 = dtype == DType::u8;
      switch (kind) {
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
    k.in.attn_mask = make_tensor(m, shape, dtype, lay);
    k.in.mask_kind = kind;
    mdesc << " mask rank " << k.mask_rank << " " << lay.str() << " masked~" << share;
  }

  // key_padding (B, Tk): u8 or f32, nonzero = padding; sometimes one batch element padded entirely.
  a.padding = static_cast<KeyPadding>(r.between(0, 3) % 3);  // none (half), u8, f32
  if (a.padding != KeyPadding::none) {
    const DType dt = a.padding == KeyPadding::u8 ? DType::u8 : DType::f32;
    Layout lay = random_layout(r, 2);
    std::vector<float> p(static_cast<size_t>(B * Tk));
    for (float& x : p) x = r.chance(0.25) ? (dt == DType::u8 ? static_cast<float>(r.between(1, 255)) : -3.5f) : 0.0f;
    if (r.chance(0.35)) {
      const int64_t b = lay.broadcast[0] ? 0 : r.between(0, B - 1);
      for (int64_t j = 0; j < Tk; ++j) p[b * Tk + j] = 1.0f;
      k.fully_masked = true;
    }
    k.in.key_padding = make_tensor(p, {B, Tk}, dt, lay);
    mdesc << " key_padding " << lay.str();
  }
  if (c.causal && T > Tk) k.fully_masked = true;  // bottom-right: rows i < T - Tk see no key

  std::ostringstream d;
  d << "sweep case " << index << ": " << a.name() << " amp=" << amp
    << " query strides=(" << k.in.query.view.strides[0] << "," << k.in.query.view.strides[1] << ","
    << k.in.query.view.strides[2] << ")";
  if (!a.self) {
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
  int fully_masked = 0, no_bias = 0, threads2 = 0, grouped = 0, multi_query = 0;
  int by_rank[5] = {}, by_variant[std::size(test::kMaskVariants) + 1] = {}, by_padding[3] = {};
  int failures = 0;
  for (int i = 0; i < cases; ++i) {
    const SweepCase k = make_sweep_case(i);
    const AttnCase& a = k.axes;
    MultiHeadAttention l = layer(k.cfg, k.w, a.threads);
    const ::testing::AssertionResult ok = fast_matches_reference(l, k.w, k.in.inputs(), RunOptions{}, k.desc);
    EXPECT_TRUE(ok);
    if (!ok && ++failures >= 10) FAIL() << "stopping the sweep after 10 failing cases";
    (a.self ? self : cross)++;
    if (!a.self && a.causal && a.T != a.Tk) ++causal_cross_ragged;
    if (k.cfg.query_width() != k.cfg.d_model) ++d_in_differs;
    strided_qkv += k.strided_qkv;
    strided_mask += k.strided_mask;
    fully_masked += k.fully_masked;
    no_bias += !k.cfg.qkv_bias || !k.cfg.out_bias;
    threads2 += a.threads == 2;
    grouped += a.H_kv > 1 && a.H_kv < a.H;
    multi_query += a.H_kv == 1 && a.H > 1;
    by_rank[k.mask_rank]++;
    by_variant[static_cast<int>(a.mask)]++;
    by_padding[static_cast<int>(a.padding)]++;
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
  EXPECT_GE(grouped, 2 * min) << "grouped K/V heads (1 < H_kv < H)";
  EXPECT_GE(multi_query, 2 * min) << "multi-query (H_kv = 1 < H)";
  for (int rank = 2; rank <= 4; ++rank) EXPECT_GE(by_rank[rank], 2 * min) << "mask rank " << rank;
  for (MaskVariant v : test::kMaskVariants) EXPECT_GE(by_variant[static_cast<int>(v)], min) << to_string(v);
  EXPECT_GE(by_padding[static_cast<int>(KeyPadding::u8)], min) << "key padding u8";
  EXPECT_GE(by_padding[static_cast<int>(KeyPadding::f32)], min) << "key padding f32";
}
// bf16 compute over the same cases (every other one: the reference dominates the time), against the reference on
// the bf16-rounded weights and inputs at the bf16 policy. On avx512_bf16 and scalar this is the pair algorithm of
// the bf16 dot product (MicroBf16Dot), elsewhere the widening kernels.
TEST_P(FastPathSweep, Bf16RandomConfigsMatchReference) {
  int failures = 0;
  for (int i = 0; i < kSweepCases; i += 2) {
    const SweepCase k = make_sweep_case(i);
    MultiHeadAttention l(k.cfg, k.w, EngineOptions{.threads = k.axes.threads, .isa = isa(), .compute = DType::bf16});
    const ::testing::AssertionResult ok = test::bf16_matches_reference(l, k.w, k.in, RunOptions{}, k.desc);
    EXPECT_TRUE(ok);
    if (!ok && ++failures >= 10) FAIL() << "stopping the sweep after 10 failing cases";
  }
}

GPT2ATTN_INSTANTIATE_ISAS(Isa, FastPathSweep);

}  // namespace
}  // namespace gpt2attn
