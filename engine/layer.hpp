// engine/layer.hpp: MultiHeadAttention's state (Impl), built and run by the batch forward (engine/attention.cpp),
// and what serving a KV cache adds to it (ServingState, engine/serving.cpp). Everything here is immutable after
// construction except the layer's own Workspace, guarded by `mu`.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/buffer.hpp"
#include "engine/convert.hpp"
#include "engine/dispatch.hpp"
#include "engine/few_rows.hpp"
#include "engine/linear.hpp"
#include "engine/quantized.hpp"
#include "engine/query_tiles.hpp"
#include "engine/shard.hpp"
#include "engine/util.hpp"
#include "engine/validate.hpp"
#include "engine/workspace.hpp"
#include "gpt2attn/attention.hpp"
#include "kernels/attention.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn {

// Workspace layout of forward (each region 64-byte aligned), in this order; the activations q, k, v and ctx are of
// the compute type (f32 or bf16), the packed inputs of the GEMMs' operand type (Impl::operand):
//   q (B, H, T, D) | k, v (B, H_kv, Tk, D): the projections, head-major
//   ctx (B, T, E): attention output, heads concatenated, read by the output projection
//   ctx_wide (B, T, E) of the operand type: ctx widened for GEMMs whose operand is f32 under bf16 compute, or quantized
//     for int8 GEMMs (with its row scales: detail::operand_bytes), or empty
//   packed_*: copies of inputs oneDNN cannot read in place (query | key | value), or empty: inputs whose strides it
//     cannot follow, every input of a bf16 layer (converted once, here) and of int8 GEMMs (quantized once)
//   scratch (threads, scratch_stride(kernel)): the tiled kernel's per-thread slices
struct ForwardPlan {
  detail::Region<std::byte> q, k, v, ctx, packed_q, packed_k, packed_v, ctx_wide;
  detail::Region<float> scratch;
  int64_t bytes = 0;
};

namespace detail {
// What a layer that serves a KV cache holds beyond a plain MultiHeadAttention (serving.cpp builds and reads it).
struct ServingState {
  // The row serving a KV cache of each storage dtype (indexed by DType; null where the table has none), looked up
  // once here so that extend and decode pick theirs by the cache's dtype without searching the table.
  std::array<const KernelSet*, kNumDTypes> sets{};
  // Decode's projections have M = B rows: they stream the weights, and run on our few-row kernel
  // (kernels/linear.hpp) over panel-packed copies: the fused (E + 2 H_kv D, d_in) QKV, so one pass over the B new
  // tokens reads the QKV weights once, and the (E, E) output projection. In the compute type (pack_linear_weights;
  // bf16 halves the bytes a step streams); the biases stay f32. A plain MultiHeadAttention has none of this, so it
  // holds one copy of its weights, not two.
  // With quantized weights (EngineOptions::weights) the panels hold int8 or int4 codes, and their scales beside them.
  PackedLinear qkv;                       // W_qkv (E + 2 H_kv D, d_in)
  PackedLinear out;                       // W_o (out_width, E)
  std::vector<float> qkv_bias, out_bias;  // (E + 2 H_kv D) and (out_width), or empty
  const kernels::LinearKernel* linear = nullptr;  // the few-row kernel for the layer's level and weight format
};
}  // namespace detail

struct MultiHeadAttention::Impl {
  // What this layer computes: a whole layer, or one tensor-parallel shard of a wider one (engine/shard.hpp), whose
  // cfg then holds the shard's heads and width E_r = H_r D and whose output is its partial sum.
  Config cfg;
  int64_t out_width;               // columns of the output (B, T, out_width): cfg.d_model, or a shard's full E
  int64_t first_head, total_heads;  // where cfg's heads sit in the full layer (0 and H unless a shard): dropout's
                                    // draws are indexed by the full layer's head
  Isa isa;
  DType compute;                  // f32 or bf16 (EngineOptions::compute): the projections' and the core's type
  WeightFormat weights;           // the projections' format (EngineOptions::weights, or the quantized weights given):
                                  // decode packs its panels so; prefill's GEMMs take int8 codes on VNNI, otherwise
                                  // the dequantized values in the compute type
  const detail::KernelSet& kset;  // the dispatch table's row for (isa, compute, compute): forward
  // What serving a KV cache needs beyond this: built by add_serving for a CausalSelfAttention (and a causal shard of
  // one), null in a plain MultiHeadAttention.
  std::unique_ptr<detail::ServingState> serving;
  int default_threads;

  // One (D, width) projection per head: H for Q, H_kv each for K and V, so that each GEMM writes its head's (T, D)
  // rows contiguously: Q lands head-major [B][H][T][D], K and V [B][H_kv][Tk][D] or in the KV cache's blocks,
  // exactly where attention reads them. Self-attention feeds the query to all three; cross-attention feeds query,
  // key, value.
  std::vector<detail::Linear> proj_q, proj_k, proj_v;
  // The output projection in panels of D output columns (W_o's rows), out_width / D of them: run_out takes them
  // dynamically on the team, each GEMM single-threaded, so no GEMM starts an OpenMP team of its own (engine/team.hpp
  // says why).
  std::vector<detail::Linear> out;
  // The type the projections read their inputs in (Linear::operand): the compute type, f32 holding bf16 values for a
  // bf16 layer where oneDNN has no bf16 matmul (a CPU without AVX-512), or u8 codes (quantize_rows) for int8 GEMMs. Each input is converted to it once per
  // call: once per per-head GEMM cost gpt2-xl's bf16 prefill (T=1024, 2 threads) 333 ms against f32's 204
  // (bench/peers).
  DType operand;

  Workspace own_ws;  // for calls that bring no Workspace; serialised by mu
  std::mutex mu;

  // `shard`: null for a whole layer (engine/shard.hpp builds shards).
  Impl(const Config& c, const detail::LayerWeights& w, const EngineOptions& o,
       const detail::HeadShard* shard = nullptr);
  // Validates and builds a layer (the public constructors' work): config, weights (w_o (out_width, E)), options; with
  // `serving`, a causal layer that serves a KV cache (add_serving), its K, V and query widths equal.
  static std::unique_ptr<Impl> create(const Config& c, const WeightsView& w, const EngineOptions& o,
                                      const detail::HeadShard* shard = nullptr, bool serving = false);
  // The same from quantized weights (a whole layer): EngineOptions::weights compute or their format.
  static std::unique_ptr<Impl> create(const Config& c, const QuantizedWeights& w, const EngineOptions& o,
                                      bool serving = false);
  // Builds `serving` from w, the weights this layer was built from.
  void add_serving(const detail::LayerWeights& w);
  // create()'s second half: the layer from checked weights, and its serving state.
  static std::unique_ptr<Impl> build(const Config& c, const detail::LayerWeights& w, const EngineOptions& o,
                                     const detail::HeadShard* shard, bool serving);
  int threads_for(const RunOptions& run) const { return run.threads > 0 ? run.threads : default_threads; }

  // Runs f(workspace) for a public call named `call`: with the caller's Workspace (leased, so two threads
  // sharing one are refused) or the layer's own (under mu), and with std::bad_alloc turned into Error.
  template <class F>
  void with_workspace(Workspace* ws, const char* call, F&& f) {
    detail::with_workspace(ws, own_ws, mu, call, std::forward<F>(f));
  }
  // y (M, out_width) of type dst = x (M, E) W_o^T + b_o, x of the compute type with row stride E: the panels of `out`
  // on a team of `threads`; prepare_out makes every slot's primitive for M rows ahead of the call. Where the operand
  // type is not the compute type, x is first widened into `wide` (M * E floats; unused, may be null, otherwise).
  void run_out(detail::ExecContext& ctx, const void* x, int64_t M, void* y, DType dst, int threads,
               std::byte* wide) const;
  // Whether run_out needs its `wide` buffer, and its bytes for M rows (widened f32, or u8 codes and row scales).
  bool widens() const { return operand != compute; }
  int64_t ctx_operand_bytes(int64_t M) const {
    return widens() ? detail::operand_bytes(operand, M, cfg.d_model) : 0;
  }
  // The projections' GEMMs take at most this many rows each: a longer input is cut into blocks, each block's GEMMs
  // (every head's, every output panel's) taken one after the other, so that they re-read a block still in cache
  // rather than the whole input from memory. gpt2-small's 36 per-head GEMMs at T=4096 (1 thread, Zen 3, oneDNN 2.6
  // gemm:jit) ran at 39 GFLOP/s over all rows and 66-79 over 512-row blocks; at T=1024, 81-84 either way.
  static constexpr int64_t kRowBlock = 512;
  // Prepares `lin`'s GEMMs for an input of n rows as the blocks cut it (kRowBlock rows and the remainder), on every
  // slot.
  static void prepare_rows(const detail::Linear& lin, detail::ExecContext& ctx, int64_t n, int64_t lda, int64_t ldc,
                           int threads, DType dst);
  void prepare_out(detail::ExecContext& ctx, int64_t M, int threads, DType dst) const;
  // Floats of the tiled kernel's scratch per thread (forward and extend).
  int64_t scratch_stride(const kernels::AttentionKernel& k) const;
  kernels::AttentionArgs base_args(int64_t T, int64_t Tk) const;

  // The batch forward (attention.cpp).
  void forward(const AttentionInputs& in, void* out, DType out_dtype, const RunOptions& run, Workspace::Impl& ws);
  // f32 always; bf16 from a bf16 layer (its output GEMM writes bf16); anything else is an invalid_argument error.
  void check_output_dtype(DType out_dtype) const;
  ForwardPlan forward_plan(const detail::AttnShape& s, bool pack_q, bool pack_k, bool pack_v, int threads) const;

  // Serving with a KV cache (serving.cpp), on a layer with `serving` (an internal error on one without).
  // The kernels for a cache storing K/V as `kv`; invalid_argument naming `call` when no row serves it.
  const detail::KernelSet& serving_kernels(DType kv, const char* call) const;
  void extend(KvCache& cache, SequenceId seq, const float* x, int64_t T, float* out, const RunOptions& run,
              Workspace::Impl& ws);
  void decode(KvCache& cache, const SequenceId* seqs, int64_t B, const float* x, float* out, const RunOptions& run,
              Workspace::Impl& ws);
  // A ragged step over n entries (CausalSelfAttention::step).
  void step(KvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n, const float* x, float* out,
            const RunOptions& run, Workspace::Impl& ws);
  // Workspace bytes reserve_step() takes: enough for step() of up to max_tokens tokens over max_entries entries.
  int64_t step_bytes(int64_t max_tokens, int64_t max_entries, int threads) const;
  // Floats of decode kernel scratch per thread, for entries of up to `tokens` new tokens each.
  int64_t decode_scratch_stride(const kernels::DecodeKernel& k, int64_t block_tokens, int64_t tokens = 1) const;
  // Floats of per-thread scratch the few-row projections take for `rows` rows (kernels::linear_scratch_bytes).
  int64_t linear_scratch_stride(int64_t rows) const;
  // Workspace bytes reserve_serving() takes: enough for extend() and decode() with any cache.
  int64_t serving_bytes(int64_t max_extend_tokens, int64_t max_decode_batch, int threads) const;

  // detail::run_query_tiles with this layer's scratch stride.
  template <class Setup>
  void run_query_tiles(const kernels::AttentionKernel& kern, int64_t BH, int64_t T, const kernels::AttentionArgs& base,
                       float* scratch_base, int threads, Setup&& setup) const {
    detail::run_query_tiles(kern, BH, T, base, scratch_base, scratch_stride(kern), threads, setup);
  }
};

}  // namespace gpt2attn
