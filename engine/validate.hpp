// engine/validate.hpp: checks one call's inputs against the config, once, at the API entry (forward, extend and
// decode alike), and condenses them into the AttnShape that the engine and the naive reference pass down. Kernels
// trust it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gpt2attn/config.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/options.hpp"

namespace gpt2attn::detail {

// One call's shape in the library's one vocabulary: B batch, T query length, Tk key length, E model width,
// H query heads, H_kv K/V heads (H_kv divides H; query head h reads K/V head kv_head(h)), D head size.
// For extend and decode, Tk is the longest cached length plus T, known once the pool has leased the sequences.
struct AttnShape {
  int64_t B = 0, T = 0, Tk = 0;
  int64_t E = 0, H = 0, H_kv = 0, D = 0;
  int64_t d_in = 0, kdim = 0, vdim = 0;  // input widths of the query, key and value projections
  bool self_attention = true;            // key/value empty: K and V come from the query input
  int mask_rank = 0;                     // 0 (none), 2 (T,Tk), 3 (B,T,Tk), 4 (B,H,T,Tk)
  bool key_padding = false;

  int64_t kv_head(int64_t h) const { return h / (H / H_kv); }
};

// Whether any of n elements of storage type S (f32, bf16 or f16; `stride` elements apart, from element `first` of
// data) is NaN or +-Inf: its exponent bits all ones. No branch per element, so a contiguous row compiles to vector
// compares (the per-element isfinite test it replaced, with its dtype switch inside, took 1.2% of a gpt2-small
// T=1024 forward on one thread, serial ahead of the kernels). Inputs' scans (check_finite) and weights' use it.
template <DType S>
bool any_nonfinite(const void* data, int64_t first, int64_t n, int64_t stride) {
  static_assert(S == DType::f32 || S == DType::bf16 || S == DType::f16, "a floating-point storage type");
  using Bits = std::conditional_t<S == DType::f32, uint32_t, uint16_t>;
  constexpr Bits exponent = static_cast<Bits>(S == DType::f32 ? 0x7f800000u : S == DType::bf16 ? 0x7f80u : 0x7c00u);
  const auto* p = static_cast<const std::byte*>(data) + first * static_cast<int64_t>(sizeof(Bits));
  const auto bits = [&](int64_t i) {  // the element's bits (memcpy: no float read through an integer type)
    Bits x;
    std::memcpy(&x, p + i * static_cast<int64_t>(sizeof(Bits)), sizeof x);
    return x;
  };
  Bits bad = 0;
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) bad |= static_cast<Bits>((bits(i) & exponent) == exponent);
  } else {
    for (int64_t i = 0; i < n; ++i) bad |= static_cast<Bits>((bits(i * stride) & exponent) == exponent);
  }
  return bad != 0;
}

// The widths and heads of a layer built from `config` (B = T = Tk = 0): the part of every shape the config fixes.
AttnShape shape_of(const Config& config);

// Throws Error(invalid_argument) with a message naming the tensor, the expected and the actual shape:
//  - query missing, not f32, not rank 3, or last dim != d_in; B == 0 or T == 0
//  - key/value: both or neither; f32 rank 3; same B as query and same Tk; widths kdim / vdim; Tk >= 1
//  - T or Tk > context_length ("sequence length T=... exceeds context_length=...")
//  - causal with cross-attention is allowed (bottom-right); causal self-attention requires T == Tk (true)
//  - attn_mask: u8 or f32, rank 2/3/4 with shape (T,Tk) / (B,T,Tk) / (B,H,T,Tk) exactly (no other
//    broadcast); mask_kind additive requires f32
//  - key_padding: u8 or f32, shape (B, Tk)
//  - any view with a negative stride or a null data pointer with a non-empty shape
//  - run.threads < 0 or > max_threads()
//  - when run.check_finite: NaN/Inf in query/key/value, NaN or +Inf in an additive mask, NaN in a float keep/block
//    mask or key_padding
//    ("query contains NaN at (b, t, e) = (0, 3, 17)"); -inf in an additive mask is allowed
// threads: the team the call runs on (the layer's threads_for(run); read only after run.threads is checked), which
// scans query/key/value for NaN/Inf: a serial pass over the inputs would stand alone ahead of every parallel stage.
// The naive reference passes 1.
AttnShape validate_inputs(const Config& config, const AttentionInputs& in, const RunOptions& run, int threads);

// extend(): T new tokens x (1, T, d_in) of one sequence. Throws invalid_argument for a cache built for other heads
// or widths, training mode, bad threads, T outside [1, context_length], null x or out, and (check_finite) a
// non-finite x. The sequence id and its length are checked by the pool's lease (KvCache::Impl::begin_append).
AttnShape validate_extend(const Config& config, const KvCache& cache, const float* x, int64_t T, const float* out,
                          const RunOptions& run, int threads);
// decode(): one new token for each of B sequences, x (B, 1, d_in). The same checks with B >= 1 and seqs non-null.
AttnShape validate_decode(const Config& config, const KvCache& cache, const SequenceId* seqs, int64_t B,
                          const float* x, const float* out, const RunOptions& run, int threads);

// step(): entry i appends tokens[i] new tokens to seqs[i], x (1, sum tokens, d_in). The same checks with n >= 1, seqs
// and tokens non-null, and every tokens[i] in [1, context_length]; T of the shape returned is the step's sum.
AttnShape validate_step(const Config& config, const KvCache& cache, const SequenceId* seqs, const int64_t* tokens,
                        int64_t n, const float* x, const float* out, const RunOptions& run, int threads);

// Throws invalid_argument naming "call: field" unless 0 <= threads <= max_threads() (0 = the default). Builds no
// string unless it throws: it runs on every call.
void check_threads(int64_t threads, const char* call, const char* field);
// `threads` (check_threads first), 0 resolved to the default: OMP_NUM_THREADS (omp_get_max_threads) capped at
// max_threads(). EngineOptions::threads and RowOpOptions::threads both mean this.
int threads_or_default(int threads);

// Throws invalid_argument naming the first NaN/Inf of a rank-3 f32 or bf16 view: "x contains NaN at (b, t, e) =
// ...". Rows are scanned on `threads` threads when the view is large enough to pay for a team; the first offender
// is the one named either way.
void check_finite(const TensorView& v, const char* name, const char* len_symbol, int threads = 1);

// With RunOptions::check_finite, after a projection whose inputs and weights are finite (both checked): throws
// Error(invalid_argument) naming the projection and the first element of y that overflowed to +-Inf, instead of
// letting it reach the output as NaN. y: `rows` rows of n f32 or bf16 values, row stride ld; its columns are columns
// col0.. of the projection's output (a head's slice, or a part of decode's fused [q | k | v]).
void check_projection(const void* y, DType dtype, int64_t rows, int64_t n, int64_t ld, const char* projection,
                      int64_t col0 = 0, int threads = 1);

}  // namespace gpt2attn::detail
