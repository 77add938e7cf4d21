// gpt2attn/attention.hpp: the multi-head attention layer (torch.nn.MultiheadAttention semantics, batch_first)
// and the GPT-2 causal self-attention built on it. Construction does all set-up; forward() only computes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gpt2attn/config.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/tensor.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn {


// The most threads one call may use: min(kMaxThreads, the OpenMP thread limit, OMP_THREAD_LIMIT). A larger
// count in EngineOptions, RunOptions or reserve_serving is refused with invalid_argument: libgomp cannot start
// a team that large (its stack overflows, or it calls exit() when thread creation fails). A default taken from
// omp_get_max_threads() (OMP_NUM_THREADS) is clamped to it.
inline constexpr int kMaxThreads = 1024;
GPT2ATTN_API int max_threads();

struct EngineOptions {
  int threads = 0;        // default thread count for forward(); 0 = omp_get_max_threads() at construction
  Isa isa = Isa::best;    // GPT2ATTN_ISA=scalar|avx2|avx512|avx512_bf16 in the environment overrides `best`
  // The compute type: f32, or bf16 (weights rounded to bf16 once, here; activations rounded to bf16 where they
  // enter a GEMM or a dot product; every sum, the softmax and its running statistics in f32). An engine option,
  // not a Config field: the config describes the model (what a weights file must match), the compute type how this
  // process runs it, like the instruction set; one model file serves f32 and bf16 layers alike. bf16 runs at every
  // instruction set: on avx512_bf16 (vdpbf16ps) at twice the f32 multiply rate, elsewhere widened to f32 with the
  // same roundings. Accuracy: tolerance_for(DType::bf16, ...) in gpt2attn/tolerance.hpp.
  DType compute = DType::f32;
};

// One call's inputs. Shapes in the B/T/Tk/E/H vocabulary; every view may be strided.
struct AttentionInputs {
  TensorView query;        // (B, T, d_in) f32 or bf16
  TensorView key;          // (B, Tk, kdim) f32 or bf16; empty = self-attention (key = value = query, fused QKV)
  TensorView value;        // (B, Tk, vdim) f32 or bf16; given iff key is
  TensorView attn_mask;    // optional: (T, Tk), (B, T, Tk) or (B, H, T, Tk); u8 or f32
  MaskKind mask_kind = MaskKind::keep;
  TensorView key_padding;  // optional: (B, Tk), nonzero = padding (torch's key_padding_mask); u8 or f32
};

struct RunOptions {
  int threads = 0;             // 0 = the layer's default
  bool training = false;       // dropout applies only when true
  uint64_t dropout_seed = 0;   // see the dropout contract below
  bool check_finite = true;    // reject NaN/Inf inputs with an error naming the tensor and index
};

// Per-caller scratch memory and oneDNN execution state. A call given a Workspace touches no mutable state of
// the layer, so several threads, each with its own Workspace, run calls in parallel on one shared layer (and
// one shared KvCache). A call without one uses the layer's own workspace and is serialised by a mutex.
// A Workspace grows when a call needs more than it holds; once it has seen or reserved the largest call, its
// scratch does not grow again. It also keeps the oneDNN primitives of the prefill (forward, extend) shapes it has
// run, one set per (B, T, thread count), each created on that shape's first call: a repeated shape allocates
// nothing in gpt2attn, a new one does. Those of reserved shapes (reserve, reserve_serving) it keeps for good; of the
// others, the 256 most recently used GEMM primitives (threads + 1 a self-attention shape: about 85 shapes at 2
// threads), dropping older ones at the start of a call. A server meeting many prompt lengths so stays bounded
// (about 30 MB at gpt2-small, 2 threads), a dropped shape is created again when it returns, and shapes a server
// cycles through, more than that holds, should be reserved. oneDNN keeps its own process-wide cache of compiled
// kernels (DNNL_PRIMITIVE_CACHE_CAPACITY, 1024 by default). Decode steps (no oneDNN) allocate nothing after
// reserve_serving. One Workspace serves any number of layers; using one Workspace from two threads at once is
// refused with an error.
class GPT2ATTN_API Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;
  size_t bytes() const;  // scratch memory held now (oneDNN primitives not counted)

  struct GPT2ATTN_LOCAL Impl;  // engine-internal (engine/workspace.hpp)
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Dropout contract (training only, p = config.dropout): attention weight (b, h, i, j) of a call is kept
// iff dropout_uniform(seed, ((b*H + h)*T + i)*Tk + j) >= p, and kept weights are scaled by 1/(1-p).
// The draw depends only on (seed, index), so results do not depend on threads, tiling or ISA.
//   splitmix64(x): x += 0x9e3779b97f4a7c15; x = (x ^ x>>30) * 0xbf58476d1ce4e5b9;
//                  x = (x ^ x>>27) * 0x94d049bb133111eb; return x ^ x>>31
//   dropout_uniform(seed, n) = (splitmix64(seed ^ splitmix64(n)) >> 40) * 2^-24   in [0, 1)

// Semantics (all paths, the naive reference included):
//   Q = query W_q^T + b_q, K = key W_k^T + b_k, V = value W_v^T + b_v, split into H heads of D
//   s[b,h,i,j] = Q_i . K_j / sqrt(D)  (+ additive mask), masked entries = -inf
//   masked: keep-mask == 0, block-mask != 0, key_padding != 0, causal j > i + (Tk - T)
//   p = softmax_j(s); a row with every entry masked gives p = 0 (never NaN)
//   out = concat_h(p V) W_o^T + b_o, shape (B, T, E)
class GPT2ATTN_API MultiHeadAttention {
 public:
  // Validates config and weights (throws Error naming the problem), repacks weights for oneDNN,
  // registers the causal mask for config.context_length, and picks the kernel ISA once.
  MultiHeadAttention(const Config& config, const Weights& weights, const EngineOptions& options = {});
  // The same from views of weights in f32, bf16 or f16 (gpt2attn/weights.hpp), e.g. a safetensors file's bytes.
  MultiHeadAttention(const Config& config, const WeightsView& weights, const EngineOptions& options = {});
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
