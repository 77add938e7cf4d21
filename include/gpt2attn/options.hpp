// gpt2attn/options.hpp: the vocabulary of a call, shared by the layers (gpt2attn/attention.hpp), the reference
// (gpt2attn/reference.hpp) and the tensor-parallel module: engine options, one call's inputs and run options, the
// per-caller Workspace, the thread limit and the dropout contract. No layer here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/export.h"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/tensor.hpp"

namespace gpt2attn {

// The most threads one call may use: min(kMaxThreads, the OpenMP thread limit, OMP_THREAD_LIMIT). A larger
// count in EngineOptions, RunOptions or reserve_serving is refused with invalid_argument. A default taken from
// omp_get_max_threads() (OMP_NUM_THREADS) is clamped to it.
inline constexpr int kMaxThreads = 1024;
GPT2ATTN_API int max_threads();

// Runs f(thread, team) once on each thread of a team of `threads` (1 <= threads <= max_threads(), else
// invalid_argument): the calling thread's team, the threads the library's calls from this thread run on, every
// thread released together. For per-thread work a program wants on the threads its calls will use (pinning, first
// touch, a timed share: the benchmarks' cache flush). team is `threads`, or 1 when called from inside such a team
// (f running on a team thread), which a share must be cut by; it is also returned. The first exception f throws is
// rethrown once every thread has returned.
GPT2ATTN_API int run_on_threads(int threads, const std::function<void(int thread, int team)>& f);

struct EngineOptions {
  int threads = 0;        // default thread count of a call; 0 = omp_get_max_threads() (OMP_NUM_THREADS) at construction
  Isa isa = Isa::best;    // GPT2ATTN_ISA=scalar|avx2|avx512|avx512_bf16 in the environment overrides `best`
  // The compute type: f32, or bf16 (weights rounded to bf16 once, here; activations rounded to bf16 where they
  // enter a GEMM or a dot product; every sum, the softmax and its running statistics in f32). An engine option,
  // not a Config field: the config describes the model (what a weights file must match), the compute type how this
  // process runs it, like the instruction set; one model file serves f32 and bf16 layers alike. bf16 runs at every
  // instruction set: on avx512_bf16 (vdpbf16ps) at twice the f32 multiply rate, elsewhere widened to f32 with the
  // same roundings. Accuracy: tolerance_for(DType::bf16, ...) in gpt2attn/tolerance.hpp.
  DType compute = DType::f32;
  // The projection weights' format (gpt2attn/dtype.hpp, WeightFormat): compute, or int8 / int4 quantized from the
  // given weights once, here (or given quantized: the QuantizedWeights constructors). Decode's projections stream the
  // quantized panels (int8 half of bf16's bytes, int4 about a third with its scales) into integer dot products with
  // each input row quantized to int16. Prefill's GEMMs: int8 on oneDNN's u8 x s8 kernels where it has VNNI (the
  // inputs quantized per row to 8 bits), otherwise the dequantized values in the compute type; int4 converts each
  // head's codes as its GEMM runs (no compute-type copy is held).
  // Accuracy: dequantized_tolerance() and weights_tolerance() in gpt2attn/tolerance.hpp.
  WeightFormat weights = WeightFormat::compute;
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
  // Reject NaN/Inf inputs with an error naming the tensor and index, and a projection whose output overflows float32
  // with one naming the projection.
  bool check_finite = true;
  // Serving calls (CausalSelfAttention::step, decode; Linear::forward): every token's result the same bits whatever
  // else shares the call and at any thread count, so a server's answer to a request does not depend on its batch-mates.
  // The projections then always run on the few-row kernel (each row's sums in one fixed order; no switch to oneDNN's
  // GEMMs past 64 rows), a one-entry step runs as a step (not as extend(), whose GEMMs and tiled kernel sum
  // otherwise), and a sequence's keys split into ceil(keys / 256) ranges, at most 4, fixed by its own length (not by
  // the step's total and the thread count). Results stay within the same tolerance; what it costs: docs/serving.md.
  bool batch_invariant = false;
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

}  // namespace gpt2attn
