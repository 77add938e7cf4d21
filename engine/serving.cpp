// engine/serving.cpp: CausalSelfAttention with a paged KV cache: what serving adds to a layer (ServingState: the
// kernels for each cache format, decode's packed weights), extend() (prefill or chunked prefill of one sequence, K/V
// projected straight into the cache's blocks) and decode() (one token for each of B sequences: one fused QKV GEMM,
// K/V rows stored into the blocks, split-KV attention, the output GEMM). Validation and the pool reservation come
// first, so a failed call leaves the cache and `out` as they were.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "engine/buffer.hpp"
#include "engine/convert.hpp"
#include "engine/dispatch.hpp"
#include "engine/few_rows.hpp"
#include "engine/kv_cache.hpp"
#include "engine/layer.hpp"
#include "engine/split_kv.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"
#include "kernels/tiles.hpp"

namespace gpt2attn {
namespace {

using detail::AttnShape;
using detail::ceil_div;
using detail::Region;
using detail::str;
using detail::StackedPart;
using detail::PanelItems;
using detail::panel_items;
using detail::few_row_args;
using detail::on_thread;
using detail::columns_overflowed;
using detail::pack_linear;
using kernels::KvPart;

int64_t max_length(const Config& layer, const KvCache& cache) {
  return std::min(layer.context_length, cache.config().context_length);
}

// Ends the pool lease when the call leaves: committed only if the call got to the end.
class AppendLease {
 public:
  AppendLease(KvCache::Impl& kv, const SequenceId* seqs, int64_t n, AppendTokens tokens)
      : kv_(kv), seqs_(seqs), n_(n), tokens_(tokens) {}
  ~AppendLease() { kv_.end_append(seqs_, n_, tokens_, committed_); }
  void commit() { committed_ = true; }

 private:
  KvCache::Impl& kv_;
  const SequenceId* seqs_;
  int64_t n_;
  AppendTokens tokens_;
  bool committed_ = false;
};

// Workspace regions of extend() (64-byte aligned); q and ctx are of the compute type t:
//   x (T, d_in): the input in the GEMMs' operand type, with u8 codes' row scales (empty for f32 compute on f32 GEMMs,
//   which read the caller's x) |
//   q (H, T, D) | kv_stage (2, H_kv, T, D) f32 K and V rows before they are stored in a cache whose format no GEMM
//   writes (empty when the GEMMs write the blocks in place: an f32 cache, or a bf16 cache under bf16 compute) |
//   ctx (T, E) | ctx_wide (T, E) of the operand type: ctx widened for GEMMs whose operand is f32 under bf16 compute,
//   or quantized for int8 GEMMs (else empty) |
//   tables (table_entries block pointers) | length (1) | scratch (threads, stride)
// table_entries: the most blocks a sequence's table holds, ceil(context / block_tokens).
struct ExtendPlan {
  Region<std::byte> x, q;
  Region<float> kv_stage;
  Region<std::byte> ctx, ctx_wide;
  Region<std::byte*> tables;
  Region<int64_t> length;
  Region<float> scratch;
  int64_t bytes = 0;
};
ExtendPlan extend_plan(const AttnShape& s, DType t, DType operand, bool stage, int threads, int64_t table_entries,
                       int64_t scratch_stride) {
  detail::WorkspacePlan p;
  ExtendPlan r;
  r.x = p.region<std::byte>({t != DType::f32 || operand != DType::f32, detail::operand_bytes(operand, s.T, s.d_in)},
                            "extend: converted input");
  r.q = p.region(t, {s.H, s.T, s.D}, "extend: q");
  r.kv_stage = p.region<float>({stage, 2, s.H_kv, s.T, s.D}, "extend: K/V staging");
  r.ctx = p.region(t, {s.T, s.E}, "extend: attention output");
  r.ctx_wide = p.region<std::byte>({operand != t, detail::operand_bytes(operand, s.T, s.E)},
                                   "extend: attention output, widened or quantized");
  r.tables = p.region<std::byte*>({table_entries}, "extend: block table");
  r.length = p.region<int64_t>({1}, "extend: length");
  r.scratch = p.region<float>({threads, scratch_stride}, "extend: kernel scratch");
  r.bytes = p.bytes();
  return r;
}

// Workspace regions of decode():
//   stage (B, E + 2 KW): the fused projection's output [q | k | v] per row, KW = H_kv D | ctx (B, E)
//   tables (B, table_entries)
//   lengths (B) | item_base (B + 1) | partials: m, l (items, H), acc (items, H, D) | scratch (threads, stride)
// Split-KV items are bounded: items <= decode_max_items(B, threads) (engine/split_kv.hpp).
struct DecodePlan {
  Region<float> stage, ctx;
  Region<std::byte*> tables;
  Region<int64_t> lengths, item_base, pending;
  Region<float> m, l, acc, scratch;
  int64_t bytes = 0, max_items = 0;
};
DecodePlan decode_plan(const AttnShape& s, int threads, int64_t table_entries, int64_t scratch_stride) {
  const int64_t B = s.B, E = s.E, H = s.H, D = s.D, KW = s.H_kv * s.D;
  DecodePlan r;
  r.max_items = detail::decode_max_items(B, threads);
  detail::WorkspacePlan p;
  r.stage = p.region<float>({B, E + 2 * KW}, "decode: qkv");
  r.ctx = p.region<float>({B, E}, "decode: attention output");
  r.tables = p.region<std::byte*>({B, table_entries}, "decode: block tables");
  r.lengths = p.region<int64_t>({B}, "decode: lengths");
  r.item_base = p.region<int64_t>({B + 1}, "decode: work items");
  r.pending = p.region<int64_t>({B}, "decode: unfinished splits");
  r.m = p.region<float>({r.max_items, H}, "decode: partial maxima");
  r.l = p.region<float>({r.max_items, H}, "decode: partial sums");
  r.acc = p.region<float>({r.max_items, H, D}, "decode: partial outputs");
  r.scratch = p.region<float>({threads, scratch_stride}, "decode: kernel scratch");
  r.bytes = p.bytes();
  return r;
}

// Decode's split-KV plan (engine/split_kv.hpp): a work item is one sequence's key range, for every head. Sequence
// b's n_b = lengths[b] + 1 keys go in decode_splits(n_b) items, its share of a target that is a multiple of the
// thread count; there are at most decode_max_items(B, threads) (the bound decode_plan sizes). Fills item_base
// (B + 1: the first item of each sequence, then the total) and pending (B: each sequence's splits not yet
// computed) and returns the number of items.
// In a ragged step, entry b brings tokens[b] new tokens (null: one each), so it holds lengths[b] + tokens[b] keys.
// With `invariant` (RunOptions::batch_invariant) each sequence's split depends on its own keys alone.
int64_t plan_splits(const int64_t* lengths, const int64_t* tokens, int64_t B, int threads, bool invariant,
                    int64_t* item_base, int64_t* pending) {
  const auto keys = [&](int64_t b) { return lengths[b] + (tokens ? tokens[b] : 1); };
  int64_t total_keys = 0;
  for (int64_t b = 0; b < B; ++b) total_keys += keys(b);
  const int64_t target = detail::decode_item_target(total_keys, threads);
  item_base[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    item_base[b + 1] = item_base[b] + (invariant ? detail::decode_invariant_splits(keys(b))
                                                 : detail::decode_splits(keys(b), total_keys, target));
  }
  for (int64_t b = 0; b < B; ++b) pending[b] = item_base[b + 1] - item_base[b];
  return item_base[B];
}

// The decode kernel's attention stage: split-KV item `it` of a decode step or of a ragged step's short entries, run by
// any thread of the team. Entry b has tokens(b) new tokens (one in decode) at rows row(b).. of stage and ctx, which
// share each of its items' pass over the keys (DecodeArgs::tokens); its items' partial states start at query-state
// row state(b) (H * tokens(b) rows an item). Everything it reads or writes lies in the workspace and the cache, set up
// before the team starts.
struct DecodeAttention {
  KvCache::Impl& kv;
  std::byte** tables;        // (B, stride): each entry's block table
  int64_t stride;
  const int64_t* lengths;    // (B): tokens cached before this step
  const int64_t* new_tokens;  // (B): new tokens of each entry, or null: one each
  const int64_t* first_row;  // (B): each entry's first row of stage and ctx, or null: row b
  const int64_t* item_base;  // (B + 1): plan_splits'
  const int64_t* state_base;  // (B): each entry's first partial-state row, or null: item_base[b] * H
  int64_t* pending;          // (B): splits of each entry not yet computed
  int64_t B, E, H, H_kv, D;
  const float* stage;        // (rows, E + 2 H_kv D): [q | k | v] of each new token
  float* ctx;                // (rows, E): the attention output
  float *m, *l, *acc;        // partial softmax states: (state rows), (state rows), (state rows, D)
  const kernels::DecodeKernel* kern;
  float scale;
  bool store_rows;           // decode: the new token's K/V rows are stored by the split that reads them

  void run(int64_t it, float* scratch) const {
    const int64_t b = std::upper_bound(item_base, item_base + B + 1, it) - item_base - 1;
    const int64_t n = keys(b), splits = item_base[b + 1] - item_base[b];
    if (store_rows && detail::decode_split_range(n, splits, it - item_base[b]).end == n) {
      store_new_rows(b);  // key n - 1, the new token, is read by this split alone
    }
    run_split(b, it, 0.0f, scratch);
    // The last of the entry's splits to finish merges them; acq_rel makes every other split's m, l and acc visible
    // to it.
    if (std::atomic_ref<int64_t>(pending[b]).fetch_sub(1, std::memory_order_acq_rel) == 1) merge(b, splits, scratch);
  }

 private:
  int64_t tokens(int64_t b) const { return new_tokens ? new_tokens[b] : 1; }
  int64_t keys(int64_t b) const { return lengths[b] + tokens(b); }
  const float* row(int64_t b) const { return stage + (first_row ? first_row[b] : b) * (E + 2 * H_kv * D); }
  float* ctx_row(int64_t b) const { return ctx + (first_row ? first_row[b] : b) * E; }
  // The first partial-state row of item it, of entry b.
  int64_t state(int64_t b, int64_t it) const {
    return (state_base ? state_base[b] : item_base[b] * H) + (it - item_base[b]) * H * tokens(b);
  }
  // Item it (of entry b) into its partial states, every exponent lowered by `shift` (DecodeArgs::shift).
  void run_split(int64_t b, int64_t it, float shift, float* scratch) const {
    const int64_t n = keys(b), splits = item_base[b + 1] - item_base[b];
    const auto [j0, j1] = detail::decode_split_range(n, splits, it - item_base[b]);
    kernels::DecodeArgs a;
    a.q = row(b), a.ldq = D;
    a.tokens = tokens(b), a.ld_token = E + 2 * H_kv * D, a.last_key = lengths[b];
    a.blocks = tables + b * stride, a.layout = kv.layout;
    a.H = H, a.D = D, a.scale = scale, a.shift = shift;
    const int64_t r = state(b, it);
    kern->run(a, j0, j1, scratch, m + r, l + r, acc + r * D);
  }
  // The new token's K and V rows, to position lengths[b] of each K/V head's tile in its block.
  void store_new_rows(int64_t b) const {
    const int64_t t = lengths[b], bt = kv.block_tokens, KW = H_kv * D;
    std::byte* block = tables[b * stride + t / bt];
    for (int64_t h = 0; h < H_kv; ++h) {
      kv.store_row(block, KvPart::key, h, t % bt, row(b) + E + h * D);
      kv.store_row(block, KvPart::value, h, t % bt, row(b) + E + KW + h * D);
    }
  }
  // Entry b's partial softmax states, of its splits items, into its tokens' ctx rows (E floats apart from `out`): token
  // i's head h = g * group + hg is the kernel's row (g * T + i) * group + hg (DecodeArgs::tokens).
  void merge_into(int64_t b, int64_t splits, float* out) const {
    const int64_t T = tokens(b), rows = H * T, group = H / H_kv, first = state(b, item_base[b]);
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = first + ((h / group) * T + i) * group + h % group;
        kernels::merge_softmax_partials(m + r, l + r, rows, acc + r * D, rows * D, splits, D, out + i * E + h * D);
      }
    }
  }
  // The merge, and where P.V overflowed (a non-finite output; kernels/attention.hpp, "Overflow"), the entry's
  // splits again with kRescueShift, whose merge replaces the non-finite values. Scratch is free by then: it serves
  // the re-run, then holds its merged rows (T x E floats; the decode kernel's scratch holds H x T padded rows of D).
  void merge(int64_t b, int64_t splits, float* scratch) const {
    float* out = ctx_row(b);
    const int64_t T = tokens(b);
    merge_into(b, splits, out);
    if (!detail::any_nonfinite<DType::f32>(out, 0, T * E, 1)) return;
    for (int64_t it = item_base[b]; it < item_base[b + 1]; ++it) run_split(b, it, kernels::kRescueShift, scratch);
    merge_into(b, splits, scratch);
    for (int64_t e = 0; e < T * E; ++e) {
      if (!std::isfinite(out[e])) out[e] = scratch[e];
    }
  }
};

// Workspace regions of step() (64-byte aligned), for M tokens of B entries; t is the compute type, and the regions
// of type t are empty for f32 compute (which reads the stage and writes ctx directly):
//   x (M, d_in) t: the input of oneDNN's bf16 GEMMs | stage (M, E + 2 KW) f32: [q | k | v] of every new token
//   q (M, E) t: the tiled entries' queries | ctx (M, E) f32 | ctx_t (M, E) t: the tiled kernel's output, oneDNN's input
//   tables (B, table_entries) | per entry: lengths, tokens and first rows of the short entries, the long entries'
//   indices, first_row (B + 1), item_base (B + 1), state_base, pending, tiled_base (B + 1)
//   short tables (B, table_entries): the short entries' rows of `tables`, in their order
//   m, l (state_rows), acc (state_rows, D): the decode kernel's partial states | scratch (threads, stride)
struct StepPlan {
  Region<std::byte> x;
  Region<float> stage;
  Region<std::byte> q;
  Region<float> ctx;
  Region<std::byte> ctx_t, ctx_wide;
  Region<std::byte*> tables, short_tables;
  Region<int64_t> lengths, short_lengths, short_tokens, short_rows, long_entries, first_row, item_base, state_base,
      pending, tiled_base;
  Region<float> m, l, acc, scratch;
  int64_t bytes = 0;
};
StepPlan step_plan(const AttnShape& s, int64_t M, int64_t B, DType t, DType operand, int threads,
                   int64_t table_entries, int64_t state_rows, int64_t scratch_stride) {
  const bool narrow = t != DType::f32;
  const int64_t KW = s.H_kv * s.D;
  detail::WorkspacePlan p;
  StepPlan r;
  r.x = p.region<std::byte>({narrow || operand != DType::f32, detail::operand_bytes(operand, M, s.d_in)},
                            "step: converted input");
  r.stage = p.region<float>({M, s.E + 2 * KW}, "step: qkv");
  r.q = p.region(t, {narrow, M, s.E}, "step: queries of the long entries");
  r.ctx = p.region<float>({M, s.E}, "step: attention output");
  r.ctx_t = p.region(t, {narrow, M, s.E}, "step: attention output, compute type");
  r.ctx_wide = p.region<std::byte>({operand != t, detail::operand_bytes(operand, M, s.E)},
                                   "step: attention output, widened or quantized");
  r.tables = p.region<std::byte*>({B, table_entries}, "step: block tables");
  r.short_tables = p.region<std::byte*>({B, table_entries}, "step: block tables of the short entries");
  r.lengths = p.region<int64_t>({B}, "step: lengths");
  r.short_lengths = p.region<int64_t>({B}, "step: lengths of the short entries");
  r.short_tokens = p.region<int64_t>({B}, "step: tokens of the short entries");
  r.short_rows = p.region<int64_t>({B}, "step: rows of the short entries");
  r.long_entries = p.region<int64_t>({B}, "step: the long entries");
  r.first_row = p.region<int64_t>({B + 1}, "step: first rows");
  r.item_base = p.region<int64_t>({B + 1}, "step: work items");
  r.state_base = p.region<int64_t>({B}, "step: partial-state rows");
  r.pending = p.region<int64_t>({B}, "step: unfinished splits");
  r.tiled_base = p.region<int64_t>({B + 1}, "step: query-tile items");
  r.m = p.region<float>({state_rows}, "step: partial maxima");
  r.l = p.region<float>({state_rows}, "step: partial sums");
  r.acc = p.region<float>({state_rows, s.D}, "step: partial outputs");
  r.scratch = p.region<float>({threads, scratch_stride}, "step: kernel scratch");
  r.bytes = p.bytes();
  return r;
}

// The partial-state rows a step's short entries can take: decode_splits gives entry b at most
// 1 + keys_b * target / total_keys items of H * tokens_b rows, so all of them at most H (M_s + max_tokens * target),
// M_s the short entries' tokens and target at most kDecodeItemsPerThread a thread; batch_invariant's
// decode_invariant_splits at most kDecodeItemsPerThread an entry: H k M_s. The bound is their sum.
int64_t step_state_rows(int64_t H, int64_t short_tokens, int64_t max_tokens, int threads) {
  const int64_t k = kernels::tiles::kDecodeItemsPerThread;  // batch_invariant: up to k items an entry
  return H * (k * short_tokens + max_tokens * k * std::max(threads, 1));
}

}  // namespace

void MultiHeadAttention::Impl::add_serving(const detail::LayerWeights& lw) {
  auto st = std::make_unique<detail::ServingState>();
  // Every K/V storage dtype the table serves in this compute type at this level (a layer serves caches of any).
  for (const detail::KernelSet& row : detail::kernel_table()) {
    if (row.compute == compute && !st->sets[static_cast<size_t>(row.kv)]) {
      st->sets[static_cast<size_t>(row.kv)] = &detail::kernels_for(isa, compute, row.kv);
    }
  }
  const int64_t E = cfg.d_model, KW = cfg.kv_width(), d_in = cfg.query_width();
  st->linear = &detail::linear_kernel(isa, weights, compute);
  const WeightsView& w = lw.views();
  const bool q = weights != WeightFormat::compute;
  const QuantizedWeights* qw = q ? &lw.quantized() : nullptr;
  const auto pack = [&](const std::vector<StackedPart>& parts, int64_t cols, const char* what) {
    detail::PackedLinear m;
    m.packed = pack_linear(parts, cols, weights, compute, &m.scales, what);
    return m;
  };
  // The fused W_qkv (E + 2 H_kv D, d_in): [q | k | v] per token.
  st->qkv = pack({{&w.w_q, q ? &qw->w_q : nullptr, E}, {&w.w_k, q ? &qw->w_k : nullptr, KW},
                  {&w.w_v, q ? &qw->w_v : nullptr, KW}},
                 d_in, "decode's packed W_qkv");
  if (cfg.qkv_bias) {
    for (const TensorView* b : {&w.b_q, &w.b_k, &w.b_v}) {
      const std::vector<float> v = detail::f32_values(*b);
      st->qkv_bias.insert(st->qkv_bias.end(), v.begin(), v.end());
    }
  }
  st->out = pack({{&w.w_o, q ? &qw->w_o : nullptr, out_width}}, E, "decode's packed W_o");
  if (cfg.out_bias) st->out_bias = detail::f32_values(w.b_o);
  serving = std::move(st);
}

int64_t MultiHeadAttention::Impl::linear_scratch_stride(int64_t rows) const {
  const int64_t K = std::max(cfg.query_width(), cfg.d_model);
  return detail::round_up(detail::ceil_div(kernels::linear_scratch_bytes(weights, rows, K), 4), 16);
}

int64_t MultiHeadAttention::Impl::decode_scratch_stride(const kernels::DecodeKernel& k, int64_t block_tokens,
                                                        int64_t tokens) const {
  return detail::round_up(static_cast<int64_t>(k.scratch_floats(cfg.num_heads * tokens, cfg.head_dim(), block_tokens)),
                          16);
}

const detail::KernelSet& MultiHeadAttention::Impl::serving_kernels(DType kv, const char* call) const {
  if (!serving) fail(ErrorCode::internal, std::string(call) + ": the layer serves no KV cache");
  const detail::KernelSet* row = serving->sets[static_cast<size_t>(kv)];
  if (!row) {
    invalid(std::string(call) + ": no kernels serve a KV cache of dtype " + to_string(kv) + " at instruction set " +
            to_string(isa));
  }
  return *row;
}

// Sized for any cache: block tables for 1-token blocks, K/V staging, kernel scratch for the largest run of keys of
// every storage dtype's kernels (decode: a run of kDecodeMaxScoreKeys, whatever the layer's context, since a cache's
// blocks may be longer than it).
int64_t MultiHeadAttention::Impl::serving_bytes(int64_t max_extend_tokens, int64_t max_decode_batch,
                                                int threads) const {
  const int64_t C = cfg.context_length;
  AttnShape s = detail::shape_of(cfg);
  int64_t bytes = 0;
  if (!serving) fail(ErrorCode::internal, "serving_bytes: the layer serves no KV cache");
  for (const detail::KernelSet* row : serving->sets) {
    if (!row) continue;
    if (max_extend_tokens) {
      s.B = 1, s.T = max_extend_tokens;
      bytes = std::max(bytes, extend_plan(s, compute, operand, true, threads, C, scratch_stride(*row->prefill)).bytes);
    }
    if (max_decode_batch) {
      s.B = max_decode_batch, s.T = 1;
      const int64_t run = kernels::tiles::kDecodeMaxScoreKeys;
      const int64_t sstride = std::max(decode_scratch_stride(*row->decode, run), linear_scratch_stride(s.B));
      bytes = std::max(bytes, decode_plan(s, threads, C, sstride).bytes);
    }
  }
  return bytes;
}

// Enough for a step of any mix: every token short (the most partial states) or every token in one long entry, and the
// decode() or extend() a step of single tokens or of one entry becomes.
int64_t MultiHeadAttention::Impl::step_bytes(int64_t max_tokens, int64_t max_entries, int threads) const {
  const AttnShape s = detail::shape_of(cfg);
  const int64_t C = cfg.context_length, H = cfg.num_heads;
  const int64_t short_max = std::min(max_tokens, kernels::tiles::kStepDecodeTokens);
  int64_t bytes = serving_bytes(std::min(max_tokens, C), max_entries, threads);
  for (const detail::KernelSet* row : serving->sets) {
    if (!row) continue;
    const int64_t run = kernels::tiles::kDecodeMaxScoreKeys;
    const int64_t sstride =
        std::max({scratch_stride(*row->prefill), decode_scratch_stride(*row->decode, run, short_max),
                  // batch_invariant: the few-row kernel at any size, in blocks of rows
                  linear_scratch_stride(std::min(max_tokens, kernels::tiles::kFewRowBlock))});
    bytes = std::max(bytes, step_plan(s, max_tokens, max_entries, compute, operand, threads, C,
                                      step_state_rows(H, max_tokens, short_max, threads), sstride).bytes);
  }
  return bytes;
}

void MultiHeadAttention::Impl::extend(KvCache& cache, SequenceId seq, const float* x, int64_t T, float* out_data,
                                      const RunOptions& run, Workspace::Impl& ws) {
  const int threads = threads_for(run);
  AttnShape s = detail::validate_extend(cfg, cache, x, T, out_data, run, threads);
  const int64_t d_in = s.d_in, H = s.H, D = s.D;
  KvCache::Impl& kv = cache.impl();
  const kernels::KvLayout& layout = kv.layout;
  const detail::KernelSet& ks = serving_kernels(layout.dtype, "extend");
  // The GEMMs can write the cache's rows themselves: an f32 cache, or one of the compute type.
  const bool in_place = layout.dtype == DType::f32 || layout.dtype == compute;

  const ExtendPlan r = extend_plan(s, compute, operand, !in_place, threads,
                                   ceil_div(max_length(cfg, cache), kv.block_tokens),
                                   scratch_stride(*ks.prefill));
  std::byte* w = ws.reserve(static_cast<size_t>(r.bytes));
  std::byte** tables = r.tables.in(w);
  int64_t& P = *r.length.in(w);  // tokens cached before this call
  kv.begin_append(&seq, 1, T, max_length(cfg, cache), tables, 0, &P);
  AppendLease lease(kv, &seq, 1, T);
  s.Tk = P + T;

  // Projections: Q per head into (H, T, D); K and V per K/V head and per block the new tokens touch. For an f32
  // cache each GEMM writes its rows straight into the block at the layout's address (no K/V copy after the GEMM);
  // for another format it writes them to kv_stage (2, H_kv, T, D), and the cache's writer converts them in.
  const int64_t bt = kv.block_tokens, first_block = P / bt, H_kv = s.H_kv;
  const int64_t segments = ceil_div(P + T, bt) - first_block;
  const DType t = compute;
  const size_t tsize = size_of(t);
  // The input in the GEMMs' operand type: the caller's rows, or (bf16) converted once into r.x.
  const detail::Rows xin = detail::as_rows(TensorView::f32(x, {1, T, d_in}), t, operand, r.x.in(w), threads);
  std::byte* q = r.q.in(w);
  float* stage = r.kv_stage.in(w);
  // Each thread's primitives are keyed by its slot (ExecContext): reserve_serving prepares a block's and a prompt's
  // GEMMs on every slot, since any thread may take any item.
  detail::team_for(threads, H + 2 * H_kv * segments, [&](int64_t item, int thread) {
    if (item < H) {
      proj_q[item].run(ws.exec, xin.data, T, xin.ld, q + item * T * D * tsize, D, 1, thread, t, xin.scales);
      if (run.check_finite) {
        detail::check_projection(q + item * T * D * tsize, t, T, D, D, "extend: the query", item * D);
      }
      return;
    }
    item -= H;
    const KvPart part = item >= H_kv * segments ? KvPart::value : KvPart::key;
    const int64_t h = (item % (H_kv * segments)) / segments, blk = first_block + item % segments;
    const int64_t t0 = std::max(P, blk * bt) - P, t1 = std::min(P + T, (blk + 1) * bt) - P;  // new-token rows
    float* staged = stage + ((part == KvPart::value ? H_kv : 0) + h) * T * D + t0 * D;
    void* dst = in_place ? static_cast<void*>(layout.row<std::byte>(tables[blk], part, h, (P + t0) % bt)) : staged;
    (part == KvPart::value ? proj_v : proj_k)[h].run(ws.exec, xin.row(t0), t1 - t0, xin.ld, dst, D, 1, thread,
                                                      in_place ? layout.dtype : DType::f32, xin.scale(t0));
    if (run.check_finite) {  // before the rows reach the cache's format; a refused call commits none of them
      detail::check_projection(dst, in_place ? layout.dtype : DType::f32, t1 - t0, D, D,
                               part == KvPart::value ? "extend: the value" : "extend: the key", h * D);
    }
    if (!in_place) {
      for (int64_t i = t0; i < t1; ++i) kv.store_row(tables[blk], part, h, (P + i) % bt, staged + (i - t0) * D);
    }
  });

  // Attention of the T new queries over all P + T cached keys (bottom-right causal), read from the blocks.
  kernels::AttentionArgs base = base_args(T, s.Tk);
  base.kv.blocks = tables;
  base.kv.layout = layout;
  std::byte* ctx = r.ctx.in(w);
  run_query_tiles(*ks.prefill, H, T, base, r.scratch.in(w), threads, [&](kernels::AttentionArgs& a, int64_t h) {
    a.q = q + h * T * D * tsize;
    a.out = ctx + h * D * tsize;
    a.kv.head = s.kv_head(h);
  });
  run_out(ws.exec, ctx, T, out_data, DType::f32, threads, r.ctx_wide.in(w));
  if (run.check_finite) {
    detail::check_projection(out_data, DType::f32, T, out_width, out_width, "extend: the output", 0, threads);
  }
  lease.commit();
}

void MultiHeadAttention::Impl::decode(KvCache& cache, const SequenceId* seqs, int64_t B, const float* x,
                                      float* out_data, const RunOptions& run, Workspace::Impl& ws) {
  const int threads = threads_for(run);
  const AttnShape s = detail::validate_decode(cfg, cache, seqs, B, x, out_data, run, threads);
  const int64_t d_in = s.d_in, E = s.E, H = s.H, H_kv = s.H_kv, D = s.D;
  KvCache::Impl& kv = cache.impl();

  // Plan: the workspace's regions, the sequences' blocks reserved for one more token each, the split-KV items.
  const detail::KernelSet& ks = serving_kernels(kv.layout.dtype, "decode");
  const int64_t limit = max_length(cfg, cache), stride = ceil_div(limit, kv.block_tokens);  // table entries
  const int64_t sstride = std::max(decode_scratch_stride(*ks.decode, kv.block_tokens), linear_scratch_stride(B));
  const DecodePlan r = decode_plan(s, threads, stride, sstride);
  std::byte* w = ws.reserve(static_cast<size_t>(r.bytes));
  std::byte** tables = r.tables.in(w);
  int64_t* lengths = r.lengths.in(w);  // tokens cached before this step
  kv.begin_append(seqs, B, 1, limit, tables, stride, lengths);
  AppendLease lease(kv, seqs, B, 1);
  int64_t* item_base = r.item_base.in(w);
  int64_t* pending = r.pending.in(w);
  const int64_t items = plan_splits(lengths, nullptr, B, threads, run.batch_invariant, item_base, pending);

  float* stage = r.stage.in(w);
  float* ctx = r.ctx.in(w);
  const int64_t KW = H_kv * D, ldstage = E + 2 * KW;
  const detail::ServingState& sv = *serving;
  // stage (B, E + 2 KW) = [q | k | v] per row = x (B, d_in) W_qkv^T + b_qkv; out (B, out_width) = ctx W_o^T + b_o.
  const kernels::LinearArgs qkv =
      few_row_args(x, d_in, sv.qkv, sv.qkv_bias, stage, ldstage, B, ldstage, d_in);
  const kernels::LinearArgs proj =
      few_row_args(ctx, E, sv.out, sv.out_bias, out_data, out_width, B, out_width, E);
  const kernels::LinearKernel* lin = sv.linear;
  const PanelItems qkv_items = panel_items(*lin, ldstage, threads), out_items = panel_items(*lin, out_width, threads);
  const DecodeAttention attention{.kv = kv, .tables = tables, .stride = stride, .lengths = lengths,
                                  .new_tokens = nullptr, .first_row = nullptr, .item_base = item_base,
                                  .state_base = nullptr, .pending = pending, .B = B, .E = E, .H = H, .H_kv = H_kv,
                                  .D = D, .stage = stage, .ctx = ctx, .m = r.m.in(w), .l = r.l.in(w),
                                  .acc = r.acc.in(w), .kern = ks.decode,
                                  .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))),
                                  .store_rows = true};
  float* scratch_base = r.scratch.in(w);
  // With check_finite, each QKV item scans the columns it wrote, and an overflow there skips the other stages: the
  // cache is not written, and the error is named after the region by scans that find the projection, row and column.
  const bool check = run.check_finite;
  bool qkv_overflow = false;
  // One region for the whole step, three stages, each ending before the next begins: the QKV projection, attention
  // (which also stores the new K/V rows and merges the splits), the output projection. Every stage's end costs a
  // descheduled thread's time on a busy machine, so none is spent on work that can ride on a stage: the new token's
  // K/V rows are stored by the one split that reads them (the sequence's last), and a sequence's partial softmax
  // states are merged by whichever of its splits ends last.
  detail::team_stages(threads, {qkv_items.count(), items, out_items.count()}, [&](int phase, int64_t it, int thread) {
    if (phase == 0) {
      // The QKV projection of the B new tokens, split by weight panels: each item streams its share of W once.
      lin->run(on_thread(qkv, scratch_base + thread * sstride), qkv_items.begin(it), qkv_items.end(it));
      if (check && columns_overflowed(stage, ldstage, B, ldstage, qkv_items, it)) {
        std::atomic_ref<bool>(qkv_overflow).store(true, std::memory_order_relaxed);
      }
      return;
    }
    // Read after the QKV stage has ended: the later stages' items all see the same value.
    if (std::atomic_ref<bool>(qkv_overflow).load(std::memory_order_relaxed)) return;
    if (phase == 1) return attention.run(it, scratch_base + thread * sstride);
    lin->run(on_thread(proj, scratch_base + thread * sstride), out_items.begin(it), out_items.end(it));
  });
  if (qkv_overflow) {  // the items found it; these scans name the projection, row and column
    detail::check_projection(stage, DType::f32, B, E, ldstage, "decode: the query");
    detail::check_projection(stage + E, DType::f32, B, KW, ldstage, "decode: the key");
    detail::check_projection(stage + E + KW, DType::f32, B, KW, ldstage, "decode: the value");
  }
  if (check) detail::check_projection(out_data, DType::f32, B, out_width, out_width, "decode: the output");
  lease.commit();
}

// A ragged step: the projections over all M tokens, K/V into the blocks, attention by work (short entries on the decode
// kernel by key ranges, long ones on the tiled kernel by query tiles), the output projection over all M tokens.
void MultiHeadAttention::Impl::step(KvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t B,
                                    const float* x, float* out_data, const RunOptions& run, Workspace::Impl& ws) {
  const int threads = threads_for(run);
  const AttnShape s = detail::validate_step(cfg, cache, seqs, tokens, B, x, out_data, run, threads);
  // The two shapes the other calls serve: the same algorithm, with no ragged bookkeeping (but a batch-invariant
  // one-entry step stays here: extend()'s GEMMs and tiled kernel would sum its tokens otherwise than a batch does).
  if (std::all_of(tokens, tokens + B, [](int64_t n) { return n == 1; })) return decode(cache, seqs, B, x, out_data, run, ws);
  if (B == 1 && !run.batch_invariant) return extend(cache, seqs[0], x, tokens[0], out_data, run, ws);

  const int64_t M = s.T, d_in = s.d_in, E = s.E, H = s.H, H_kv = s.H_kv, D = s.D, KW = H_kv * D, ldstage = E + 2 * KW;
  KvCache::Impl& kv = cache.impl();
  const kernels::KvLayout& layout = kv.layout;
  const detail::KernelSet& ks = serving_kernels(layout.dtype, "step");
  const int64_t limit = max_length(cfg, cache), stride = ceil_div(limit, kv.block_tokens), bt = kv.block_tokens;
  const auto is_short = [](int64_t n) { return n <= kernels::tiles::kStepDecodeTokens; };
  int64_t short_tokens = 0, short_max = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (is_short(tokens[b])) short_tokens += tokens[b], short_max = std::max(short_max, tokens[b]);
  }
  const bool few_rows = M <= kernels::tiles::kStepFewRowTokens || run.batch_invariant;
  const int64_t sstride = std::max({scratch_stride(*ks.prefill),
                                    short_max ? decode_scratch_stride(*ks.decode, bt, short_max) : int64_t{0},
                                    few_rows ? linear_scratch_stride(std::min(M, kernels::tiles::kFewRowBlock))
                                             : int64_t{0}});
  const StepPlan r =
      step_plan(s, M, B, compute, operand, threads, stride, step_state_rows(H, short_tokens, short_max, threads),
                sstride);
  std::byte* w = ws.reserve(static_cast<size_t>(r.bytes));
  std::byte** tables = r.tables.in(w);
  int64_t* lengths = r.lengths.in(w);  // tokens cached before this step
  kv.begin_append(seqs, B, AppendTokens(tokens), limit, tables, stride, lengths);
  AppendLease lease(kv, seqs, B, AppendTokens(tokens));

  // Where each entry's tokens sit, and the entries each kernel takes: the short ones (compacted for the split plan),
  // the long ones with their query-tile items, slice by slice (entry, head) as run_query_tiles orders them.
  const kernels::AttentionKernel& tiled = *ks.prefill;
  int64_t* first_row = r.first_row.in(w);
  int64_t *sl = r.short_lengths.in(w), *sn = r.short_tokens.in(w), *srow = r.short_rows.in(w);
  std::byte** stables = r.short_tables.in(w);
  int64_t *long_entries = r.long_entries.in(w), *tiled_base = r.tiled_base.in(w);
  int64_t B_s = 0, B_l = 0;
  first_row[0] = 0;
  tiled_base[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    first_row[b + 1] = first_row[b] + tokens[b];
    if (is_short(tokens[b])) {
      sl[B_s] = lengths[b], sn[B_s] = tokens[b], srow[B_s] = first_row[b];
      std::copy(tables + b * stride, tables + (b + 1) * stride, stables + B_s * stride);
      ++B_s;
    } else {
      const kernels::QueryItems qi(tiled, tokens[b], lengths[b] + tokens[b], D);
      long_entries[B_l] = b;
      tiled_base[B_l + 1] = tiled_base[B_l] + H * qi.per_slice;
      ++B_l;
    }
  }
  int64_t* item_base = r.item_base.in(w);
  int64_t* state_base = r.state_base.in(w);
  int64_t* pending = r.pending.in(w);
  const int64_t short_items = B_s ? plan_splits(sl, sn, B_s, threads, run.batch_invariant, item_base, pending) : 0;
  for (int64_t b = 0, row = 0; b < B_s; ++b) {
    state_base[b] = row;
    row += (item_base[b + 1] - item_base[b]) * H * sn[b];
  }

  const DType t = compute;
  const size_t tsize = size_of(t);
  float* stage = r.stage.in(w);
  float* ctx = r.ctx.in(w);
  std::byte* ctx_t = t == DType::f32 ? reinterpret_cast<std::byte*>(ctx) : r.ctx_t.in(w);
  std::byte* q_t = r.q.in(w);
  const detail::ServingState& sv = *serving;
  const kernels::LinearKernel* lin = sv.linear;
  // A step of a few tokens (or any batch-invariant step) streams the weights through the few-row kernel; a longer one
  // runs oneDNN's GEMMs, one per head (as extend), each writing its columns of the stage.
  float* scratch_base = r.scratch.in(w);
  // The few-row kernel over blocks of rows (a batch-invariant step may be long): an item is (block, panel run).
  const int64_t row_block = std::min(M, kernels::tiles::kFewRowBlock), row_blocks = ceil_div(M, row_block);
  const auto few_row_items = [&](const float* in, int64_t ldin, const detail::PackedLinear& w,
                                 const std::vector<float>& bias, float* y, int64_t ldy, int64_t N, int64_t K) {
    const PanelItems items = panel_items(*lin, N, threads);
    detail::team_for(threads, row_blocks * items.count(), [&](int64_t item, int thread) {
      const int64_t r0 = item / items.count() * row_block, it = item % items.count();
      const kernels::LinearArgs a =
          few_row_args(in + r0 * ldin, ldin, w, bias, y + r0 * ldy, ldy, std::min(row_block, M - r0), N, K);
      lin->run(on_thread(a, scratch_base + thread * sstride), items.begin(it), items.end(it));
    });
  };
  if (few_rows) {
    few_row_items(x, d_in, sv.qkv, sv.qkv_bias, stage, ldstage, ldstage, d_in);
  } else {
    const detail::Rows xin = detail::as_rows(TensorView::f32(x, {1, M, d_in}), t, operand, r.x.in(w), threads);
    // Item i is Q head i, then K heads, then V heads: its columns start at i * D in [q | k | v].
    detail::team_for(threads, H + 2 * H_kv, [&](int64_t item, int thread) {
      const detail::Linear& L = item < H ? proj_q[item] : item < H + H_kv ? proj_k[item - H] : proj_v[item - H - H_kv];
      L.run(ws.exec, xin.data, M, xin.ld, stage + item * D, ldstage, 1, thread, DType::f32, xin.scales);
    });
  }
  if (run.check_finite) {  // before anything reaches the cache: a refused step commits none of it
    detail::check_projection(stage, DType::f32, M, E, ldstage, "step: the query");
    detail::check_projection(stage + E, DType::f32, M, KW, ldstage, "step: the key");
    detail::check_projection(stage + E + KW, DType::f32, M, KW, ldstage, "step: the value");
  }

  // Every new token's K and V rows into its block.
  const auto entry_of = [&](int64_t row) { return std::upper_bound(first_row, first_row + B + 1, row) - first_row - 1; };
  constexpr int64_t kRowsPerItem = 32;
  detail::team_for(threads, ceil_div(M, kRowsPerItem), [&](int64_t c, int) {
    for (int64_t row = c * kRowsPerItem; row < std::min(M, (c + 1) * kRowsPerItem); ++row) {
      const int64_t b = entry_of(row), pos = lengths[b] + row - first_row[b];
      std::byte* block = tables[b * stride + pos / bt];
      const float* src = stage + row * ldstage;
      for (int64_t h = 0; h < H_kv; ++h) {
        kv.store_row(block, KvPart::key, h, pos % bt, src + E + h * D);
        kv.store_row(block, KvPart::value, h, pos % bt, src + E + KW + h * D);
      }
    }
  });
  // A long entry's queries in the compute type, for the tiled kernel (an f32 layer's read the stage in place).
  if (t != DType::f32) {
    for (int64_t k = 0; k < B_l; ++k) {
      const int64_t b = long_entries[k], row = first_row[b];
      detail::convert(TensorView::f32(stage + row * ldstage, {tokens[b], E}).with_strides({ldstage, 1}), t,
                      q_t + row * E * tsize, threads);
    }
  }

  // Attention: the long entries' query tiles first (the longest items), then the short entries' key ranges.
  const DecodeAttention short_attention{
      .kv = kv, .tables = stables, .stride = stride, .lengths = sl, .new_tokens = sn, .first_row = srow,
      .item_base = item_base, .state_base = state_base, .pending = pending, .B = B_s, .E = E, .H = H, .H_kv = H_kv,
      .D = D, .stage = stage, .ctx = ctx, .m = r.m.in(w), .l = r.l.in(w), .acc = r.acc.in(w), .kern = ks.decode,
      .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))), .store_rows = false};
  const int64_t tiled_items = tiled_base[B_l];
  detail::team_for(threads, tiled_items + short_items, [&](int64_t it, int thread) {
    float* scratch = scratch_base + thread * sstride;
    if (it >= tiled_items) return short_attention.run(it - tiled_items, scratch);
    const int64_t k = std::upper_bound(tiled_base, tiled_base + B_l + 1, it) - tiled_base - 1;
    const int64_t b = long_entries[k], n = tokens[b], Tk = lengths[b] + n, row = first_row[b];
    const kernels::QueryItems qi(tiled, n, Tk, D);
    const int64_t h = (it - tiled_base[k]) / qi.per_slice, i = (it - tiled_base[k]) % qi.per_slice;
    kernels::AttentionArgs a = base_args(n, Tk);
    a.kv.blocks = tables + b * stride;
    a.kv.layout = layout;
    a.kv.head = s.kv_head(h);
    if (t == DType::f32) {
      a.q = stage + row * ldstage + h * D, a.ldq = ldstage;
    } else {
      a.q = q_t + (row * E + h * D) * tsize, a.ldq = E;
    }
    a.out = ctx_t + (row * E + h * D) * tsize;
    tiled.run(a, qi.row_begin(i), qi.row_end(i), scratch);
  });

  // The output projection reads one type: f32 on the few-row kernel, the compute type on oneDNN. Under bf16 compute the
  // rows the other kernel wrote are converted (the tiled kernel writes bf16, the decode kernel's merge f32).
  if (t != DType::f32) {
    for (int64_t b = 0; b < B; ++b) {
      if (is_short(tokens[b]) == few_rows) continue;  // already in the type the projection reads
      const int64_t e0 = first_row[b] * E;
      if (few_rows) {
        detail::convert(TensorView::contiguous(ctx_t + e0 * tsize, t, {tokens[b], E}), DType::f32, ctx + e0);
      } else {
        detail::convert(TensorView::f32(ctx + e0, {tokens[b], E}), t, ctx_t + e0 * tsize);
      }
    }
  }
  if (few_rows) {
    few_row_items(ctx, E, sv.out, sv.out_bias, out_data, out_width, out_width, E);
  } else {
    run_out(ws.exec, ctx_t, M, out_data, DType::f32, threads, r.ctx_wide.in(w));
  }
  if (run.check_finite) {
    detail::check_projection(out_data, DType::f32, M, out_width, out_width, "step: the output", 0, threads);
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

void CausalSelfAttention::step(KvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n,
                               const float* x, float* out, const RunOptions& run, Workspace* ws) {
  mha_.impl_->with_workspace(ws, "step", [&](Workspace::Impl& w) { mha_.impl_->step(cache, seqs, tokens, n, x, out, run, w); });
}

size_t CausalSelfAttention::step_workspace_bytes(int64_t max_tokens, int64_t max_entries, int threads) const {
  const MultiHeadAttention::Impl& L = *mha_.impl_;
  if (max_tokens < 1 || max_entries < 1 || max_entries > max_tokens) {
    invalid("step_workspace_bytes/reserve_step: expected 1 <= max_entries <= max_tokens, got max_tokens=" +
            str(max_tokens) + " and max_entries=" + str(max_entries));
  }
  detail::check_threads(threads, "step_workspace_bytes/reserve_step", "threads");
  const int t = threads > 0 ? threads : L.default_threads;
  // The same bound on a step's size as on its outputs: (max_tokens, E) floats the machine could hold.
  detail::check_fits_in_memory(detail::checked_product({max_tokens, L.out_width, int64_t{4}}, "a step's output"),
                               "a step's output (max_tokens, E)");
  return detail::buffer_capacity(static_cast<size_t>(L.step_bytes(max_tokens, max_entries, t)));
}

void CausalSelfAttention::reserve_step(int64_t max_tokens, int64_t max_entries, int threads, Workspace* ws) {
  const size_t bytes = step_workspace_bytes(max_tokens, max_entries, threads);
  const MultiHeadAttention::Impl& L = *mha_.impl_;
  const int t = threads > 0 ? threads : L.default_threads;
  // What a step of single tokens (decode) and of one entry (extend) prepare, then the ragged step's GEMMs of
  // max_tokens rows: the per-head projections on every thread of the team (writing the stage's f32 columns) and the
  // output projection, when a step that long runs on oneDNN.
  reserve_serving(std::min(max_tokens, L.cfg.context_length), max_entries, threads, ws);
  mha_.impl_->with_workspace(ws, "reserve_step", [&](Workspace::Impl& w) {
    w.reserve(bytes);
    if (max_tokens <= kernels::tiles::kStepFewRowTokens) return;
    const int64_t d_in = L.cfg.query_width(), ldstage = L.cfg.d_model + 2 * L.cfg.kv_width();
    for (int slot = 0; slot < t; ++slot) L.proj_q[0].prepare(w.exec, max_tokens, d_in, ldstage, 1, slot, DType::f32);
    L.prepare_out(w.exec, max_tokens, t, DType::f32);
  });
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
  // As the workspace allocates it (to 64 B, or to 2 MiB pages from 2 MiB on): what reserve_serving makes it hold.
  return detail::buffer_capacity(static_cast<size_t>(L.serving_bytes(max_extend_tokens, max_decode_batch, t)));
}

void CausalSelfAttention::reserve_serving(int64_t max_extend_tokens, int64_t max_decode_batch, int threads,
                                          Workspace* ws) {
  const size_t bytes = serving_workspace_bytes(max_extend_tokens, max_decode_batch, threads);
  const MultiHeadAttention::Impl& L = *mha_.impl_;
  const int t = threads > 0 ? threads : L.default_threads;
  mha_.impl_->with_workspace(ws, "reserve_serving", [&](Workspace::Impl& w) {
    w.reserve(bytes);
    if (max_extend_tokens == 0) return;
    // extend()'s GEMMs on every thread of the team: Q of a max_extend_tokens prompt, K and V of a whole block
    // at the default block size, written as each cache format takes them (f32 rows, and under bf16 compute also
    // bf16 rows). Other chunk and segment lengths create theirs on first use.
    const int64_t d_in = L.cfg.query_width(), D = L.cfg.head_dim();
    const int64_t bt = std::min(max_extend_tokens, KvCache::default_block_tokens(L.cfg));
    for (int slot = 0; slot < t; ++slot) {
      L.proj_q[0].prepare(w.exec, max_extend_tokens, d_in, D, 1, slot, L.compute);
      L.proj_k[0].prepare(w.exec, bt, d_in, D, 1, slot, DType::f32);
      if (L.compute != DType::f32) L.proj_k[0].prepare(w.exec, bt, d_in, D, 1, slot, L.compute);
    }
    L.prepare_out(w.exec, max_extend_tokens, t, DType::f32);
  });
}

}  // namespace gpt2attn
