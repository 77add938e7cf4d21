// engine/attention.cpp: the layer's orchestration: per-head projections on oneDNN writing Q/K/V head-major,
// the attention core split across the caller's threads, the output projection. All set-up happens in the constructor; forward() computes.
#include "gpt2attn/attention.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <exception>

#include "engine/dispatch.hpp"
#include "engine/linear.hpp"
#include "engine/validate.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

using detail::Linear;
using detail::Shape;

namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// A (rows, width) matrix as oneDNN reads it: base pointer and row stride.
struct Rows {
  const float* data;
  int64_t ld;
};

// A (B, N, W) view whose rows are evenly spaced with unit element stride can be read in place as a 2-D
// (B*N, W) matrix; anything else is packed contiguously into `scratch` first (O(B*N*W), once per call).
Rows as_rows(const TensorView& x, float* scratch) {
  const int64_t B = x.shape[0], N = x.shape[1], W = x.shape[2];
  const int64_t sb = x.strides[0], sn = x.strides[1], sw = x.strides[2];
  const auto* p = static_cast<const float*>(x.data);
  if (sw == 1 && sn >= W && (B == 1 || sb == N * sn)) return {p, sn};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t w = 0; w < W; ++w) scratch[(b * N + n) * W + w] = p[b * sb + n * sn + w * sw];
  return {scratch, W};
}

bool needs_packing(const TensorView& x) {
  const int64_t N = x.shape[1], W = x.shape[2];
  return !(x.strides[2] == 1 && x.strides[1] >= W && (x.shape[0] == 1 || x.strides[0] == N * x.strides[1]));
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

kernels::MaskRef mask_ref(const TensorView& m, MaskKind kind) {
  kernels::MaskRef r;
  r.data = m.data;
  r.dtype = m.dtype == DType::u8 ? kernels::MaskDType::u8 : kernels::MaskDType::f32;
  r.mode = kind == MaskKind::keep ? kernels::MaskMode::keep
           : kind == MaskKind::block ? kernels::MaskMode::block
                                     : kernels::MaskMode::additive;
  r.stride_i = m.strides[m.rank - 2];
  r.stride_j = m.strides[m.rank - 1];
  return r;
}

const void* advance(const void* p, DType dt, int64_t elems) {
  return dt == DType::u8 ? static_cast<const void*>(static_cast<const uint8_t*>(p) + elems)
                         : static_cast<const void*>(static_cast<const float*>(p) + elems);
}

}  // namespace

struct MultiHeadAttention::Impl {
  Config cfg;
  Isa isa;
  const kernels::AttentionKernel* kernel;
  int default_threads;

  // One (D, width) projection per head and per Q/K/V, so that each GEMM writes its head's (T, D) rows
  // contiguously: Q, K and V land head-major, [B][H][T][D], exactly where attention reads them.
  // Self-attention feeds the query to all three; cross-attention feeds query, key and value.
  std::vector<Linear> proj_q, proj_k, proj_v;
  Linear out;

  // The registered causal mask: the triangular (context x context) buffer of the seeds is Toeplitz, so
  // one row of it holds every entry: causal_row[center + c] = 0 if c = i + offset - j >= 0 else -inf.
  std::vector<float> causal_row;
  int64_t causal_center = 0;

  std::unique_ptr<float[], FreeDeleter> ws;
  size_t ws_floats = 0;
  std::mutex mu;

  Impl(const Config& c, const Weights& w, const EngineOptions& o)
      : cfg(c),
        isa(detail::resolve_isa(o.isa)),
        kernel(&detail::attention_kernel(isa)),
        default_threads(o.threads > 0 ? o.threads : omp_get_max_threads()),
        out(w.w_o.data(), cfg.out_bias ? w.b_o.data() : nullptr, cfg.d_model, cfg.d_model) {
    const int64_t H = cfg.num_heads, D = cfg.head_dim();
    auto per_head = [&](std::vector<Linear>& dst, const std::vector<float>& weight, const std::vector<float>& bias,
                        int64_t width) {
      for (int64_t h = 0; h < H; ++h) {
        dst.emplace_back(weight.data() + h * D * width, cfg.qkv_bias ? bias.data() + h * D : nullptr, D, width);
      }
    };
    per_head(proj_q, w.w_q, w.b_q, cfg.query_width());
    per_head(proj_k, w.w_k, w.b_k, cfg.key_width());
    per_head(proj_v, w.w_v, w.b_v, cfg.value_width());

    const int64_t C = cfg.context_length;
    causal_center = C - 1;
    causal_row.resize(static_cast<size_t>(causal_center + C + kernels::kMaxQueryTile));
    for (int64_t i = 0; i < static_cast<int64_t>(causal_row.size()); ++i) {
      causal_row[i] = i - causal_center >= 0 ? 0.0f : -INFINITY;
    }
  }

  int64_t scratch_stride() const { return round_up(static_cast<int64_t>(kernel->scratch_floats(cfg.head_dim())), 16); }

  // Workspace layout (floats, each region 64-byte aligned):
  //   q            (B, H, T, D)     k, v   (B, H, Tk, D) each: the projections, head-major
  //   ctx          (B, T, E): attention output, heads concatenated, read by the output projection
  //   packed       copies of inputs whose strides oneDNN cannot read in place (query | key | value)
  //   scratch      threads x the kernel's scratch_floats(D)
  struct Plan {
    int64_t q, k, v, ctx, packed_q, packed_k, packed_v, scratch, total;
  };
  Plan plan(const Shape& s, bool pack_q, bool pack_k, bool pack_v, int threads) const {
    Plan p{};
    int64_t at = 0;
    auto region = [&](int64_t n) {
      const int64_t start = at;
      at += round_up(n, 16);
      return start;
    };
    p.q = region(s.B * s.T * s.E);
    p.k = region(s.B * s.Tk * s.E);
    p.v = region(s.B * s.Tk * s.E);
    p.ctx = region(s.B * s.T * s.E);
    p.packed_q = region(pack_q ? s.B * s.T * s.d_in : 0);
    p.packed_k = region(pack_k ? s.B * s.Tk * s.kdim : 0);
    p.packed_v = region(pack_v ? s.B * s.Tk * s.vdim : 0);
    p.scratch = region(threads * scratch_stride());
    p.total = at;
    return p;
  }

  void grow_workspace(int64_t floats) {
    if (static_cast<size_t>(floats) <= ws_floats) return;
    const size_t bytes = static_cast<size_t>(round_up(floats, 16)) * sizeof(float);
    float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p) fail(ErrorCode::out_of_memory, "workspace: cannot allocate " + std::to_string(bytes) + " bytes");
    ws.reset(p);
    ws_floats = bytes / sizeof(float);
  }

  // Q (B, H, T, D), K and V (B, H, Tk, D) from inputs read as (B*N, width) row matrices. The 3H per-head
  // GEMMs run in parallel, one thread each: they are independent, so this scales without oneDNN's
  // per-GEMM barriers, and a head's Linear is only ever used by one thread at a time.
  void project(const Shape& s, Rows xq, Rows xk, Rows xv, float* q, float* k, float* v, int threads) {
    const int64_t H = s.H, D = s.D, B = s.B;
    Linear* lin[3] = {proj_q.data(), proj_k.data(), proj_v.data()};
    const Rows x[3] = {xq, xk, xv};
    float* dst[3] = {q, k, v};
    const int64_t n[3] = {s.T, s.Tk, s.Tk};
    std::exception_ptr error;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < 3 * H; ++item) {
      const int64_t which = item / H, h = item % H;
      try {
        for (int64_t b = 0; b < B; ++b) {
          lin[which][h].run(x[which].data + b * n[which] * x[which].ld, n[which], x[which].ld,
                            dst[which] + (b * H + h) * n[which] * D, D, 1);
        }
      } catch (...) {
#pragma omp critical(gpt2attn_project_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }

  void forward(const AttentionInputs& in, float* out_data, const RunOptions& run) {
    std::lock_guard<std::mutex> lock(mu);
    const Shape s = detail::validate_inputs(cfg, in, run);
    if (!out_data) invalid("output: null pointer");
    const int threads = run.threads > 0 ? run.threads : default_threads;
    const bool pack_q = needs_packing(in.query);
    const bool pack_k = !s.self_attention && needs_packing(in.key);
    const bool pack_v = !s.self_attention && needs_packing(in.value);
    const Plan p = plan(s, pack_q, pack_k, pack_v, threads);
    grow_workspace(p.total);
    float* w = ws.get();

    const Rows xq = as_rows(in.query, w + p.packed_q);
    const Rows xk = s.self_attention ? xq : as_rows(in.key, w + p.packed_k);
    const Rows xv = s.self_attention ? xq : as_rows(in.value, w + p.packed_v);
    project(s, xq, xk, xv, w + p.q, w + p.k, w + p.v, threads);

    float* ctx = w + p.ctx;
    attend(s, in, run, w + p.q, w + p.k, w + p.v, ctx, w + p.scratch, threads);
    out.run(ctx, s.B * s.T, s.E, out_data, s.E, threads);
  }

  // The attention core: (B, H, query tiles) split across threads. With a causal mask, later query tiles
  // see more keys, so work items are issued longest first and taken dynamically (greedy balancing).
  void attend(const Shape& s, const AttentionInputs& in, const RunOptions& run, const float* qp, const float* kp,
              const float* vp, float* ctx, float* scratch_base, int threads) {
    const int64_t B = s.B, H = s.H, D = s.D, T = s.T, Tk = s.Tk, E = s.E;
    kernels::AttentionArgs base;
    base.ldq = base.ldk = base.ldv = D;
    base.ldo = E;
    base.T = T, base.Tk = Tk, base.D = D;
    base.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    base.causal = cfg.causal;
    base.causal_offset = Tk - T;
    base.causal_bias = causal_row.data() + causal_center;
    base.dropout_p = run.training ? cfg.dropout : 0.0f;
    base.dropout_seed = run.dropout_seed;
    kernels::MaskRef mask, padding;
    if (!in.attn_mask.empty()) mask = mask_ref(in.attn_mask, in.mask_kind);
    if (!in.key_padding.empty()) padding = mask_ref(in.key_padding, MaskKind::block);

    const int64_t BQ = kernel->tiles.query_tile;
    const int64_t tiles = (T + BQ - 1) / BQ, items = B * H * tiles;
    const int64_t stride = scratch_stride();
    const kernels::AttentionKernel* kern = kernel;
    const TensorView& m = in.attn_mask;
#pragma omp parallel num_threads(threads)
    {
      float* scratch = scratch_base + omp_get_thread_num() * stride;
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < items; ++it) {
        const int64_t tile = tiles - 1 - it / (B * H), bh = it % (B * H), b = bh / H, h = bh % H;
        kernels::AttentionArgs a = base;
        a.q = qp + bh * T * D;
        a.k = kp + bh * Tk * D;
        a.v = vp + bh * Tk * D;
        a.out = ctx + b * T * E + h * D;
        if (mask.data) {
          a.mask = mask;
          int64_t off = 0;
          if (m.rank >= 3) off += b * m.strides[0];
          if (m.rank == 4) off += h * m.strides[1];
          a.mask.data = advance(mask.data, m.dtype, off);
        }
        if (padding.data) {
          a.key_padding = padding;
          a.key_padding.data = advance(padding.data, in.key_padding.dtype, b * in.key_padding.strides[0]);
          a.key_padding.stride_j = in.key_padding.strides[1];
        }
        a.dropout_base = static_cast<uint64_t>((b * H + h) * T * Tk);
        kern->run(a, tile * BQ, std::min(T, (tile + 1) * BQ), scratch);
      }
    }
  }
};

MultiHeadAttention::MultiHeadAttention(const Config& config, const Weights& weights, const EngineOptions& options) {
  config.validate();
  weights.validate(config);
  if (options.threads < 0) invalid("threads must be >= 0, got " + std::to_string(options.threads));
  impl_ = std::make_unique<Impl>(config, weights, options);
}
MultiHeadAttention::~MultiHeadAttention() = default;
MultiHeadAttention::MultiHeadAttention(MultiHeadAttention&&) noexcept = default;
MultiHeadAttention& MultiHeadAttention::operator=(MultiHeadAttention&&) noexcept = default;

void MultiHeadAttention::forward(const AttentionInputs& in, float* out, const RunOptions& run) {
  impl_->forward(in, out, run);
}

size_t MultiHeadAttention::workspace_bytes(int64_t B, int64_t T, int64_t Tk) const {
  const Config& c = impl_->cfg;
  Shape s;
  s.B = B, s.T = T, s.Tk = Tk, s.E = c.d_model, s.H = c.num_heads, s.D = c.head_dim();
  s.d_in = c.query_width(), s.kdim = c.key_width(), s.vdim = c.value_width();
  // The worst case: cross-attention with every input packed.
  return static_cast<size_t>(impl_->plan(s, true, true, true, impl_->default_threads).total) * sizeof(float);
}

void MultiHeadAttention::reserve(int64_t B, int64_t T, int64_t Tk) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->grow_workspace(static_cast<int64_t>(workspace_bytes(B, T, Tk) / sizeof(float)));
}

const Config& MultiHeadAttention::config() const { return impl_->cfg; }
Isa MultiHeadAttention::isa() const { return impl_->isa; }
int MultiHeadAttention::default_threads() const { return impl_->default_threads; }
std::string MultiHeadAttention::implementation() const {
  return std::string("tiled-online-softmax/") + impl_->kernel->isa + " + onednn-matmul/" +
         impl_->proj_q.front().implementation();
}

CausalSelfAttention::CausalSelfAttention(Config config, const Weights& weights, const EngineOptions& options)
    : mha_((config.causal = true, config), weights, options) {
  if (!mha_.config().same_input_widths()) invalid("CausalSelfAttention: kdim and vdim must equal d_in");
}

void CausalSelfAttention::forward(const float* x, int64_t B, int64_t T, float* out, const RunOptions& run) {
  AttentionInputs in;
  in.query = TensorView::f32(x, {B, T, mha_.config().query_width()});
  mha_.forward(in, out, run);
}

}  // namespace gpt2attn
