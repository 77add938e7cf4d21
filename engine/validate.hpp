// engine/validate.hpp: checks one forward call's inputs against the config, once, at the API entry, and
// condenses them into the Shape that the engine and the naive reference pass down. Kernels trust it.
#pragma once

#include <cstdint>

#include "gpt2attn/attention.hpp"

namespace gpt2attn::detail {

struct Shape {
  int64_t B = 0, T = 0, Tk = 0;      // batch, query length, key length
  int64_t E = 0, H = 0, D = 0;       // model width, heads, head size
  int64_t d_in = 0, kdim = 0, vdim = 0;
  bool self_attention = true;        // key/value empty: K and V come from the query input
  int mask_rank = 0;                 // 0 (none), 2 (T,Tk), 3 (B,T,Tk), 4 (B,H,T,Tk)
  bool key_padding = false;
};

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
//  - when run.check_finite: NaN/Inf in query/key/value, or NaN in an additive mask
//    ("query contains NaN at (b, t, e) = (0, 3, 17)"); -inf in an additive mask is allowed
Shape validate_inputs(const Config& config, const AttentionInputs& in, const RunOptions& run);

// Throws invalid_argument naming "call: field" unless 0 <= threads <= max_threads() (0 = the default). Builds no
// string unless it throws: it runs on every call.
void check_threads(int64_t threads, const char* call, const char* field);

// Throws invalid_argument naming the first NaN/Inf of a rank-3 f32 view: "x contains NaN at (b, t, e) = ...".
void check_finite(const TensorView& v, const char* name, const char* len_symbol);

}  // namespace gpt2attn::detail
