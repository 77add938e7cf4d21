// engine/dispatch.hpp: picks the attention kernel for an instruction set, once, at layer construction.
// Order of preference, best first: avx512, avx2, scalar (always available).
#pragma once

#include "gpt2attn/attention.hpp"
#include "kernels/attention_f32.hpp"
#include "kernels/decode_attention_f32.hpp"
#include "kernels/linear_f32.hpp"

namespace gpt2attn::detail {

// Resolves `requested` (best -> the strongest supported; GPT2ATTN_ISA overrides best) and returns the
// kernel. Asking for an ISA this CPU lacks is an invalid_argument error naming the ISA.
Isa resolve_isa(Isa requested);
const kernels::AttentionKernel& attention_kernel(Isa resolved);
const kernels::DecodeKernel& decode_kernel(Isa resolved);
const kernels::LinearKernel& linear_kernel(Isa resolved);

}  // namespace gpt2attn::detail
