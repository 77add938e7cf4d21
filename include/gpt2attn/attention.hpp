// gpt2attn/attention.hpp: the multi-head attention layer (torch.nn.MultiheadAttention semantics, batch_first)
// and the GPT-2 causal self-attention built on it. Construction does all set-up; forward() only computes. What a
// call is given (inputs, run options, workspaces, engine options) is gpt2attn/options.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gpt2attn/config.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/options.hpp"
#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {

// Semantics (all paths, the naive reference included):
//   Q = query W_q^T + b_q, K = key W_k^T + b_k, V = value W_v^T + b_v, split into H heads of D
//   s[b,h,i,j] = Q_i . K_j / sqrt(D)  (+ additive mask), masked entries = -inf
//   masked: keep-mask == 0, block-mask != 0, key_padding != 0, causal j > i + (Tk - T)
//   p = softmax_j(s); a row with every entry masked gives p = 0 (never NaN)
//   out = concat_h(p V) W_o^T + b_o, shape (B, T, E)
class GPT2ATTN_API MultiHeadAttention {
 public:
  // Validates config and weights (throws Error naming the problem), repacks weights for oneDNN,
  // registers the causal mask for config.context_length (a rule on indices, tril(ones(C, C)) evaluated where a
  // tile crosses the diagonal; no C x C buffer), and picks the kernel ISA once.
  MultiHeadAttention(const Config& config, const Weights& weights, const EngineOptions& options = {});
  // The same from views of weights in f32, bf16 or f16 (gpt2attn/weights.hpp), e.g. a safetensors file's bytes.
  MultiHeadAttention(const Config& config, const WeightsView& weights, const EngineOptions& options = {});
  // The same from weights quantized already (QuantizedWeights::quantize, load_quantized): bit for bit the layer that
  // quantizing their source here would build. options.weights: compute (take theirs) or their format.
  MultiHeadAttention(const Config& config, const QuantizedWeights& weights, const EngineOptions& options = {});
  ~MultiHeadAttention();
  MultiHeadAttention(MultiHeadAttention&&) noexcept;
  MultiHeadAttention& operator=(MultiHeadAttention&&) noexcept;

  // out: (B, T, E) contiguous f32, owned by the caller. Input is validated before anything is written;
  // on error `out` is untouched. With ws == null calls on one object are serialised (see Workspace).
  void forward(const AttentionInputs& in, float* out, const RunOptions& run = {}, Workspace* ws = nullptr);
  // The same with out (B, T, E) contiguous of out_dtype: f32, or bf16 from a bf16 layer (EngineOptions::compute),
  // written by the output GEMM itself, so a server holding bf16 activations converts nothing. query, key and
  // value may be bf16 views for either compute type (a bf16 layer reads a contiguous one in place).
  void forward(const AttentionInputs& in, void* out, DType out_dtype, const RunOptions& run = {},
               Workspace* ws = nullptr);

  // Reserves the layer's own workspace (or `ws`) for (B, T, Tk) and creates the GEMM primitives of that
  // shape at the default thread count, kept for good (see Workspace), so that later such calls allocate nothing
  // of their own (oneDNN 2.6 still builds a small argument map per GEMM execution; see reserve_serving).
  void reserve(int64_t B, int64_t T, int64_t Tk, Workspace* ws = nullptr);
  size_t workspace_bytes(int64_t B, int64_t T, int64_t Tk) const;

  const Config& config() const;
  // The instruction set its kernels run at, chosen at construction: the strongest level at or below
  // EngineOptions::isa that has kernels for the compute type (an f32 layer on an AVX512-BF16 CPU runs avx512).
  Isa isa() const;
  std::string implementation() const;  // e.g. "tiled-online-softmax/avx512 + onednn-matmul"
  int default_threads() const;

  struct GPT2ATTN_LOCAL Impl;  // engine-internal (engine/layer.hpp)

 private:
  friend class CausalSelfAttention;
  explicit MultiHeadAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// GPT-2's attention block: fused QKV, causal mask registered for context_length, self-attention only.
// A sequence longer than context_length is refused with an error.
//
// Serving with a KV cache (kv_cache.hpp): extend() runs a prompt or a chunk of one, decode() one new token
// for each of B sequences. Inference only: RunOptions::training must be false. Every check (ids, lengths
// against context_length, finiteness, pool capacity) happens before anything is written: on error the
// cache and `out` are as they were.
class GPT2ATTN_API CausalSelfAttention {
 public:
  CausalSelfAttention(Config config, const Weights& weights, const EngineOptions& options = {});
  CausalSelfAttention(Config config, const WeightsView& weights, const EngineOptions& options = {});
  CausalSelfAttention(Config config, const QuantizedWeights& weights, const EngineOptions& options = {});
  // x: (B, T, d_in) contiguous f32, out: (B, T, E) contiguous f32.
  void forward(const float* x, int64_t B, int64_t T, float* out, const RunOptions& run = {}, Workspace* ws = nullptr);

  // Prefill (empty sequence) or chunked prefill (a continuation): appends T new tokens to `seq` and computes
  // their outputs. x: (T, d_in) contiguous f32, out: (T, E). The new tokens attend to every cached token and
  // causally to each other (bottom-right alignment). K and V are projected straight into the cache's blocks.
  void extend(KvCache& cache, SequenceId seq, const float* x, int64_t T, float* out, const RunOptions& run = {},
              Workspace* ws = nullptr);

  // One decode step: x (B, d_in) holds one new token for each of seqs[0..B) (distinct sequences of any
  // cached lengths); out (B, E). The projections run as one GEMM over the B tokens; attention runs per
  // sequence over its blocks, a sequence's keys split across threads when it holds more than a thread's share or the context
  // long (partial softmax states merged exactly).
  void decode(KvCache& cache, const SequenceId* seqs, int64_t B, const float* x, float* out,
              const RunOptions& run = {}, Workspace* ws = nullptr);

  // One step of continuous batching: n entries, entry i appending tokens[i] >= 1 new tokens to sequence seqs[i]
  // (distinct sequences, any cached lengths): a chunk of a prompt, one next token, or k draft tokens to verify, in any
  // mix. x: (sum tokens, d_in) contiguous f32, the entries' tokens packed in entry order; out: (sum tokens, E). Each
  // new token attends to its sequence's cached tokens and causally to its own entry's earlier new tokens, exactly as
  // extend() of that entry alone would compute it. The projections run once over all the step's tokens, so the
  // weights stream once a step; K and V go into each sequence's blocks; attention is scheduled across threads by work:
  // an entry of a few tokens (a decode token or a draft) by ranges of its keys, read once for all its tokens and
  // merged exactly; a longer chunk by query tiles. A step of single tokens is decode(); a step of one entry is
  // extend(). Checks, the pool and errors as extend() and decode(): on error every sequence and `out` are as they
  // were.
  void step(KvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n, const float* x, float* out,
            const RunOptions& run = {}, Workspace* ws = nullptr);
  // Grows `ws` (the layer's own when null) for step() of up to max_tokens tokens over up to max_entries entries at
  // `threads` (0 = default), and creates its GEMM primitives for max_tokens tokens: afterwards such a step allocates
  // nothing of its own (oneDNN's per-execution argument map aside, see reserve_serving; a step of up to 64 tokens
  // runs its projections on the library's own kernel, no oneDNN). step_workspace_bytes() is what that takes.
  void reserve_step(int64_t max_tokens, int64_t max_entries, int threads = 0, Workspace* ws = nullptr);
  size_t step_workspace_bytes(int64_t max_tokens, int64_t max_entries, int threads = 0) const;

  // Grows `ws` (the layer's own when null) for extend() of up to max_extend_tokens and decode() of up to
  // max_decode_batch sequences at `threads` (0 = default); serving_workspace_bytes() is what that takes (the
  // bytes() of a workspace that held less before).
  // Afterwards decode() allocates nothing at all (its projections run on our own kernels). extend() and
  // forward() allocate nothing of their own for a chunk shape reserved or recently seen (see Workspace), but
  // their oneDNN GEMMs do: oneDNN 2.6 builds a small argument map on every primitive execution.
  void reserve_serving(int64_t max_extend_tokens, int64_t max_decode_batch, int threads = 0, Workspace* ws = nullptr);
  size_t serving_workspace_bytes(int64_t max_extend_tokens, int64_t max_decode_batch, int threads = 0) const;

  MultiHeadAttention& layer() { return mha_; }
  const Config& config() const { return mha_.config(); }

 private:
  MultiHeadAttention mha_;
};

}  // namespace gpt2attn
