// gpt2attn/isa.hpp: the instruction-set levels the kernel layer is compiled for, and what this CPU runs.
// What each level needs from the CPU is listed once, in CMakeLists.txt (GPT2ATTN_ISA_FEATURES_<isa>): the
// kernels of a level are compiled with -m<feature> for each, and the run-time check tests the same features.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpt2attn/export.h"

namespace gpt2attn {

// `best` takes the strongest level this CPU runs (GPT2ATTN_ISA=scalar|avx2|avx512|avx512_bf16 in the environment
// overrides it); the others name a level. avx512_bf16 is avx512 plus the AVX512-BF16 dot product (vdpbf16ps): it
// changes only bf16 compute, whose products it runs at twice the f32 FMA rate; f32 layers run the avx512 kernels.
enum class Isa : uint8_t { best, scalar, avx2, avx512, avx512_bf16 };
GPT2ATTN_API const char* to_string(Isa isa);
GPT2ATTN_API Isa isa_from_string(const std::string& s);  // "best" | "scalar" | "avx2" | "avx512" | "avx512_bf16"
GPT2ATTN_API Isa best_supported_isa();                   // what `best` resolves to on this machine
GPT2ATTN_API bool isa_supported(Isa isa);
GPT2ATTN_API std::vector<Isa> compiled_isas();           // every level built into the library, best first, scalar last
// The CPU features a level needs ("avx512f", "fma", ...), as its kernels are compiled with them.
GPT2ATTN_API std::vector<std::string> isa_features(Isa isa);

// Caps oneDNN's GEMMs (the projections) at `isa` for the whole process, as EngineOptions::isa caps gpt2attn's own
// kernels: avx512_bf16 is oneDNN's avx512_core_bf16 (so no AMX), avx512 avx512_core, avx2 avx2, scalar sse41; best
// caps nothing, and neither does an environment that sets ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA (that cap is
// kept). oneDNN fixes its cap at its first dispatch: for a program that owns its process (the CLI), call it before
// any layer exists; later it fails with Error(internal). Writes no environment.
GPT2ATTN_API void limit_gemm_isa(Isa isa);

}  // namespace gpt2attn
