// engine/serving.cpp: CausalSelfAttention with a paged KV cache: extend() (prefill or chunked prefill of one
// sequence, K/V projected straight into the cache's blocks) and decode() (one token for each of B sequences:
// one fused QKV GEMM, K/V rows stored into the blocks, split-KV attention, the output GEMM). Validation and
// the pool reservation come first, so a failed call leaves the cache and `out` as they were.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

#include "engine/kv_cache.hpp"
#include "engine/layer.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn {
namespace {

using detail::ceil_div;
using detail::str;

// Pointers and int64s stored in the float workspace take this many floats each.
constexpr int64_t kFloatsPerWord = sizeof(int64_t) / sizeof(float);
static_assert(sizeof(const float*) == sizeof(int64_t));

// The cache must have been built for this layer's heads and widths.
void check_cache(const Config& layer, const KvCache& cache, const RunOptions& run, const char* call) {
  const Config& c = cache.config();
  if (c.d_model != layer.d_model || c.num_heads != layer.num_heads) {
    invalid(std::string(call) + ": the KV cache was built for E=" + str(c.d_model) + ", H=" + str(c.num_heads) +
            " but the layer has E=" + str(layer.d_model) + ", H=" + str(layer.num_heads));
  }
  if (run.training) invalid(std::string(call) + ": the KV cache is for inference; RunOptions.training must be false");
  detail::check_threads(run.threads, call, "run.threads");
}

int64_t max_length(const Config& layer, const KvCache& cache) {
  return std::min(layer.context_length, cache.config().context_length);
}

// Runs f(item) for items [0, n) across the team, round robin, and rethrows the first exception (oneDNN can
// fail) after the loop, outside the parallel region. Round robin rather than dynamic: the same call shape
// puts the same GEMMs on the same thread every time, so each thread's primitives (keyed by its slot in the
// team, see ExecContext) are created once and then found.
template <class F>
void parallel_items(int64_t n, int threads, F&& f) {
  std::exception_ptr error;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int64_t item = 0; item < n; ++item) {
    try {
      f(item);
    } catch (...) {
#pragma omp critical(gpt2attn_serving_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Ends the pool lease when the call leaves: committed only if the call got to the end.
class AppendLease {
 public:
  AppendLease(KvCache::Impl& kv, const SequenceId* seqs, int64_t n, int64_t tokens)
      : kv_(kv), seqs_(seqs), n_(n), tokens_(tokens) {}
  ~AppendLease() { kv_.end_append(seqs_, n_, tokens_, committed_); }
  void commit() { committed_ = true; }

 private:
  KvCache::Impl& kv_;
  const SequenceId* seqs_;
  int64_t n_, tokens_;
  bool committed_ = false;
};

// Workspace regions of extend() (floats, 64-byte aligned):
//   q (H, T, D) | ctx (T, E) | tables (max blocks, pointers) | length (1 int64) | scratch (threads x stride)
struct ExtendPlan {
  int64_t q, ctx, tables, length, scratch, total;
};
// table_entries: the most blocks a sequence's table holds, ceil(context / block_tokens).
ExtendPlan extend_plan(const Config& c, int64_t T, int threads, int64_t table_entries, int64_t scratch_stride) {
  WorkspacePlan p;
  ExtendPlan r;
  r.q = p.region({T, c.d_model}, "extend: q");
  r.ctx = p.region({T, c.d_model}, "extend: attention output");
  r.tables = p.region({table_entries, kFloatsPerWord}, "extend: block table");
  r.length = p.region({kFloatsPerWord}, "extend: length");
  r.scratch = p.region({threads, scratch_stride}, "extend: kernel scratch");
  r.total = p.total();
  return r;
}

// Workspace regions of decode():
//   stage (B, 3E): the fused projection's output | ctx (B, E) | tables (B x max blocks, pointers)
//   lengths (B int64) | item_base (B + 1 int64) | partials: m, l (items, H), acc (items, H, D) | scratch
// The tables hold table_entries = ceil(context / block_tokens) per sequence. Split-KV items are bounded:
// items <= B + kDecodeItemsPerThread * threads (see decode()).
struct DecodePlan {
  int64_t stage, ctx, tables, lengths, item_base, m, l, acc, scratch, total, max_items;
};
DecodePlan decode_plan(const Config& c, int64_t B, int threads, int64_t table_entries, int64_t scratch_stride) {
  const int64_t E = c.d_model, H = c.num_heads, D = c.head_dim();
  DecodePlan r;
  r.max_items = detail::checked_add(B, int64_t{kernels::tiles::kDecodeItemsPerThread} * threads, "decode: work items");
  WorkspacePlan p;
  r.stage = p.region({B, 3, E}, "decode: qkv");
  r.ctx = p.region({B, E}, "decode: attention output");
  r.tables = p.region({B, table_entries, kFloatsPerWord}, "decode: block tables");
  r.lengths = p.region({B, kFloatsPerWord}, "decode: lengths");
  r.item_base = p.region({B + 1, kFloatsPerWord}, "decode: work items");
  r.m = p.region({r.max_items, H}, "decode: partial maxima");
  r.l = p.region({r.max_items, H}, "decode: partial sums");
  r.acc = p.region({r.max_items, H, D}, "decode: partial outputs");
  r.scratch = p.region({threads, scratch_stride}, "decode: kernel scratch");
  r.total = p.total();
  return r;
}

}  // namespace

int64_t MultiHeadAttention::Impl::decode_scratch_stride(int64_t block_tokens) const {
  return detail::round_up(static_cast<int64_t>(kset.decode->scratch_floats(cfg.num_heads, cfg.head_dim(), block_tokens)),
                          16);
}
// Sized for any cache: block tables for 1-token blocks, kernel scratch for the largest run of keys.
int64_t MultiHeadAttention::Impl::serving_floats(int64_t max_extend_tokens, int64_t max_decode_batch,
                                                 int threads) const {
  const int64_t C = cfg.context_length;
  const int64_t extend = max_extend_tokens ? extend_plan(cfg, max_extend_tokens, threads, C, scratch_stride()).total : 0;
  const int64_t decode =
      max_decode_batch ? decode_plan(cfg, max_decode_batch, threads, C, decode_scratch_stride(C)).total : 0;
  return std::max(extend, decode);
}

void MultiHeadAttention::Impl::extend(KvCache& cache, SequenceId seq, const float* x, int64_t T, float* out_data,
                                      const RunOptions& run, Workspace::Impl& ws) {
  check_cache(cfg, cache, run, "extend");
  if (T < 1) invalid("extend: T must be >= 1, got " + str(T));
  if (!x) invalid("extend: x is a null pointer");
  if (!out_data) invalid("extend: out is a null pointer");
  const int64_t d_in = cfg.query_width(), E = cfg.d_model, H = cfg.num_heads, D = cfg.head_dim();
  if (T > cfg.context_length) {
    invalid("extend: T=" + str(T) + " new tokens exceed context_length=" + str(cfg.context_length));
  }
  if (run.check_finite) detail::check_finite(TensorView::f32(x, {1, T, d_in}), "x", "t");
  const int threads = threads_for(run);
  KvCache::Impl& kv = cache.impl();

  const ExtendPlan r =
      extend_plan(cfg, T, threads, ceil_div(max_length(cfg, cache), kv.block_tokens), scratch_stride());
  float* w = ws.reserve(static_cast<size_t>(r.total));
  const float** tables = reinterpret_cast<const float**>(w + r.tables);
  int64_t& P = *reinterpret_cast<int64_t*>(w + r.length);  // tokens cached before this call
  kv.begin_append(&seq, 1, T, max_length(cfg, cache), tables, 0, &P);
  AppendLease lease(kv, &seq, 1, T);

  // Projections: Q per head into (H, T, D); K and V per head and per block the new tokens touch, each GEMM
  // writing its rows straight into the block: no K/V copy after the GEMM.
  const int64_t bt = kv.block_tokens, first_block = P / bt;
  const int64_t segments = ceil_div(P + T, bt) - first_block;
  float* q = w + r.q;
  parallel_items(H + 2 * H * segments, threads, [&](int64_t item) {
    if (item < H) {
      proj_q[item].run(ws.exec, x, T, d_in, q + item * T * D, D, 1);
      return;
    }
    item -= H;
    const bool is_v = item >= H * segments;
    const int64_t h = (item % (H * segments)) / segments, blk = first_block + item % segments;
    const int64_t t0 = std::max(P, blk * bt) - P, t1 = std::min(P + T, (blk + 1) * bt) - P;  // new-token rows
    float* dst = const_cast<float*>(tables[blk]) + (is_v ? kv.v_offset(h) : kv.k_offset(h)) + ((P + t0) % bt) * D;
    (is_v ? proj_v : proj_k)[h].run(ws.exec, x + t0 * d_in, t1 - t0, d_in, dst, D, 1);
  });

  // Attention of the T new queries over all P + T cached keys (bottom-right causal), read from the blocks.
  kernels::AttentionArgs base = base_args(T, P + T);
  base.paged.blocks = tables;
  base.paged.block_tokens = bt;
  float* ctx = w + r.ctx;
  run_query_tiles(H, T, base, w + r.scratch, threads, [&](kernels::AttentionArgs& a, int64_t h) {
    a.q = q + h * T * D;
    a.out = ctx + h * D;
    a.paged.k_offset = kv.k_offset(h);
    a.paged.v_offset = kv.v_offset(h);
  });
  out.run(ws.exec, ctx, T, E, out_data, E, threads);
  lease.commit();
}

void MultiHeadAttention::Impl::decode(KvCache& cache, const SequenceId* seqs, int64_t B, const float* x,
                                      float* out_data, const RunOptions& run, Workspace::Impl& ws) {
  check_cache(cfg, cache, run, "decode");
  if (B < 1) invalid("decode: B must be >= 1, got " + str(B));
  if (!seqs) invalid("decode: seqs is a null pointer");
  if (!x) invalid("decode: x is a null pointer");
  if (!out_data) invalid("decode: out is a null pointer");
  const int64_t d_in = cfg.query_width(), E = cfg.d_model, H = cfg.num_heads, D = cfg.head_dim();
  if (run.check_finite) detail::check_finite(TensorView::f32(x, {B, 1, d_in}), "x", "t");
  const int threads = threads_for(run);
  KvCache::Impl& kv = cache.impl();

  const int64_t limit = max_length(cfg, cache), stride = ceil_div(limit, kv.block_tokens);  // table entries
  const int64_t sstride = decode_scratch_stride(kv.block_tokens);
  const DecodePlan r = decode_plan(cfg, B, threads, stride, sstride);
  float* w = ws.reserve(static_cast<size_t>(r.total));
  const float** tables = reinterpret_cast<const float**>(w + r.tables);
  int64_t* lengths = reinterpret_cast<int64_t*>(w + r.lengths);  // tokens cached before this step
  kv.begin_append(seqs, B, 1, limit, tables, stride, lengths);
  AppendLease lease(kv, seqs, B, 1);

  float* stage = w + r.stage;
  float* ctx = w + r.ctx;
  kernels::LinearArgs proj_in;  // stage (B, 3E) = [q | k | v] per row = x (B, d_in) W_qkv^T + b_qkv
  proj_in.x = x, proj_in.ldx = d_in, proj_in.w_packed = qkv_packed.data();
  proj_in.bias = qkv_bias.empty() ? nullptr : qkv_bias.data();
  proj_in.y = stage, proj_in.ldy = 3 * E, proj_in.M = B, proj_in.N = 3 * E, proj_in.K = d_in;
  kernels::LinearArgs proj_out;  // out (B, E) = ctx (B, E) W_o^T + b_o
  proj_out.x = ctx, proj_out.ldx = E, proj_out.w_packed = out_packed.data();
  proj_out.bias = out_bias.empty() ? nullptr : out_bias.data();
  proj_out.y = out_data, proj_out.ldy = E, proj_out.M = B, proj_out.N = E, proj_out.K = E;
  const int64_t in_panels = kernels::linear_panels(3 * E), out_panels = kernels::linear_panels(E);

  // Split-KV plan: a work item is one sequence's key range, for every head. Sequence b's n_b = lengths[b] + 1
  // keys go in splits_b = ceil(n_b / split_len) items, split_len = max(kDecodeMinSplitKeys, (all keys) /
  // (kDecodeItemsPerThread * threads)): every thread gets several items, none much longer than its share, and
  // there are at most B + kDecodeItemsPerThread * threads items (the bound decode_plan sizes).
  int64_t total_keys = 0;
  for (int64_t b = 0; b < B; ++b) total_keys += lengths[b] + 1;
  const int64_t split_len = std::max<int64_t>(kernels::tiles::kDecodeMinSplitKeys,
                                              ceil_div(total_keys, kernels::tiles::kDecodeItemsPerThread * threads));
  int64_t* item_base = reinterpret_cast<int64_t*>(w + r.item_base);  // first item of sequence b
  item_base[0] = 0;
  for (int64_t b = 0; b < B; ++b) item_base[b + 1] = item_base[b] + ceil_div(lengths[b] + 1, split_len);
  const int64_t items = item_base[B];

  const int64_t bt = kv.block_tokens;
  float *pm = w + r.m, *pl = w + r.l, *pacc = w + r.acc;
  const kernels::DecodeKernel* kern = kset.decode;
  const kernels::LinearKernel* lin = kset.few_row_linear;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  float* scratch_base = w + r.scratch;
  // One parallel region for the whole step; each `omp for` ends in a barrier, which orders the stages.
#pragma omp parallel num_threads(threads)
  {
    // The QKV projection of the B new tokens, split by weight panels: each thread streams its share of W once.
#pragma omp for schedule(static)
    for (int64_t p = 0; p < in_panels; ++p) lin->run(proj_in, p, p + 1);
    // The new token's K and V rows go to position lengths[b] of each head's tile in its block.
#pragma omp for
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H, t = lengths[b];
      float* block = const_cast<float*>(tables[b * stride + t / bt]);
      std::memcpy(block + kv.k_offset(h) + (t % bt) * D, stage + b * 3 * E + E + h * D, D * sizeof(float));
      std::memcpy(block + kv.v_offset(h) + (t % bt) * D, stage + b * 3 * E + 2 * E + h * D, D * sizeof(float));
    }
    // (implicit barrier: every row is stored before any attention reads it)
    float* scratch = scratch_base + omp_get_thread_num() * sstride;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = std::upper_bound(item_base, item_base + B + 1, it) - item_base - 1;
      const int64_t n = lengths[b] + 1, splits = item_base[b + 1] - item_base[b], s = it - item_base[b];
      const int64_t chunk = ceil_div(n, splits);  // even chunks: no split much shorter than the others
      kernels::DecodeArgs a;
      a.q = stage + b * 3 * E, a.ldq = D;
      a.blocks = tables + b * stride, a.block_tokens = bt;
      a.H = H, a.D = D, a.scale = scale;
      const int64_t j0 = s * chunk, j1 = std::min(n, j0 + chunk);
      kern->run(a, j0, j1, scratch, pm + it * H, pl + it * H, pacc + it * H * D);
    }
#pragma omp for
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H, first = item_base[b], splits = item_base[b + 1] - first;
      kernels::merge_softmax_partials(pm + first * H + h, pl + first * H + h, H, pacc + (first * H + h) * D, H * D,
                                      splits, D, ctx + b * E + h * D);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < out_panels; ++p) lin->run(proj_out, p, p + 1);
  }
  lease.commit();
}

// --- the public calls: pick the workspace, then the Impl does the work ---

void CausalSelfAttention::extend(KvCache& cache, SequenceId seq, const float* x, int64_t T, float* out,
                                 const RunOptions& run, Workspace* ws) {
  mha_.impl_->with_workspace(ws, "extend", [&](Workspace::Impl& w) { mha_.impl_->extend(cache, seq, x, T, out, run, w); });
}

void CausalSelfAttention::decode(KvCache& cache, const SequenceId* seqs, int64_t B, const float* x, float* out,
                                 const RunOptions& run, Workspace* ws) {
  mha_.impl_->with_workspace(ws, "decode", [&](Workspace::Impl& w) { mha_.impl_->decode(cache, seqs, B, x, out, run, w); });
}

size_t CausalSelfAttention::serving_workspace_bytes(int64_t max_extend_tokens, int64_t max_decode_batch,
                                                    int threads) const {
  const MultiHeadAttention::Impl& L = *mha_.impl_;
  if (max_extend_tokens < 0 || max_extend_tokens > L.cfg.context_length || max_decode_batch < 0) {
    invalid("serving_workspace_bytes/reserve_serving: expected 0 <= max_extend_tokens <= context_length=" +
            str(L.cfg.context_length) + " and max_decode_batch >= 0, got " + str(max_extend_tokens) + " and " +
            str(max_decode_batch));
  }
  detail::check_threads(threads, "serving_workspace_bytes/reserve_serving", "threads");
  const int t = threads > 0 ? threads : L.default_threads;
  return static_cast<size_t>(detail::checked_mul(L.serving_floats(max_extend_tokens, max_decode_batch, t),
                                                 sizeof(float), "serving workspace bytes"));
}

void CausalSelfAttention::reserve_serving(int64_t max_extend_tokens, int64_t max_decode_batch, int threads,
                                          Workspace* ws) {
  const size_t floats = serving_workspace_bytes(max_extend_tokens, max_decode_batch, threads) / sizeof(float);
  const MultiHeadAttention::Impl& L = *mha_.impl_;
  const int t = threads > 0 ? threads : L.default_threads;
  mha_.impl_->with_workspace(ws, "reserve_serving", [&](Workspace::Impl& w) {
    w.reserve(floats);
    if (max_extend_tokens == 0) return;
    // extend()'s GEMMs on every thread of the team: Q of a max_extend_tokens prompt, K and V of a whole block
    // at the default block size. Other chunk and segment lengths create theirs on first use.
    const int64_t d_in = L.cfg.query_width(), D = L.cfg.head_dim();
    const int64_t bt = std::min(max_extend_tokens, KvCache::default_block_tokens(L.cfg));
    for (int slot = 0; slot < t; ++slot) {
      L.proj_q[0].prepare(w.exec, max_extend_tokens, d_in, D, 1, slot);
      L.proj_k[0].prepare(w.exec, bt, d_in, D, 1, slot);
    }
    L.out.prepare(w.exec, max_extend_tokens, L.cfg.d_model, L.cfg.d_model, t, 0);
  });
}

}  // namespace gpt2attn
