// engine/reference.cpp: the naive reference for MultiHeadAttention: double accumulation, the full (T, Tk) score
// row per query, every sum taken term by term in plain index order (0 first), so the result is the same bit for bit
// whatever the blocking or the thread count (and as the three nested loops it replaced). It shares nothing with the
// fast path but validation: no intrinsics, no online softmax, no kernel tiles, its own bf16 widening and dropout hash.
//
// Why it is not three nested loops any more: the 10,000-case sweep (tests/test_fastpath_sweep.cpp) calls it for
// every case. Every product (projections, Q K^T, P V) goes through one small gemm that advances a 4 x 4 tile of
// independent sums together in registers (two-lane vectors across outputs, never across the terms of one sum), and
// a large call splits its rows (projections) or its (b, h, query tile) units (attention) across OpenMP threads.
// Every output element is written by exactly one thread, with the same arithmetic as on one thread.
#include "gpt2attn/reference.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/validate.hpp"

namespace gpt2attn {
namespace {

// The one multiply loop, gemm below: a register tile of kMR x kNR sums advanced together over one chunk of kKC
// terms, so each loaded value serves several sums (kMR * kNR / 2 = 8 of SSE2's 16 registers hold the sums, the
// rest the loads). kKC keeps a tile's A rows in L1 and the B panel in L2 between tiles. kNR is even.
constexpr int64_t kMR = 4, kNR = 4, kKC = 256;
// Query rows per attention work unit: enough to share each key row's load, few enough that the unit's (rows, Tk)
// score block stays in L2 for Tk ~ 1024.
constexpr int64_t kQueryTile = 16;
// Below this many multiply-adds (about 10 ms on one core) a call stays on the calling thread. A team's five
// barriers cost little on a quiet machine, but on a busy one a spinning libgomp thread waits for a descheduled peer
// longer than such a call takes. It also keeps the many small calls of the test suite (some under ThreadSanitizer,
// which cannot see inside libgomp's barriers) from ever starting a team.
constexpr double kThreadedWork = 3e7;

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

// A bf16 value is the top half of the f32 with the same bits: widening is exact.
double widen_bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// X (B*L, width) in double, row-major, from a rank-3 (B, L, width) f32 or bf16 view read through its strides.
std::vector<double> gather_rows(const TensorView& x, int64_t B, int64_t L, int64_t width) {
  std::vector<double> out(static_cast<size_t>(B * L * width));
  const int64_t sb = x.strides[0], st = x.strides[1], sc = x.strides[2];
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < L; ++t) {
      double* row = &out[(b * L + t) * width];
      const int64_t base = b * sb + t * st;
      if (x.dtype == DType::bf16) {
        const uint16_t* p = static_cast<const uint16_t*>(x.data);
        for (int64_t c = 0; c < width; ++c) row[c] = widen_bf16(p[base + c * sc]);
      } else {
        const float* p = static_cast<const float*>(x.data);
        for (int64_t c = 0; c < width; ++c) row[c] = p[base + c * sc];
      }
    }
  }
  return out;
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

// Two doubles in one register (GCC/Clang vector extension; SSE2 on x86-64): element-wise + and * only, so each lane
// is one sum of its own, advanced exactly as a scalar would be.
using f64x2 = double __attribute__((vector_size(16)));

f64x2 load2(const double* p) {
  f64x2 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store2(double* p, f64x2 v) { std::memcpy(p, &v, sizeof v); }

// C[r][n] += sum_{k0 <= k < k1} A[r][k] B[k][n], k ascending, for the MR x 2*NV tile at (r, n): one sum per output,
// taken term by term in index order, MR * 2*NV of them advanced together in registers.
template <int MR, int NV>
void tile(int64_t k0, int64_t k1, const double* A, int64_t lda, const double* B, int64_t ldb, double* C, int64_t ldc) {
  f64x2 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = load2(&C[r * ldc + 2 * v]);
  }
  for (int64_t k = k0; k < k1; ++k) {
    f64x2 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load2(&B[k * ldb + 2 * v]);
    for (int r = 0; r < MR; ++r) {
      const f64x2 a = {A[r * lda + k], A[r * lda + k]};
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) store2(&C[r * ldc + 2 * v], acc[r][v]);
  }
}

// The same for one output column (the tail of an odd N), in plain scalars.
template <int MR>
void column(int64_t k0, int64_t k1, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
            int64_t ldc) {
  double acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = C[r * ldc];
  for (int64_t k = k0; k < k1; ++k) {
    for (int r = 0; r < MR; ++r) acc[r] += A[r * lda + k] * B[k * ldb];
  }
  for (int r = 0; r < MR; ++r) C[r * ldc] = acc[r];
}

// C (R, N) += A (R, K) B (K, N), all row-major double with leading dimensions lda, ldb, ldc: every C[r][n] gains
// A[r][0] B[0][n] + A[r][1] B[1][n] + ... in that order, exactly as the textbook loop over k would add them, so the
// bits do not depend on the tiling. Callers put the bias (or 0) in C first.
void gemm(int64_t R, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
          int64_t ldc) {
  const int64_t Rm = R - R % kMR, Nm = N - N % kNR;
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t k1 = std::min(K, k0 + kKC);
    for (int64_t r = 0; r < Rm; r += kMR) {
      const double* a = &A[r * lda];
      double* c = &C[r * ldc];
      for (int64_t n = 0; n < Nm; n += kNR) tile<kMR, kNR / 2>(k0, k1, a, lda, &B[n], ldb, &c[n], ldc);
      if (N - Nm >= 2) tile<kMR, 1>(k0, k1, a, lda, &B[Nm], ldb, &c[Nm], ldc);
      if (N % 2) column<kMR>(k0, k1, a, lda, &B[N - 1], ldb, &c[N - 1], ldc);
    }
    for (int64_t r = Rm; r < R; ++r) {
      const double* a = &A[r * lda];
      double* c = &C[r * ldc];
      for (int64_t n = 0; n < Nm; n += kNR) tile<1, kNR / 2>(k0, k1, a, lda, &B[n], ldb, &c[n], ldc);
      if (N - Nm >= 2) tile<1, 1>(k0, k1, a, lda, &B[Nm], ldb, &c[Nm], ldc);
      if (N % 2) column<1>(k0, k1, a, lda, &B[N - 1], ldb, &c[N - 1], ldc);
    }
  }
}

// Y (R, N) = X W^T + bias: X (R, width) row-major double, W (N, width) row-major f32. Each Y[r][e] is
//   bias[e] + X[r][0] W[e][0] + X[r][1] W[e][1] + ...   summed in that order, in double
// (a product of two floats is exact in double). Rows are split across the team in tiles.
std::vector<double> project(const std::vector<double>& X, int64_t R, int64_t width, const std::vector<float>& w,
                            const std::vector<float>& bias, int64_t N, int threads) {
  std::vector<double> Wt(static_cast<size_t>(width * N));  // W^T (width, N)
  for (int64_t e = 0; e < N; ++e) {
    for (int64_t c = 0; c < width; ++c) Wt[c * N + e] = w[e * width + c];
  }
  std::vector<double> Y(static_cast<size_t>(R * N));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t e = 0; e < N; ++e) Y[r * N + e] = bias.empty() ? 0.0 : static_cast<double>(bias[e]);
  }
  constexpr int64_t kRows = 8 * kMR;  // rows per task: a multiple of the register tile
  const int64_t tasks = (R + kRows - 1) / kRows;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r0 = t * kRows, rows = std::min(R - r0, kRows);
    gemm(rows, N, width, &X[r0 * width], width, Wt.data(), N, &Y[r0 * N], N);
  }
  return Y;
}

}  // namespace

std::vector<double> reference_forward(const Config& config, const Weights& weights, const AttentionInputs& in,
                                      const RunOptions& run) {
  config.validate();
  weights.validate(config);
  const detail::AttnShape s = detail::validate_inputs(config, in, run, 1);
  const int64_t B = s.B, T = s.T, Tk = s.Tk, E = s.E, H = s.H, H_kv = s.H_kv, D = s.D;
  const int64_t KW = H_kv * D;  // width of K and V after projection; query head h reads K/V head s.kv_head(h)

  // The work in multiply-adds decides whether a team is worth starting; the result does not depend on it.
  const double work = static_cast<double>(B) * (static_cast<double>(T) * (s.d_in * E + E * E) +
                                                 static_cast<double>(Tk) * (s.kdim + s.vdim) * KW +
                                                 2.0 * static_cast<double>(H) * T * Tk * D);
  const int threads = work < kThreadedWork ? 1 : (run.threads > 0 ? run.threads : omp_get_max_threads());

  // Q (B*T, E), K (B*Tk, KW), V (B*Tk, KW); self-attention projects the query three times.
  const TensorView& key_in = s.self_attention ? in.query : in.key;
  const TensorView& value_in = s.self_attention ? in.query : in.value;
  const std::vector<double> Q =
      project(gather_rows(in.query, B, T, s.d_in), B * T, s.d_in, weights.w_q, weights.b_q, E, threads);
  const std::vector<double> K =
      project(gather_rows(key_in, B, Tk, s.kdim), B * Tk, s.kdim, weights.w_k, weights.b_k, KW, threads);
  const std::vector<double> V =
      project(gather_rows(value_in, B, Tk, s.vdim), B * Tk, s.vdim, weights.w_v, weights.b_v, KW, threads);

  // Kt (B, H_kv, D, Tk): each K/V head's keys transposed, so scores are a product of (rows, D) by (D, Tk).
  std::vector<double> Kt(static_cast<size_t>(B * H_kv * D * Tk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H_kv; ++g) {
      double* kt = &Kt[(b * H_kv + g) * D * Tk];
      for (int64_t j = 0; j < Tk; ++j) {
        for (int64_t d = 0; d < D; ++d) kt[d * Tk + j] = K[(b * Tk + j) * KW + g * D + d];
      }
    }
  }
  // P.V below runs over every key j, masked ones at p = 0: adding 0 * V[j] to a sum leaves it bit for bit as it
  // was when V[j] is finite (the sum starts at +0 and is never -0). A non-finite V (NaN inputs with check_finite
  // off) must not reach rows that mask it (0 * NaN), so then masked keys are skipped one by one instead.
  bool v_finite = true;
  for (double x : V) v_finite = v_finite && std::isfinite(x);

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const bool dropout = run.training && config.dropout > 0.0f;
  const double p_drop = config.dropout;
  const double keep_scale = 1.0 / (1.0 - p_drop);
  // Causal: row i sees keys j <= i + (Tk - T) (bottom-right alignment); the rest are never computed.
  auto visible = [&](int64_t i) { return config.causal ? std::clamp<int64_t>(i + (Tk - T) + 1, 0, Tk) : Tk; };

  // ctx (B*T, E): heads concatenated. One unit = (b, h, a tile of query rows); units write disjoint ctx rows.
  std::vector<double> ctx(static_cast<size_t>(B * T * E), 0.0);
  const int64_t row_tiles = (T + kQueryTile - 1) / kQueryTile;
  const int64_t units = B * H * row_tiles;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<double> score(static_cast<size_t>(kQueryTile * Tk));  // (rows, Tk): scores, then probabilities
    std::vector<char> masked(static_cast<size_t>(kQueryTile * Tk));
#pragma omp for schedule(dynamic)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / (H * row_tiles), h = (u / row_tiles) % H, i0 = (u % row_tiles) * kQueryTile;
      const int64_t rows = std::min(T, i0 + kQueryTile) - i0;
      const int64_t jn = visible(i0 + rows - 1);  // keys any row of the tile sees
      const double* q = &Q[(b * T + i0) * E + h * D];
      const double* v = &V[b * Tk * KW + s.kv_head(h) * D];
      double* c = &ctx[(b * T + i0) * E + h * D];

      // Raw dot products score[i][j] = sum_d Q[i][d] K[j][d], d ascending.
      std::fill(score.begin(), score.begin() + rows * Tk, 0.0);
      gemm(rows, jn, D, q, E, &Kt[(b * H_kv + s.kv_head(h)) * D * Tk], Tk, score.data(), Tk);

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        double* srow = &score[r * Tk];
        char* mrow = &masked[r * Tk];
        const int64_t vis = visible(i);
        for (int64_t j = 0; j < Tk; ++j) {
          if (j >= vis) {
            mrow[j] = 1;
            continue;
          }
          double sj = srow[j] * scale;
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
          // -inf (from an additive mask) blocks exactly like a mask: its probability is exactly 0.
          if (sj == -INFINITY) mj = true;
          srow[j] = sj;
          mrow[j] = mj;
        }

        // p = softmax over the unmasked entries; a row with none gives p = 0 (the layer then outputs b_o).
        // NaN scores (from NaN inputs with check_finite off) are not "masked": they propagate to this row only.
        double mx = -INFINITY;
        bool any = false;
        for (int64_t j = 0; j < Tk; ++j) {
          if (mrow[j]) continue;
          any = true;
          if (!(srow[j] <= mx)) mx = srow[j];  // lets a NaN in, unlike std::max
        }
        if (!any) {
          std::fill(srow, srow + Tk, 0.0);  // ctx row stays 0
          continue;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          srow[j] = mrow[j] ? 0.0 : std::exp(srow[j] - mx);
          sum += srow[j];
        }
        for (int64_t j = 0; j < Tk; ++j) {
          if (mrow[j]) continue;  // stays exactly 0
          double p = srow[j] / sum;
          if (dropout) {
            const uint64_t n = static_cast<uint64_t>(((b * H + h) * T + i) * Tk + j);
            p = dropout_uniform(run.dropout_seed, n) >= p_drop ? p * keep_scale : 0.0;
          }
          srow[j] = p;
        }
      }

      // ctx[i] = sum_j p_ij V[j], j ascending.
      if (v_finite) {
        gemm(rows, D, jn, score.data(), Tk, v, KW, c, E);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < jn; ++j) {
            if (masked[r * Tk + j]) continue;
            gemm(1, D, 1, &score[r * Tk + j], 1, &v[j * KW], KW, &c[r * E], E);
          }
        }
      }
    }
  }

  // out (B*T, E) = ctx W_o^T + b_o
  return project(ctx, B * T, E, weights.w_o, weights.b_o, E, threads);
}

}  // namespace gpt2attn
