// engine/reference.cpp: the naive reference for MultiHeadAttention: plain loops, double accumulation, the full
// (T, Tk) score row per query. No OpenMP, no SIMD, no tiling, nothing shared with the fast path but validation.
#include "gpt2attn/reference.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/validate.hpp"

namespace gpt2attn {
namespace {

// Written out here from the dropout contract in attention.hpp rather than shared with the engine, so that a
// mistake in the engine's copy shows up as a mismatch instead of being reproduced.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

double dropout_uniform(uint64_t seed, uint64_t n) {
  return static_cast<double>(splitmix64(seed ^ splitmix64(n)) >> 40) * 0x1p-24;
}

// Element (i0, i1, i2) of a rank-3 f32 view, through its strides.
double at3(const TensorView& v, int64_t i0, int64_t i1, int64_t i2) {
  return static_cast<const float*>(v.data)[i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2]];
}

// Mask value for (b, h, i, j), broadcast from (T, Tk), (B, T, Tk) or (B, H, T, Tk); u8 reads as 0 / nonzero.
double mask_at(const TensorView& m, int64_t b, int64_t h, int64_t i, int64_t j) {
  int64_t off = 0;
  switch (m.rank) {
    case 2: off = i * m.strides[0] + j * m.strides[1]; break;
    case 3: off = b * m.strides[0] + i * m.strides[1] + j * m.strides[2]; break;
    default: off = b * m.strides[0] + h * m.strides[1] + i * m.strides[2] + j * m.strides[3]; break;
  }
  if (m.dtype == DType::u8) return static_cast<const uint8_t*>(m.data)[off];
  return static_cast<const float*>(m.data)[off];
}

// key_padding (B, Tk) value for (b, j); u8 reads as 0 / nonzero.
double padding_at(const TensorView& kp, int64_t b, int64_t j) {
  const int64_t off = b * kp.strides[0] + j * kp.strides[1];
  if (kp.dtype == DType::u8) return static_cast<const uint8_t*>(kp.data)[off];
  return static_cast<const float*>(kp.data)[off];
}

// Y (B, L, N) = X W^T + bias, with X (B, L, width) read through its strides and W (N, width) row-major.
std::vector<double> project(const TensorView& x, int64_t B, int64_t L, int64_t width, const std::vector<float>& w,
                            const std::vector<float>& bias, int64_t N) {
  std::vector<double> y(static_cast<size_t>(B * L * N));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < L; ++t) {
      for (int64_t e = 0; e < N; ++e) {
        double acc = bias.empty() ? 0.0 : static_cast<double>(bias[e]);
        for (int64_t c = 0; c < width; ++c) acc += at3(x, b, t, c) * static_cast<double>(w[e * width + c]);
        y[(b * L + t) * N + e] = acc;
      }
    }
  }
  return y;
}

}  // namespace

std::vector<double> reference_forward(const Config& config, const Weights& weights, const AttentionInputs& in,
                                      const RunOptions& run) {
  config.validate();
  weights.validate(config);
  const detail::AttnShape s = detail::validate_inputs(config, in, run);
  const int64_t B = s.B, T = s.T, Tk = s.Tk, E = s.E, H = s.H, D = s.D;
  const int64_t KW = config.kv_width(), group = H / config.kv_heads();  // query head h reads K/V head h / group

  // Q (B, T, E), K (B, Tk, KW), V (B, Tk, KW); self-attention projects the query three times.
  const TensorView& key_in = s.self_attention ? in.query : in.key;
  const TensorView& value_in = s.self_attention ? in.query : in.value;
  const std::vector<double> Q = project(in.query, B, T, s.d_in, weights.w_q, weights.b_q, E);
  const std::vector<double> K = project(key_in, B, Tk, s.kdim, weights.w_k, weights.b_k, KW);
  const std::vector<double> V = project(value_in, B, Tk, s.vdim, weights.w_v, weights.b_v, KW);

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const bool dropout = run.training && config.dropout > 0.0f;
  const double p_drop = config.dropout;
  const double keep_scale = 1.0 / (1.0 - p_drop);

  std::vector<double> ctx(static_cast<size_t>(B * T * E), 0.0);  // (B, T, E): heads concatenated
  std::vector<double> score(static_cast<size_t>(Tk));
  std::vector<char> masked(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const double* q = &Q[(b * T + i) * E + h * D];
        for (int64_t j = 0; j < Tk; ++j) {
          const double* k = &K[(b * Tk + j) * KW + (h / group) * D];
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          double sj = dot * scale;
          bool mj = false;
          if (!in.attn_mask.empty()) {
            const double mv = mask_at(in.attn_mask, b, h, i, j);
            switch (in.mask_kind) {
              case MaskKind::additive: sj += mv; break;
              case MaskKind::keep: mj = mv == 0.0; break;
              case MaskKind::block: mj = mv != 0.0; break;
            }
          }
          if (!in.key_padding.empty() && padding_at(in.key_padding, b, j) != 0.0) mj = true;
          if (config.causal && j > i + (Tk - T)) mj = true;
          // -inf (from an additive mask) blocks exactly like a mask: its probability is exactly 0.
          if (sj == -INFINITY) mj = true;
          score[j] = sj;
          masked[j] = mj;
        }

        // p = softmax over the unmasked entries; a row with none gives p = 0 (the layer then outputs b_o).
        // NaN scores (from NaN inputs with check_finite off) are not "masked": they propagate to this row only.
        double mx = -INFINITY;
        bool any = false;
        for (int64_t j = 0; j < Tk; ++j) {
          if (masked[j]) continue;
          any = true;
          if (!(score[j] <= mx)) mx = score[j];  // lets a NaN in, unlike std::max
        }
        if (!any) continue;  // ctx row stays 0
        double sum = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          score[j] = masked[j] ? 0.0 : std::exp(score[j] - mx);
          sum += score[j];
        }
        double* c = &ctx[(b * T + i) * E + h * D];
        for (int64_t j = 0; j < Tk; ++j) {
          double p = score[j] / sum;
          if (dropout) {
            const uint64_t n = static_cast<uint64_t>(((b * H + h) * T + i) * Tk + j);
            p = dropout_uniform(run.dropout_seed, n) >= p_drop ? p * keep_scale : 0.0;
          }
          if (masked[j]) continue;  // p is exactly 0; skipping also keeps a masked key's NaN/Inf value out (0 * NaN)
          const double* v = &V[(b * Tk + j) * KW + (h / group) * D];
          for (int64_t d = 0; d < D; ++d) c[d] += p * v[d];
        }
      }
    }
  }

  // out (B, T, E) = ctx W_o^T + b_o
  std::vector<double> out(static_cast<size_t>(B * T * E));
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t e = 0; e < E; ++e) {
      double acc = weights.b_o.empty() ? 0.0 : static_cast<double>(weights.b_o[e]);
      for (int64_t c = 0; c < E; ++c) acc += ctx[r * E + c] * static_cast<double>(weights.w_o[e * E + c]);
      out[r * E + e] = acc;
    }
  }
  return out;
}

}  // namespace gpt2attn
