// engine/linear.hpp: y = x W^T + b on oneDNN's matmul. Weights are reordered once, at construction, into
// the blocked layout oneDNN prefers and the compute type (f32, or bf16 rounded to nearest even); each
// (M, strides, threads, output type) gets its primitive once per ExecContext, then only execute().
// bf16: bf16 x and W, f32 accumulation and bias, y in f32 or bf16 as the next step wants.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "gpt2attn/tensor.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn::detail {

// Sets the calling thread's OpenMP team size for the scope (oneDNN's OpenMP runtime reads it), so the
// caller's thread count governs the GEMMs too and no second pool ever exists.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads);
  ~ScopedOmpThreads();
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

class Linear;

// The mutable half of the GEMMs: oneDNN primitives with their memory objects and scratchpads, one per GEMM
// shape (N, K, bias, M, lda, ldc, threads) and slot, created on first use. Weights are bound per call, so one
// entry serves every Linear of its shape (the H per-head projections share theirs). `slot` is the calling
// thread's number inside an OpenMP team, so team threads running same-shape GEMMs at once never share an
// entry. Each Workspace owns one ExecContext: calls with distinct workspaces share no mutable oneDNN state,
// while the weights (Linear) are shared read-only.
// The entries are bounded: those prepare() made (reserve, reserve_serving: what the caller asked to keep) stay for
// good, and of the others trim() keeps the kKeptEntries most recently used and drops the rest. It runs at the
// start of a call (MultiHeadAttention::Impl::with_workspace), where no GEMM of this context is running and no
// entry is referenced, so a call's own entries are never dropped under it; a dropped shape is created again on its
// next use. A self-attention prefill shape takes (threads + 1) entries (one per team thread for the per-head
// projections, one for the output projection; bf16 two), so 256 hold the last ~85 shapes at 2 threads, ~15 at 16;
// an extend takes more (its K/V segments have lengths of their own). Over 600 prompt lengths at gpt2-small on 2
// threads the process grew 162 MB without the bound and 29.5 MB with it (measured with oneDNN's own primitive cache
// off, DNNL_PRIMITIVE_CACHE_CAPACITY=0: that process-wide cache keeps up to 1024 compiled kernels of its own,
// 108 MB after 1000 lengths with it on). Shapes a server cycles through, more than the bound holds, should be
// reserved.
class ExecContext {
 public:
  static constexpr size_t kKeptEntries = 256;

  ExecContext();
  ~ExecContext();
  ExecContext(const ExecContext&) = delete;
  ExecContext& operator=(const ExecContext&) = delete;

  // Drops the least recently used entries that prepare() did not make, past kKeptEntries of them. Only where no
  // call is using this context. Never throws: where the bookkeeping cannot be allocated, it keeps everything until
  // the next call.
  void trim() noexcept;
  size_t entries();   // how many are held now
  size_t reserved();  // how many of them prepare() made (never trimmed)
  // How many run on oneDNN's reference implementation ("ref:"), hundreds of times slower than its JIT kernels: a
  // shape or layout none of those takes (the tests expect none).
  size_t reference_entries();

 private:
  friend class Linear;
  struct Entry;
  struct Key {
    int64_t N, K;
    WeightFormat format;  // int4's weights come plain (dequantized per call), the others' blocked
    bool bias;
    DType compute, gemm, dst;
    int64_t M, lda, ldc;
    int threads, slot;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  // Each slot's dense result before run() finishes y (Entry::Via: a bf16 Linear on f32 GEMMs writing bf16, an int8
  // Linear's int32 sums, a y of a row stride oneDNN's fast kernels refuse), grown to the largest shape the slot's
  // entries were made for (never per call, never shrunk; trim() keeps them). Node-based, so a slot's buffer stays put
  // while another slot's is added; a slot's GEMMs are its thread's, one at a time.
  // An int4 Linear's dequantized weights go to `weights`, whose contents are those of the Linear with id weights_of
  // (0: none).
  struct Wide {
    std::vector<float> dst;
    std::vector<std::byte> weights;
    uint64_t weights_of = 0;
  };
  std::mutex mu_;  // the team's threads look up and add entries concurrently
  std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> entries_;
  std::unordered_map<int, Wide> wide_;
  uint64_t uses_ = 0;  // entry lookups so far: each entry's last_use orders them for trim()
};

// y = x W^T + b. Immutable after construction: run() may be called from several threads at once, each with
// its own ExecContext.
class Linear {
 public:
  // w: an (N, K) view (torch layout) of f32, bf16 or f16 with any strides, bias: (N) f32 or null. Both are copied,
  // the weights converted to `compute` (f32 or bf16: rounded to nearest even once, or exact; see convert).
  Linear(const TensorView& w, const float* bias, DType compute = DType::f32);
  // Quantized weights (gpt2attn/weights.hpp, QuantizedMatrix: codes (N, K) row-major, scales (N, groups); decode's
  // panels hold the same codes), format f:
  //   int8: oneDNN's u8 x s8 GEMM on VNNI (int8_available()); run() then reads quantize_rows' u8 activations with
  //         their row scales and rescales the int32 sums into y (f32, or bf16 for a bf16 layer) itself:
  //         y = (sum - 128 colsum_n) x_scale_m w_scale_n + b_n.
  //   int4: the codes kept two to a byte; run() dequantizes them (code x scale, rounded to bf16 once for a bf16 layer:
  //         the values a Linear of dequantized() weights would hold) into the slot's buffer in the compute type and
  //         multiplies there, so no compute-type copy of a matrix is kept, only a panel per slot for the call (the
  //         engine's Linears are D rows each). A slot's buffer remembers whose weights it holds: consecutive calls
  //         of one Linear convert once.
  // `dequantize`: int4's conversion (the layer's level's LinearKernel::dequantize), else null.
  Linear(WeightFormat f, const int8_t* codes, const float* scales, int64_t N, int64_t K, const float* bias,
         DType compute, kernels::DequantizeFn dequantize = nullptr);
  // Whether oneDNN runs u8 x s8 matmuls on VNNI (or AMX) here: elsewhere (AVX2, or oneDNN capped below VNNI) its int8
  // kernels sum byte products in saturating 16-bit pairs, which full-range codes overflow, so an int8 layer's GEMMs
  // take the dequantized weights instead. Probed once per process.
  static bool int8_available();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;
  ~Linear();

  // x: (M, K) of operand() with row stride lda; y: (M, N) of type `dst` (f32, or bf16 when the compute type is
  // bf16) with row stride ldc. A bf16 Linear on f32 GEMMs (gemm_, below) rounds a bf16 y from its f32 result. M >= 1.
  // The first call for a given (M, lda, ldc, threads, dst, slot) in `ctx` creates its primitive; later calls
  // allocate nothing. `slot`: the caller's thread number in the engine's team (engine/team.hpp) running same-shape
  // GEMMs at once, 0 for a GEMM run alone. The engine says which, not the OpenMP runtime: a server calling from its
  // own parallel region has a thread number there that is no slot of ours (it made the output projection miss what
  // reserve() had prepared).
  // row_scales: an int8 Linear's activation scales (M of them, Rows::scale), else null.
  void run(ExecContext& ctx, const void* x, int64_t M, int64_t lda, void* y, int64_t ldc, int threads, int slot,
           DType dst = DType::f32, const float* row_scales = nullptr) const;
  // Creates the entry run() would use from `slot`, without running, and keeps it for good (ExecContext::trim).
  void prepare(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot,
               DType dst = DType::f32) const;

  int64_t N() const { return N_; }
  int64_t K() const { return K_; }
  DType compute() const { return compute_; }
  // The type run() reads x in: the compute type, f32 holding bf16 values (convert_bf16_values) where the GEMMs
  // multiply in f32 (gemm_), or u8 codes (quantize_rows) for int8. The caller converts each input once per call, not
  // once per GEMM that reads it.
  DType operand() const { return gemm_; }
  const std::string& implementation() const { return impl_; }  // oneDNN's name, e.g. "brg:avx512_core"

 private:
  // The primitive descriptor of this Linear's GEMM for a representative M (128), its weights in layout `weights`
  // (any: oneDNN's blocked choice; ba: our plain (N, K) rows), over `op`, which must outlive it (skip_amx's
  // next_impl() reads it in place). Where oneDNN has no bf16 matmul (below avx512_core), gemm_ becomes f32.
  dnnl::matmul::primitive_desc describe(dnnl::memory::format_tag weights, std::optional<dnnl::matmul::desc>& op);
  // The entry for this shape, found or made, under ctx's lock; `pin` marks it reserved under the same lock, so no
  // trim() can come between finding it and keeping it.
  // For a bf16 Linear on f32 GEMMs, *wide (when not null) gets the slot's f32 buffers, large enough for this shape.
  ExecContext::Entry& entry(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot, DType dst,
                            bool pin, ExecContext::Wide** wide = nullptr) const;

  int64_t N_ = 0, K_ = 0;
  DType compute_ = DType::f32;
  // The type oneDNN multiplies in: the compute type, except where oneDNN has no bf16 matmul (a CPU without
  // AVX-512, or oneDNN capped below it by ONEDNN_MAX_CPU_ISA): there a bf16 layer's GEMMs run in f32 on the
  // bf16-rounded weights and activations, which gives the products a bf16 GEMM forms (a product of two bf16 values
  // is exact in f32) summed in f32 as it sums them, in an order of oneDNN's choosing. x then comes as f32 (operand)
  // and a bf16 y is rounded from the slot's f32 result (ExecContext::Wide) on the calling thread.
  DType gemm_ = DType::f32;
  bool has_bias_ = false;
  dnnl::memory::desc weights_desc_;
  dnnl::memory weights_, bias_;
  std::string impl_;
  // int8 (gemm_ == u8): per output row, the weights' scale and the sum of its codes; the bias, added by run().
  std::vector<float> w_scales_, bias_host_;
  std::vector<int32_t> w_sums_;
  // int4: the codes two a byte in kernels::DequantizeFn's layout (16 bytes per group of 32 inputs), the group scales
  // (N, ceil(K / kWeightGroup)), and an id no other Linear of the process has (Wide::weights_of).
  WeightFormat format_ = WeightFormat::compute;
  std::vector<uint8_t> nibbles_;
  std::vector<float> group_scales_;
  uint64_t id_ = 0;
  kernels::DequantizeFn dequantize_ = nullptr;
};

dnnl::engine& cpu_engine();

// Caps oneDNN's instruction set for the whole process (dnnl::set_max_cpu_isa) at the level of `isa`: avx512_bf16 ->
// avx512_core_bf16 (so no AMX), avx512 -> avx512_core, avx2 -> avx2, scalar -> sse41 (oneDNN's lowest); best caps
// nothing, and neither does a process whose environment already sets ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA (that
// cap is kept). Process-wide and once: for a program that owns its process (the CLI), before any layer exists; once
// oneDNN has dispatched anything it fails with an internal error. No environment is written.
void cap_onednn(Isa isa);

}  // namespace gpt2attn::detail
