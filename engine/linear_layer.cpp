// engine/linear_layer.cpp: the public Linear (gpt2attn/linear.hpp) on the engine's two projection paths: the few-row
// kernel over panel-packed weights (engine/few_rows.hpp) and oneDNN's GEMMs (engine/linear.hpp) over column panels
// taken by the team, each single-threaded, as the attention layer's output projection runs.
#include "gpt2attn/linear.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/convert.hpp"
#include "engine/dispatch.hpp"
#include "engine/few_rows.hpp"
#include "engine/linear.hpp"
#include "engine/quantized.hpp"
#include "engine/team.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "engine/weights_check.hpp"
#include "engine/workspace.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn {

using detail::ceil_div;
using detail::str;

namespace {

// Output columns per GEMM: the attention layer's per-head GEMMs are this shape at D = 64 (gpt2-small's 36 per-head
// GEMMs reached 81-84 GFLOP/s on one Zen 3 thread, engine/layer.hpp), and 64-column panels give a team of 16 threads
// 48 items at a GPT-2 MLP's narrowest N (768).
constexpr int64_t kGemmPanel = 64;
// Rows per GEMM, as the attention layer cuts a long input (MultiHeadAttention::Impl::kRowBlock: a block's rows are
// re-read from cache by every panel's GEMM).
constexpr int64_t kGemmRows = 512;
// Rows per item where the few-row kernel takes more than kFewRows (LinearPaths::few_rows, batch_invariant).
constexpr int64_t kFewRowBlock = kernels::tiles::kFewRowBlock;

bool is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

}  // namespace

struct Linear::Impl {
  int64_t N = 0, K = 0;
  Isa isa;
  DType compute;
  WeightFormat format;
  LinearPaths paths;
  int default_threads;
  std::vector<float> bias;                // (N) f32, or empty
  detail::PackedLinear packed;            // the few-row kernel's panels
  const kernels::LinearKernel* few;
  std::vector<detail::Linear> gemm;       // LinearPaths::both: column panels of kGemmPanel outputs
  DType operand = DType::f32;             // what the GEMMs read x as (detail::Linear::operand)
  Workspace own_ws;
  std::mutex mu;

  Impl(const TensorView& w, const TensorView& b, const EngineOptions& o, LinearPaths p);

  int threads_for(const RunOptions& run) const { return run.threads > 0 ? run.threads : default_threads; }
  bool on_few_rows(int64_t M, bool invariant = false) const {
    return invariant || paths == LinearPaths::few_rows || M <= kFewRows;
  }
  // Floats of the few-row kernel's scratch per thread for `rows` rows a call.
  int64_t few_stride(int64_t rows) const {
    return detail::round_up(ceil_div(kernels::linear_scratch_bytes(format, rows, K), 4), 16);
  }
  size_t bytes_for(int64_t M, int threads, bool invariant = false) const {
    if (on_few_rows(M, invariant)) return static_cast<size_t>(threads * few_stride(std::min(M, kFewRowBlock)) * 4);
    return static_cast<size_t>(detail::operand_bytes(operand, M, K));
  }
  void run_few(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int threads, bool check,
               Workspace::Impl& ws) const;
  void run_gemm(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int threads, Workspace::Impl& ws) const;

  template <class F>
  void with_workspace(Workspace* ws, const char* call, F&& f) {
    detail::with_workspace(ws, own_ws, mu, call, std::forward<F>(f));
  }
};

Linear::Impl::Impl(const TensorView& w, const TensorView& b, const EngineOptions& o, LinearPaths p)
    : isa(detail::resolve_isa(o.isa)),
      compute(o.compute),
      format(o.weights),
      paths(p),
      default_threads(detail::threads_or_default(o.threads)) {
  detail::check_threads(o.threads, "Linear", "EngineOptions.threads");
  if (compute != DType::f32 && compute != DType::bf16) {
    invalid(std::string("Linear: EngineOptions.compute must be f32 or bf16, got ") + to_string(compute));
  }
  if (p != LinearPaths::both && p != LinearPaths::few_rows) invalid("Linear: unknown LinearPaths value");
  if (w.empty() || w.rank != 2 || !is_float(w.dtype) || w.shape[0] < 1 || w.shape[1] < 1) {
    std::string got = "rank " + str(w.rank) + " " + to_string(w.dtype);
    if (w.rank > 0) got.append(" ").append(w.shape_str());
    invalid("Linear: weight must be a rank-2 (N, K) f32, bf16 or f16 view with N, K >= 1, got " + got);
  }
  N = w.shape[0], K = w.shape[1];
  if (N > kMaxWidth * 64 || K > kMaxWidth) {
    invalid("Linear: weight " + w.shape_str() + " is past the bounds (N <= " + str(kMaxWidth * 64) +
            ", K <= " + str(kMaxWidth) + ")");
  }
  if (!b.empty() && (b.rank != 1 || !is_float(b.dtype) || b.shape[0] != N)) {
    std::string got = "rank " + str(b.rank) + " " + to_string(b.dtype);
    if (b.rank > 0) got.append(" ").append(b.shape_str());
    invalid("Linear: bias must be an empty view or a rank-1 (" + str(N) + ") f32, bf16 or f16 view, got " + got);
  }
  detail::check_finite_weights(w, "Linear: weight");
  if (!b.empty()) {
    detail::check_finite_weights(b, "Linear: bias");
    bias = detail::f32_values(b);
  }
  few = &detail::linear_kernel(isa, format, compute);
  std::optional<QuantizedMatrix> q;
  if (format != WeightFormat::compute) q = detail::quantize_matrix(w, format, "weight");
  packed.packed = detail::pack_linear({{&w, q ? &*q : nullptr, N}}, K, format, compute, &packed.scales,
                                      "Linear: packed weights");
  if (paths == LinearPaths::few_rows) return;
  // As the attention layer holds its GEMMs' weights (MultiHeadAttention::Impl's constructor): the values in the compute
  // type; int8 codes on oneDNN's integer GEMMs where it has VNNI, else their values; int4 codes, converted per call.
  const bool int8 = format == WeightFormat::int8 && detail::Linear::int8_available();
  const int64_t G = q ? detail::quant_groups(format, K) : 0;
  const float* bp = bias.empty() ? nullptr : bias.data();
  for (int64_t n0 = 0; n0 < N; n0 += kGemmPanel) {
    const int64_t rows = std::min(kGemmPanel, N - n0);
    const float* pb = bp ? bp + n0 : nullptr;
    if (format == WeightFormat::compute) {
      gemm.emplace_back(detail::slice(w, 0, n0, rows), pb, compute);
    } else if (int8 || format == WeightFormat::int4) {
      gemm.emplace_back(format, q->codes.data() + n0 * K, q->scales.data() + n0 * G, rows, K, pb, compute,
                        few->dequantize);
    } else {
      std::vector<float> values(static_cast<size_t>(rows * K));
      detail::dequantize_rows(*q, format, n0, rows, values.data());
      gemm.emplace_back(TensorView::f32(values.data(), {rows, K}), pb, compute);
    }
  }
  operand = gemm.front().operand();
}

void Linear::Impl::run_few(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int threads, bool check,
                           Workspace::Impl& ws) const {
  const int64_t block = std::min(M, kFewRowBlock), stride = few_stride(block);
  float* scratch = reinterpret_cast<float*>(ws.reserve(bytes_for(M, threads, true)));
  const detail::PanelItems items = detail::panel_items(*few, N, threads);
  const int64_t blocks = ceil_div(M, block);
  bool overflow = false;
  detail::team_for(threads, blocks * items.count(), [&](int64_t item, int thread) {
    const int64_t r0 = item / items.count() * block, it = item % items.count(), rows = std::min(block, M - r0);
    const kernels::LinearArgs a = detail::few_row_args(x + r0 * ldx, ldx, packed, bias, y + r0 * ldy, ldy, rows, N, K);
    few->run(detail::on_thread(a, scratch + thread * stride), items.begin(it), items.end(it));
    if (check && detail::columns_overflowed(y + r0 * ldy, ldy, rows, N, items, it)) {
      std::atomic_ref<bool>(overflow).store(true, std::memory_order_relaxed);
    }
  });
  if (overflow) detail::check_projection(y, DType::f32, M, N, ldy, "Linear: the output");
}

void Linear::Impl::run_gemm(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int threads,
                            Workspace::Impl& ws) const {
  std::byte* scratch = ws.reserve(bytes_for(M, threads));
  const TensorView xv = TensorView::f32(x, {1, M, K}).with_strides({M * ldx, ldx, 1});
  const detail::Rows r = detail::as_rows(xv, compute, operand, scratch, threads);
  const int64_t panels = static_cast<int64_t>(gemm.size()), blocks = ceil_div(M, kGemmRows);
  // int4 panel-major, as the attention layer's output projection: a thread's next item is then mostly the same panel,
  // whose weights its slot holds converted.
  const bool panel_major = format == WeightFormat::int4;
  detail::team_for(threads, blocks * panels, [&](int64_t item, int thread) {
    const int64_t p = panel_major ? item / blocks : item % panels;
    const int64_t r0 = (panel_major ? item % blocks : item / panels) * kGemmRows, rows = std::min(kGemmRows, M - r0);
    gemm[static_cast<size_t>(p)].run(ws.exec, r.row(r0), rows, r.ld, y + r0 * ldy + p * kGemmPanel, ldy, 1, thread,
                                     DType::f32, r.scale(r0));
  });
}

Linear::Linear(const TensorView& weight, const TensorView& bias, const EngineOptions& options, LinearPaths paths)
    : impl_(detail::translate_bad_alloc("Linear", [&] { return std::make_unique<Impl>(weight, bias, options, paths); })) {}
Linear::~Linear() = default;
Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;

void Linear::forward(const float* x, int64_t M, float* y, const RunOptions& run, Workspace* ws) {
  forward(x, M, 0, y, 0, run, ws);
}

void Linear::forward(const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, const RunOptions& run,
                     Workspace* ws) {
  Impl& L = *impl_;
  detail::check_threads(run.threads, "Linear::forward", "RunOptions.threads");
  if (M < 1) invalid("Linear::forward: expected M >= 1 rows, got " + str(M));
  if (!x || !y) invalid("Linear::forward: x and y must not be null");
  ldx = ldx ? ldx : L.K, ldy = ldy ? ldy : L.N;
  if (ldx < L.K || ldy < L.N) {
    invalid("Linear::forward: row strides must be at least the widths: ldx " + str(ldx) + " for K = " + str(L.K) +
            ", ldy " + str(ldy) + " for N = " + str(L.N));
  }
  detail::checked_mul(M, std::max(ldx, ldy), "Linear::forward");
  const int threads = L.threads_for(run);
  if (run.check_finite) {
    detail::check_finite(TensorView::f32(x, {1, M, L.K}).with_strides({M * ldx, ldx, 1}), "Linear::forward: x", "M",
                         threads);
  }
  L.with_workspace(ws, "Linear::forward", [&](Workspace::Impl& w) {
    if (L.on_few_rows(M, run.batch_invariant)) return L.run_few(x, M, ldx, y, ldy, threads, run.check_finite, w);
    L.run_gemm(x, M, ldx, y, ldy, threads, w);
    if (run.check_finite) detail::check_projection(y, DType::f32, M, L.N, ldy, "Linear: the output", 0, threads);
  });
}

void Linear::reserve(int64_t max_rows, int threads, Workspace* ws) {
  Impl& L = *impl_;
  detail::check_threads(threads, "Linear::reserve", "threads");
  if (max_rows < 1) invalid("Linear::reserve: expected max_rows >= 1, got " + str(max_rows));
  const int n = threads > 0 ? threads : L.default_threads;
  const size_t bytes = workspace_bytes(max_rows, n);
  L.with_workspace(ws, "Linear::reserve", [&](Workspace::Impl& w) {
    w.reserve(bytes);
    if (L.on_few_rows(max_rows)) return;
    // Every panel width (the last may be narrower) x every row count a call of max_rows rows cuts, on every slot.
    for (size_t p : {size_t{0}, L.gemm.size() - 1}) {
      for (int slot = 0; slot < n; ++slot) {
        if (max_rows >= kGemmRows) L.gemm[p].prepare(w.exec, kGemmRows, L.K, L.N, 1, slot);
        if (max_rows % kGemmRows != 0) L.gemm[p].prepare(w.exec, max_rows % kGemmRows, L.K, L.N, 1, slot);
      }
    }
  });
}

size_t Linear::workspace_bytes(int64_t max_rows, int threads) const {
  detail::check_threads(threads, "Linear::workspace_bytes", "threads");
  if (max_rows < 1) invalid("Linear::workspace_bytes: expected max_rows >= 1, got " + str(max_rows));
  const int n = threads > 0 ? threads : impl_->default_threads;
  // A call of fewer rows may take the other path, and a batch-invariant one the few-row kernel: the largest.
  return std::max({impl_->bytes_for(std::min(max_rows, kFewRows), n), impl_->bytes_for(max_rows, n),
                   impl_->bytes_for(max_rows, n, /*invariant=*/true)});
}

int64_t Linear::in_features() const { return impl_->K; }
int64_t Linear::out_features() const { return impl_->N; }
DType Linear::compute() const { return impl_->compute; }
WeightFormat Linear::weights() const { return impl_->format; }
LinearPaths Linear::paths() const { return impl_->paths; }
Isa Linear::isa() const { return impl_->isa; }
int Linear::default_threads() const { return impl_->default_threads; }

size_t Linear::weight_bytes() const {
  const Impl& L = *impl_;
  size_t n = static_cast<size_t>(kernels::linear_packed_bytes(L.N, L.K, L.format, L.compute)) +
             L.packed.scales.size() * sizeof(float) + L.bias.size() * sizeof(float);
  if (L.paths == LinearPaths::both) {
    // The GEMMs' copy: the compute type, or int8's codes, or int4's nibbles, with their scales.
    const size_t per = L.format == WeightFormat::int4   ? 1
                       : L.format == WeightFormat::int8 ? 2
                                                        : 2 * size_of(L.compute);
    n += static_cast<size_t>(L.N * L.K) * per / 2;
  }
  return n;
}

std::string Linear::implementation() const {
  const Impl& L = *impl_;
  std::string s = std::string("few-row-linear/") + to_string(L.isa) + " " +
                  (L.format == WeightFormat::compute ? to_string(L.compute) : to_string(L.format));
  if (L.paths == LinearPaths::few_rows) return s;
  return s + " (M <= " + str(kFewRows) + ") + onednn-matmul/" + L.gemm.front().implementation();
}

}  // namespace gpt2attn
