// engine/row_ops.cpp: gpt2attn/ops.hpp on the kernels' row operations and the engine's thread team.
#include "gpt2attn/ops.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/dispatch.hpp"
#include "engine/team.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

using detail::ceil_div;
using detail::str;

namespace {
// A team item's share: rows of about kRowOpItemFloats floats (or elements, for GELU), so a thread's item streams a
// few tens of KiB and small calls stay on one thread.
constexpr int64_t kRowOpItemFloats = 16384;

const kernels::RowOpsKernel& row_ops(const RowOpOptions& o, const char* call) {
  detail::check_threads(o.threads, call, "RowOpOptions.threads");
  return *detail::isa_kernels(detail::resolve_isa(o.isa)).row_ops;
}

}  // namespace

void layer_norm(const float* x, int64_t M, int64_t E, const float* gamma, const float* beta, float eps, float* y,
                const RowOpOptions& options) {
  if (M < 1 || E < 1) invalid("layer_norm: expected M >= 1 and E >= 1, got M = " + str(M) + ", E = " + str(E));
  if (!x || !gamma || !beta || !y) invalid("layer_norm: x, gamma, beta and y must not be null");
  if (!(std::isfinite(eps) && eps > 0.0f)) invalid("layer_norm: eps must be finite and above 0, got " + std::to_string(eps));
  const kernels::RowOpsKernel& k = row_ops(options, "layer_norm");
  const int64_t rows = std::max<int64_t>(1, kRowOpItemFloats / E);
  detail::team_for(detail::threads_or_default(options.threads), ceil_div(M, rows), [&](int64_t item, int) {
    const int64_t m0 = item * rows, n = std::min(rows, M - m0);
    k.layer_norm(x + m0 * E, E, n, E, gamma, beta, eps, y + m0 * E, E);
  });
}

void gelu_tanh(float* x, int64_t n, const RowOpOptions& options) {
  if (n < 0) invalid("gelu_tanh: expected n >= 0, got " + str(n));
  if (n > 0 && !x) invalid("gelu_tanh: x must not be null");
  const kernels::RowOpsKernel& k = row_ops(options, "gelu_tanh");
  detail::team_for(detail::threads_or_default(options.threads), ceil_div(n, kRowOpItemFloats), [&](int64_t item, int) {
    const int64_t i0 = item * kRowOpItemFloats;
    k.gelu(x + i0, std::min(kRowOpItemFloats, n - i0));
  });
}

void residual_add(float* y, const float* x, int64_t n, const RowOpOptions& options) {
  if (n < 0) invalid("residual_add: expected n >= 0, got " + str(n));
  if (n > 0 && (!x || !y)) invalid("residual_add: x and y must not be null");
  const kernels::RowOpsKernel& k = row_ops(options, "residual_add");
  detail::team_for(detail::threads_or_default(options.threads), ceil_div(n, kRowOpItemFloats), [&](int64_t item, int) {
    const int64_t i0 = item * kRowOpItemFloats;
    k.add(y + i0, x + i0, std::min(kRowOpItemFloats, n - i0));
  });
}

}  // namespace gpt2attn
