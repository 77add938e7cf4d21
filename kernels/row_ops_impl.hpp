// kernels/row_ops_impl.hpp: kernels/row_ops.hpp over Vec<Arch>. Included only by kernels/kernel_sets_impl.hpp, in each
// level's file (internal linkage, like the other kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/row_ops.hpp"
#include "kernels/vec.hpp"

namespace gpt2attn::kernels {
namespace {

template <class Arch>
struct RowOps {
  using V = Vec<Arch>;
  using B = typename V::B;
  static constexpr int W = V::W;

  // The row's mean as a sum of two floats, hi + lo: hi the f32 mean of the first pass, lo the mean of x - hi (exact
  // for x within a factor 2 of hi, Sterbenz), and the variance from the same second pass, sum((x - hi)^2) / E - lo^2.
  // With the mean in one float, a row around 1000 (its ulp 6e-5) kept an error of 3e-5 / std in every output, five
  // times the f32 bound at E = 5. Partial sums in two vectors, then across the lanes, then the tail.
  static void mean_var(const float* r, int64_t E, float& hi, float& lo, float& var) {
    B s0 = V::set1(0.0f), s1 = s0;
    int64_t i = 0;
    for (; i + 2 * W <= E; i += 2 * W) s0 = s0 + V::load(r + i), s1 = s1 + V::load(r + i + W);
    for (; i + W <= E; i += W) s0 = s0 + V::load(r + i);
    float t = V::sum(s0 + s1);
    for (; i < E; ++i) t += r[i];
    hi = t / static_cast<float>(E);
    const B h = V::set1(hi);
    B d0 = V::set1(0.0f), q0 = d0;
    for (i = 0; i + W <= E; i += W) {
      const B d = V::load(r + i) - h;
      d0 = d0 + d, q0 = V::fma(d, d, q0);
    }
    float sd = V::sum(d0), sq = V::sum(q0);
    for (; i < E; ++i) sd += r[i] - hi, sq += (r[i] - hi) * (r[i] - hi);
    lo = sd / static_cast<float>(E);
    var = std::max(0.0f, sq / static_cast<float>(E) - lo * lo);
  }

  static void layer_norm(const float* x, int64_t ldx, int64_t M, int64_t E, const float* gamma, const float* beta,
                         float eps, float* y, int64_t ldy) {
    for (int64_t m = 0; m < M; ++m) {
      const float* r = x + m * ldx;
      float* o = y + m * ldy;
      float hi, lo, var;
      mean_var(r, E, hi, lo, var);
      const float rstd = 1.0f / std::sqrt(var + eps);
      const B hv = V::set1(hi), lv = V::set1(lo), rv = V::set1(rstd);
      int64_t i = 0;
      for (; i + W <= E; i += W) {
        V::store(o + i, V::fma((V::load(r + i) - hv - lv) * rv, V::load(gamma + i), V::load(beta + i)));
      }
      for (; i < E; ++i) o[i] = (r[i] - hi - lo) * rstd * gamma[i] + beta[i];
    }
  }

  // Below -20 GELU is below 1e-170 in magnitude: x is taken as -20 there (the quotient is then -2e-37), so that the
  // cubic does not overflow into a finite wrong answer. max(-20, x) keeps a NaN x: vmaxps, and the scalar twin's
  // comparison, return the second operand when one is NaN.
  static B gelu_vec(B x) {
    const B k = V::set1(static_cast<float>(-2.0 * 1.4426950408889634 * kGeluSqrt2OverPi));
    const B xc = V::max(V::set1(-20.0f), x);
    const B u = xc + V::set1(static_cast<float>(kGeluCubic)) * xc * xc * xc;
    const B e = V::exp2(V::min(u * k, V::set1(126.0f)));  // exp2's range; +inf x: u * k = -inf, e = 0, y = x
    return xc / (V::set1(1.0f) + e);
  }
  static void gelu(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) V::store(x + i, gelu_vec(V::load(x + i)));
    if (i < n) {  // the tail through one vector's worth of lanes, padded with zeros
      float t[W] = {};
      for (int64_t j = i; j < n; ++j) t[j - i] = x[j];
      V::store(t, gelu_vec(V::load(t)));
      for (int64_t j = i; j < n; ++j) x[j] = t[j - i];
    }
  }

  static void add(float* y, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) V::store(y + i, V::load(y + i) + V::load(x + i));
    for (; i < n; ++i) y[i] += x[i];
  }
};

template <Isa Level, class Arch>
const RowOpsKernel& make_row_ops() {
  static const RowOpsKernel kernel{Level, &RowOps<Arch>::layer_norm, &RowOps<Arch>::gelu, &RowOps<Arch>::add};
  return kernel;
}

}  // namespace
}  // namespace gpt2attn::kernels
