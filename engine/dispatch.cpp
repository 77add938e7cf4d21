// engine/dispatch.cpp: CPU feature detection and the ordered list of kernel implementations.
#include "engine/dispatch.hpp"

#include <cstdlib>

#include "gpt2attn/error.hpp"

namespace gpt2attn {

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::best: return "best";
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

Isa isa_from_string(const std::string& s) {
  if (s == "best") return Isa::best;
  if (s == "scalar") return Isa::scalar;
  if (s == "avx2") return Isa::avx2;
  if (s == "avx512") return Isa::avx512;
  invalid("unknown instruction set '" + s + "' (expected best, scalar, avx2 or avx512)");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::best:
    case Isa::scalar: return true;
    // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

Isa best_supported_isa() {
  for (Isa isa : {Isa::avx512, Isa::avx2}) {
    if (isa_supported(isa)) return isa;
  }
  return Isa::scalar;
}

namespace detail {

Isa resolve_isa(Isa requested) {
  if (requested == Isa::best) {
    const char* env = std::getenv("GPT2ATTN_ISA");
    requested = (env && *env) ? isa_from_string(env) : Isa::best;
  }
  if (requested == Isa::best) return best_supported_isa();
  if (!isa_supported(requested)) {
    invalid(std::string("instruction set ") + to_string(requested) + " is not supported by this CPU (best: " +
            to_string(best_supported_isa()) + ")");
  }
  return requested;
}

const kernels::AttentionKernel& attention_kernel(Isa resolved) {
  switch (resolved) {
    case Isa::avx512: return kernels::attention_f32_avx512();
    case Isa::avx2: return kernels::attention_f32_avx2();
    default: return kernels::attention_f32_scalar();
  }
}

const kernels::DecodeKernel& decode_kernel(Isa resolved) {
  switch (resolved) {
    case Isa::avx512: return kernels::decode_attention_f32_avx512();
    case Isa::avx2: return kernels::decode_attention_f32_avx2();
    default: return kernels::decode_attention_f32_scalar();
  }
}

const kernels::LinearKernel& linear_kernel(Isa resolved) {
  switch (resolved) {
    case Isa::avx512: return kernels::linear_f32_avx512();
    case Isa::avx2: return kernels::linear_f32_avx2();
    default: return kernels::linear_f32_scalar();
  }
}

}  // namespace detail
}  // namespace gpt2attn
