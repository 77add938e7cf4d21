// engine/attention.cpp: the layer's construction and its batch forward: per-head projections on oneDNN writing
// Q/K/V head-major, the attention core split across the caller's threads, the output projection. All set-up
// happens in the constructor; forward() computes. The KV-cache calls live in engine/serving.cpp.
#include "gpt2attn/attention.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "engine/convert.hpp"
#include "engine/dispatch.hpp"
#include "engine/layer.hpp"
#include "engine/quantized.hpp"
#include "engine/weights_check.hpp"
#include "gpt2attn/error.hpp"

namespace gpt2attn {

using detail::Linear;
using detail::AttnShape;
using detail::Rows;
using detail::as_rows;
using detail::needs_packing;

namespace {

// Element i of an activation buffer of type t.
std::byte* elem(std::byte* base, DType t, int64_t i) { return base + i * static_cast<int64_t>(size_of(t)); }

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

// The (T, Tk) plane that batch b, head h reads of the mask r over m: (T, Tk), (B, T, Tk) or (B, H, T, Tk).
kernels::MaskRef mask_plane(const kernels::MaskRef& r, const TensorView& m, int64_t b, int64_t h) {
  int64_t off = 0;
  if (m.rank >= 3) off += b * m.strides[0];
  if (m.rank == 4) off += h * m.strides[1];
  kernels::MaskRef p = r;
  p.data = advance(r.data, m.dtype, off);
  return p;
}

// Row b of the key-padding mask r over kp (B, Tk).
kernels::MaskRef padding_row(const kernels::MaskRef& r, const TensorView& kp, int64_t b) {
  kernels::MaskRef p = r;
  p.data = advance(r.data, kp.dtype, b * kp.strides[0]);
  p.stride_j = kp.strides[1];
  return p;
}

}  // namespace

MultiHeadAttention::Impl::Impl(const Config& c, const detail::LayerWeights& lw, const EngineOptions& o,
                               const detail::HeadShard* shard)
    : cfg(c),
      out_width(shard ? shard->out_width : c.d_model),
      first_head(shard ? shard->first_head : 0),
      total_heads(shard ? shard->total_heads : c.num_heads),
      isa(detail::resolve_isa(o.isa)),
      compute(o.compute),
      weights(lw.format()),
      kset(detail::kernels_for(isa, compute, compute)),
      default_threads(detail::threads_or_default(o.threads)) {
  const int64_t D = cfg.head_dim();
  // D rows of a matrix as one GEMM's weights: as given, or for quantized weights their codes: int8 on oneDNN's integer
  // GEMMs where it has VNNI (Linear::int8_available), otherwise the values the codes give; int4 dequantized per call.
  const bool int8 = weights == WeightFormat::int8 && Linear::int8_available();
  enum class Matrix { q, k, v, o };
  using M = Matrix;
  const WeightsView& views = lw.views();
  auto linear = [&](Matrix m, int64_t r0, const float* bias) {
    if (weights == WeightFormat::compute) {
      const TensorView& w = m == M::q ? views.w_q : m == M::k ? views.w_k : m == M::v ? views.w_v : views.w_o;
      return Linear(detail::slice(w, 0, r0, D), bias, compute);
    }
    const QuantizedWeights& qw = lw.quantized();
    const QuantizedMatrix& w = m == M::q ? qw.w_q : m == M::k ? qw.w_k : m == M::v ? qw.w_v : qw.w_o;
    const int64_t G = detail::quant_groups(weights, w.cols);
    if (int8 || weights == WeightFormat::int4) {
      return Linear(weights, w.codes.data() + r0 * w.cols, w.scales.data() + r0 * G, D, w.cols, bias, compute,
                    detail::linear_kernel(isa, weights, compute).dequantize);
    }
    std::vector<float> values(static_cast<size_t>(D * w.cols));
    detail::dequantize_rows(w, weights, r0, D, values.data());
    return Linear(TensorView::f32(values.data(), {D, w.cols}), bias, compute);
  };
  auto per_head = [&](std::vector<Linear>& dst, int64_t heads, Matrix m, const TensorView& bias) {
    const std::vector<float> b = detail::f32_values(bias);
    for (int64_t h = 0; h < heads; ++h) dst.push_back(linear(m, h * D, cfg.qkv_bias ? b.data() + h * D : nullptr));
  };
  per_head(proj_q, cfg.num_heads, M::q, views.b_q);
  per_head(proj_k, cfg.kv_heads(), M::k, views.b_k);
  per_head(proj_v, cfg.kv_heads(), M::v, views.b_v);
  const std::vector<float> b_o = cfg.out_bias ? detail::f32_values(views.b_o) : std::vector<float>{};
  for (int64_t n = 0; n < out_width; n += D) out.push_back(linear(M::o, n, cfg.out_bias ? b_o.data() + n : nullptr));
  operand = out.front().operand();
}

void MultiHeadAttention::Impl::run_out(detail::ExecContext& ctx, const void* x, int64_t M, void* y, DType dst,
                                       int threads, std::byte* wide) const {
  const int64_t D = cfg.head_dim(), E = cfg.d_model;
  const float* scales = nullptr;
  if (operand == DType::u8) {  // int8 GEMMs: each row quantized once for all the panels
    const Rows q = detail::quantize_rows(TensorView::contiguous(x, compute, {1, M, E}), wide, threads);
    x = q.data, scales = q.scales;
  } else if (widens()) {  // bf16 values, widened exactly once for all the panels
    detail::convert(TensorView::contiguous(x, compute, {M, E}), DType::f32, wide, threads);
    x = wide;
  }
  const size_t xsize = size_of(operand), ysize = size_of(dst);
  const int64_t panels = static_cast<int64_t>(out.size());
  // Item = (row block, panel), row blocks outermost: the threads take one block's panels together. int4 panels
  // outermost instead: a thread's next item is then mostly the same panel, whose weights its slot holds dequantized.
  const int64_t blocks = detail::ceil_div(M, kRowBlock);
  const bool panel_major = weights == WeightFormat::int4;
  detail::team_for(threads, blocks * panels, [&](int64_t item, int thread) {
    const int64_t p = panel_major ? item / blocks : item % panels;
    const int64_t r0 = (panel_major ? item % blocks : item / panels) * kRowBlock, rows = std::min(kRowBlock, M - r0);
    out[static_cast<size_t>(p)].run(ctx, static_cast<const std::byte*>(x) + r0 * E * xsize, rows, E,
                                    static_cast<std::byte*>(y) + (r0 * out_width + p * D) * ysize, out_width, 1,
                                    thread, dst, scales ? scales + r0 : nullptr);
  });
}

void MultiHeadAttention::Impl::prepare_rows(const detail::Linear& lin, detail::ExecContext& ctx, int64_t n,
                                            int64_t lda, int64_t ldc, int threads, DType dst) {
  for (int slot = 0; slot < threads; ++slot) {
    if (n >= kRowBlock) lin.prepare(ctx, kRowBlock, lda, ldc, 1, slot, dst);
    if (n % kRowBlock != 0) lin.prepare(ctx, n % kRowBlock, lda, ldc, 1, slot, dst);
  }
}

void MultiHeadAttention::Impl::prepare_out(detail::ExecContext& ctx, int64_t M, int threads, DType dst) const {
  prepare_rows(out.front(), ctx, M, cfg.d_model, out_width, threads, dst);
}

int64_t MultiHeadAttention::Impl::scratch_stride(const kernels::AttentionKernel& k) const {
  return detail::round_up(static_cast<int64_t>(k.scratch_floats(cfg.head_dim())), 16);
}

kernels::AttentionArgs MultiHeadAttention::Impl::base_args(int64_t T, int64_t Tk) const {
  const int64_t D = cfg.head_dim();
  kernels::AttentionArgs a;
  a.ldq = D;
  a.ldo = cfg.d_model;
  a.T = T, a.Tk = Tk, a.D = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.causal = cfg.causal;
  a.causal_offset = Tk - T;
  return a;
}

ForwardPlan MultiHeadAttention::Impl::forward_plan(const AttnShape& s, bool pack_q, bool pack_k, bool pack_v,
                                                   int threads) const {
  detail::WorkspacePlan p;
  ForwardPlan r;
  const DType t = compute;
  r.q = p.region(t, {s.B, s.H, s.T, s.D}, "forward: q");
  r.k = p.region(t, {s.B, s.H_kv, s.Tk, s.D}, "forward: k");
  r.v = p.region(t, {s.B, s.H_kv, s.Tk, s.D}, "forward: v");
  r.ctx = p.region(t, {s.B, s.T, s.E}, "forward: attention output");
  r.ctx_wide = p.region<std::byte>({ctx_operand_bytes(s.B * s.T)}, "forward: attention output, widened or quantized");
  r.packed_q = p.region<std::byte>({pack_q, detail::operand_bytes(operand, s.B * s.T, s.d_in)}, "forward: packed query");
  r.packed_k = p.region<std::byte>({pack_k, detail::operand_bytes(operand, s.B * s.Tk, s.kdim)}, "forward: packed key");
  r.packed_v = p.region<std::byte>({pack_v, detail::operand_bytes(operand, s.B * s.Tk, s.vdim)},
                                   "forward: packed value");
  r.scratch = p.region<float>({threads, scratch_stride(*kset.prefill)}, "forward: kernel scratch");
  r.bytes = p.bytes();
  return r;
}

namespace {

// Q (B, H, T, D), K and V (B, H_kv, Tk, D) from inputs read as (B*N, width) row matrices. The H + 2 H_kv
// per-head GEMMs of each row block (Impl::kRowBlock) run in parallel, one thread each: they are independent, so
// this scales without oneDNN's per-GEMM barriers. `check`: each GEMM's output is scanned for an overflow
// (detail::check_projection) while it is still in cache.
void project(MultiHeadAttention::Impl& L, detail::ExecContext& ctx, const AttnShape& s, Rows xq, Rows xk, Rows xv,
             std::byte* q, std::byte* k, std::byte* v, bool check, int threads) {
  const int64_t D = s.D, B = s.B;
  const Linear* lin[3] = {L.proj_q.data(), L.proj_k.data(), L.proj_v.data()};
  const Rows x[3] = {xq, xk, xv};
  std::byte* dst[3] = {q, k, v};
  const int64_t n[3] = {s.T, s.Tk, s.Tk};
  const int64_t heads[3] = {s.H, s.H_kv, s.H_kv};
  // Item = (batch entry, row block, GEMM), the GEMMs innermost: the threads take one block's heads together.
  const int64_t per_block = s.H + 2 * s.H_kv, blocks = detail::ceil_div(std::max(s.T, s.Tk), L.kRowBlock);
  detail::team_for(threads, B * blocks * per_block, [&](int64_t item, int thread) {
    const int64_t b = item / (blocks * per_block), r0 = item / per_block % blocks * L.kRowBlock;
    const int64_t j = item % per_block, which = j < s.H ? 0 : 1 + (j - s.H) / s.H_kv;
    const int64_t h = which == 0 ? j : (j - s.H) % s.H_kv, rows = std::min(L.kRowBlock, n[which] - r0);
    if (rows <= 0) return;  // a block past the shorter of query and key
    std::byte* y = elem(dst[which], L.compute, ((b * heads[which] + h) * n[which] + r0) * D);
    lin[which][h].run(ctx, x[which].row(b * n[which] + r0), rows, x[which].ld, y, D, 1, thread, L.compute,
                      x[which].scale(b * n[which] + r0));
    if (check) {
      static constexpr const char* kNames[3] = {"forward: the query", "forward: the key", "forward: the value"};
      detail::check_projection(y, L.compute, rows, D, D, kNames[which], h * D);
    }
  });
}

}  // namespace

void MultiHeadAttention::Impl::forward(const AttentionInputs& in, void* out_data, DType out_dtype,
                                       const RunOptions& run, Workspace::Impl& ws) {
  const int threads = threads_for(run);
  const AttnShape s = detail::validate_inputs(cfg, in, run, threads);
  if (!out_data) invalid("output: null pointer");
  check_output_dtype(out_dtype);
  const bool pack_q = needs_packing(in.query, compute, operand);
  const bool pack_k = !s.self_attention && needs_packing(in.key, compute, operand);
  const bool pack_v = !s.self_attention && needs_packing(in.value, compute, operand);
  const ForwardPlan r = forward_plan(s, pack_q, pack_k, pack_v, threads);
  std::byte* w = ws.reserve(static_cast<size_t>(r.bytes));

  const Rows xq = as_rows(in.query, compute, operand, r.packed_q.in(w), threads);
  const Rows xk = s.self_attention ? xq : as_rows(in.key, compute, operand, r.packed_k.in(w), threads);
  const Rows xv = s.self_attention ? xq : as_rows(in.value, compute, operand, r.packed_v.in(w), threads);
  project(*this, ws.exec, s, xq, xk, xv, r.q.in(w), r.k.in(w), r.v.in(w), run.check_finite, threads);

  // The attention core: (B, H, query tiles) split across threads.
  const int64_t H = s.H, D = s.D, T = s.T, Tk = s.Tk, E = s.E;
  kernels::AttentionArgs base = base_args(T, Tk);
  base.dropout_p = run.training ? cfg.dropout : 0.0f;
  base.dropout_seed = run.dropout_seed;
  kernels::MaskRef mask, padding;
  if (!in.attn_mask.empty()) mask = mask_ref(in.attn_mask, in.mask_kind);
  if (!in.key_padding.empty()) padding = mask_ref(in.key_padding, MaskKind::block);
  std::byte *qp = r.q.in(w), *kp = r.k.in(w), *vp = r.v.in(w), *ctx = r.ctx.in(w);
  const DType t = compute;
  const int64_t H_kv = s.H_kv;
  const kernels::AttentionKernel& kern = *kset.prefill;
  run_query_tiles(kern, s.B * H, T, base, r.scratch.in(w), threads, [&](kernels::AttentionArgs& a, int64_t bh) {
    const int64_t b = bh / H, h = bh % H, kv_slice = b * H_kv + s.kv_head(h);
    a.q = elem(qp, t, bh * T * D);
    a.kv.k = elem(kp, t, kv_slice * Tk * D);
    a.kv.v = elem(vp, t, kv_slice * Tk * D);
    a.kv.ldk = a.kv.ldv = D;
    a.out = elem(ctx, t, b * T * E + h * D);
    if (mask.data) a.mask = mask_plane(mask, in.attn_mask, b, h);
    if (padding.data) a.key_padding = padding_row(padding, in.key_padding, b);
    a.dropout_base = static_cast<uint64_t>((b * total_heads + first_head + h) * T * Tk);
  });
  run_out(ws.exec, ctx, s.B * T, out_data, out_dtype, threads, r.ctx_wide.in(w));
  if (run.check_finite) {
    detail::check_projection(out_data, out_dtype, s.B * T, out_width, out_width, "forward: the output", 0, threads);
  }
}

void MultiHeadAttention::Impl::check_output_dtype(DType out_dtype) const {
  if (out_dtype == DType::f32 || (out_dtype == DType::bf16 && compute == DType::bf16)) return;
  if (out_dtype == DType::bf16) {
    invalid("output: dtype bf16 needs a layer computing in bf16 (EngineOptions.compute = bf16); this one computes "
            "in f32");
  }
  invalid(std::string("output: expected dtype f32 or bf16, got ") + to_string(out_dtype));
}

namespace {
WeightsView checked_view(const Config& c, const Weights& w) {
  return detail::translate_bad_alloc("MultiHeadAttention", [&] {
    c.validate();
    detail::check_weight_sizes(w, c);  // before views of the config's shapes are made over them; values: create()
    return w.view(c);
  });
}
}  // namespace

MultiHeadAttention::MultiHeadAttention(const Config& config, const Weights& weights, const EngineOptions& options)
    : MultiHeadAttention(config, checked_view(config, weights), options) {}

namespace {
void check_options(const EngineOptions& options) {
  detail::check_threads(options.threads, "MultiHeadAttention", "EngineOptions.threads");
  if (options.compute != DType::f32 && options.compute != DType::bf16) {
    invalid(std::string("MultiHeadAttention: EngineOptions.compute ") + to_string(options.compute) +
            " is not a compute type (expected f32 or bf16)");
  }
  if (options.weights != WeightFormat::compute && options.weights != WeightFormat::int8 &&
      options.weights != WeightFormat::int4) {
    invalid("MultiHeadAttention: EngineOptions.weights " + std::to_string(static_cast<int>(options.weights)) +
            " is not a weight format (compute, int8, int4)");
  }
}

// The config a CausalSelfAttention computes: the caller's, made causal.
Config causal_config(Config c) {
  c.causal = true;
  return c;
}
}  // namespace

std::unique_ptr<MultiHeadAttention::Impl> MultiHeadAttention::Impl::build(const Config& config,
                                                                        const detail::LayerWeights& weights,
                                                                        const EngineOptions& options,
                                                                        const detail::HeadShard* shard, bool serving) {
  // oneDNN's weight reorders run OpenMP teams: at the layer's thread count, not the process default (a threads =
  // 1 layer built in a process with OMP_NUM_THREADS=2 would otherwise start a second thread).
  detail::ScopedOmpThreads scope(options.threads);
  auto layer = std::make_unique<Impl>(config, weights, options, shard);
  if (serving) {
    detail::translate_bad_alloc(shard ? "tensor parallel: packing the decode weights"
                                      : "CausalSelfAttention: packing the decode weights",
                                [&] { layer->add_serving(weights); });
  }
  return layer;
}

std::unique_ptr<MultiHeadAttention::Impl> MultiHeadAttention::Impl::create(const Config& config,
                                                                         const WeightsView& weights,
                                                                         const EngineOptions& options,
                                                                         const detail::HeadShard* shard,
                                                                         bool serving) {
  // The checks too: their messages need memory, and a bad argument met with an exhausted heap is still an Error.
  return detail::translate_bad_alloc("MultiHeadAttention: constructing the layer", [&] {
    config.validate();
    detail::validate_weights(weights, config, shard ? shard->out_width : config.d_model);
    check_options(options);
    if (serving && !config.same_input_widths()) invalid("CausalSelfAttention: kdim and vdim must equal d_in");
    // Quantized formats: every row quantized once, here, for both the GEMMs' and decode's packings.
    const detail::LayerWeights source(weights, options.weights);
    return build(config, source, options, shard, serving);
  });
}

std::unique_ptr<MultiHeadAttention::Impl> MultiHeadAttention::Impl::create(const Config& config,
                                                                         const QuantizedWeights& weights,
                                                                         const EngineOptions& options, bool serving) {
  return detail::translate_bad_alloc("MultiHeadAttention: constructing the layer", [&] {
    config.validate();
    detail::validate_quantized(weights, config, config.d_model);
    check_options(options);
    if (options.weights != WeightFormat::compute && options.weights != weights.format) {
      invalid(std::string("MultiHeadAttention: EngineOptions.weights is ") + to_string(options.weights) +
              " but the quantized weights given are " + to_string(weights.format) +
              " (leave it at compute to take theirs)");
    }
    if (serving && !config.same_input_widths()) invalid("CausalSelfAttention: kdim and vdim must equal d_in");
    return build(config, detail::LayerWeights(weights), options, nullptr, serving);
  });
}

MultiHeadAttention::MultiHeadAttention(const Config& config, const WeightsView& weights, const EngineOptions& options)
    : impl_(Impl::create(config, weights, options)) {}
MultiHeadAttention::MultiHeadAttention(const Config& config, const QuantizedWeights& weights,
                                       const EngineOptions& options)
    : impl_(Impl::create(config, weights, options)) {}
MultiHeadAttention::MultiHeadAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MultiHeadAttention::~MultiHeadAttention() = default;
MultiHeadAttention::MultiHeadAttention(MultiHeadAttention&&) noexcept = default;
MultiHeadAttention& MultiHeadAttention::operator=(MultiHeadAttention&&) noexcept = default;

void MultiHeadAttention::forward(const AttentionInputs& in, float* out, const RunOptions& run, Workspace* ws) {
  forward(in, out, DType::f32, run, ws);
}

void MultiHeadAttention::forward(const AttentionInputs& in, void* out, DType out_dtype, const RunOptions& run,
                                 Workspace* ws) {
  impl_->with_workspace(ws, "forward", [&](Workspace::Impl& w) { impl_->forward(in, out, out_dtype, run, w); });
}

size_t MultiHeadAttention::workspace_bytes(int64_t B, int64_t T, int64_t Tk) const {
  const Config& c = impl_->cfg;
  if (B < 1 || T < 1 || Tk < 1 || T > c.context_length || Tk > c.context_length) {
    invalid("workspace_bytes/reserve: expected B >= 1 and 1 <= T, Tk <= context_length=" +
            std::to_string(c.context_length) + ", got (B, T, Tk) = (" + std::to_string(B) + ", " + std::to_string(T) +
            ", " + std::to_string(Tk) + ")");
  }
  AttnShape s = detail::shape_of(c);
  s.B = B, s.T = T, s.Tk = Tk;
  // The worst case: cross-attention with every input packed.
  return static_cast<size_t>(impl_->forward_plan(s, true, true, true, impl_->default_threads).bytes);
}

void MultiHeadAttention::reserve(int64_t B, int64_t T, int64_t Tk, Workspace* ws) {
  const size_t bytes = workspace_bytes(B, T, Tk);
  const Impl& L = *impl_;
  auto prepare = [&](Workspace::Impl& w) {
    w.reserve(bytes);
    // The GEMMs of a forward on contiguous inputs: per-head projections (one shape for all heads) on every
    // thread of the team, and the output projection's panels on every thread too.
    const int64_t D = L.cfg.head_dim();
    const int n = L.default_threads;
    Impl::prepare_rows(L.proj_q[0], w.exec, T, L.cfg.query_width(), D, n, L.compute);
    Impl::prepare_rows(L.proj_k[0], w.exec, Tk, L.cfg.key_width(), D, n, L.compute);
    Impl::prepare_rows(L.proj_v[0], w.exec, Tk, L.cfg.value_width(), D, n, L.compute);
    L.prepare_out(w.exec, B * T, L.default_threads, DType::f32);
    if (L.compute == DType::bf16) L.prepare_out(w.exec, B * T, L.default_threads, DType::bf16);
  };
  impl_->with_workspace(ws, "reserve", prepare);
}

int max_threads() { return std::min(kMaxThreads, omp_get_thread_limit()); }

const Config& MultiHeadAttention::config() const { return impl_->cfg; }
Isa MultiHeadAttention::isa() const { return impl_->kset.isa; }
int MultiHeadAttention::default_threads() const { return impl_->default_threads; }
std::string MultiHeadAttention::implementation() const {
  const std::string row = impl_->kset.name;
  const bool quantized = impl_->weights != WeightFormat::compute;
  const bool dequantized = impl_->weights == WeightFormat::int8 && impl_->operand != DType::u8;  // no VNNI
  std::string s = "kernels " + row + " (prefill: tiled-online-softmax + onednn-matmul/" +
                  impl_->proj_q.front().implementation() + (dequantized ? " on dequantized weights" : "");
  if (impl_->serving) {
    s += std::string("; decode: split-kv-one-query + few-row-linear/") +
         (quantized ? to_string(impl_->weights) : to_string(impl_->compute)) + " weights";
  }
  s += ")";
  return s;
}

CausalSelfAttention::CausalSelfAttention(Config config, const Weights& weights, const EngineOptions& options)
    : CausalSelfAttention(config, checked_view(causal_config(config), weights), options) {}

CausalSelfAttention::CausalSelfAttention(Config config, const WeightsView& weights, const EngineOptions& options)
    : mha_(MultiHeadAttention::Impl::create(causal_config(config), weights, options, nullptr, /*serving=*/true)) {}

CausalSelfAttention::CausalSelfAttention(Config config, const QuantizedWeights& weights, const EngineOptions& options)
    : mha_(MultiHeadAttention::Impl::create(causal_config(config), weights, options, /*serving=*/true)) {}

void CausalSelfAttention::forward(const float* x, int64_t B, int64_t T, float* out, const RunOptions& run,
                                  Workspace* ws) {
  AttentionInputs in;
  in.query = TensorView::f32(x, {B, T, mha_.config().query_width()});
  mha_.forward(in, out, run, ws);
}

}  // namespace gpt2attn
