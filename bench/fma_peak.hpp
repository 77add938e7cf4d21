// bench/fma_peak.hpp: the machine's measured fp32 FMA peak, the denominator of every benchmark's peak_frac.
// Measured in the same run as the benchmarks (clock, turbo and AVX-512 licence as they are now); not a
// datasheet figure and not a model of the attention kernel.
#pragma once

#include <stdexcept>
#include <string>

#include "gpt2attn/attention.hpp"

namespace gpt2attn::bench {

// How a probe runs: the best of `trials` trials of about `trial_seconds` each (other load only lowers a trial). The
// default is the start-up probe's; a benchmark that probes beside each of its own iterations takes a shorter one.
struct ProbeSpec {
  int trials = 10;
  double trial_seconds = 0.05;
};

// GFLOP/s (an FMA counts 2 FLOPs per lane) of `threads` OpenMP threads together, each running independent
// FMA chains, as `spec` says. Defined in fma_peak_<isa>.cpp, compiled with that ISA's flags: call only where the
// CPU supports the ISA.
double fma_peak_gflops_avx512(int threads, ProbeSpec spec = {});
double fma_peak_gflops_avx2(int threads, ProbeSpec spec = {});

// GFLOP/s of vdpbf16ps (AVX512-BF16: 32 bf16 products summed in pairs into 16 f32 lanes, 64 FLOPs), measured as
// the FMA peak is: the ceiling a bf16 kernel is compared with (issue: bf16 compute). Defined in
// bf16_dot_peak_avx512bf16.cpp; call only where the CPU has AVX512-BF16.
double bf16_dot_peak_gflops_avx512bf16(int threads);

inline double measured_bf16_dot_peak_gflops(int threads) {
  if (!isa_supported(Isa::avx512_bf16)) {
    throw std::invalid_argument("bf16 dot peak: this CPU lacks avx512bf16 (vdpbf16ps)");
  }
  return bf16_dot_peak_gflops_avx512bf16(threads);
}

// GOP/s of vpdpbusd (AVX512-VNNI: 64 u8 x s8 products summed in fours into 16 int32 lanes, 128 operations), measured
// as the FMA peak is: the ceiling of int8 weights' integer GEMMs. Defined in int8_dot_peak_avx512vnni.cpp; call only
// where the CPU has AVX512-VNNI.
double int8_dot_peak_gops_avx512vnni(int threads);

inline double measured_int8_dot_peak_gops(int threads) {
  if (!__builtin_cpu_supports("avx512vnni")) {
    throw std::invalid_argument("int8 dot peak: this CPU lacks avx512vnni (vpdpbusd)");
  }
  return int8_dot_peak_gops_avx512vnni(threads);
}

// The f32 FMA peak for an instruction set (best = the strongest this CPU runs; avx512_bf16's f32 FMAs are
// avx512's). Scalar has no FMA instruction in the baseline x86-64 flags the scalar kernel is built with, so it
// has no peak of its own: that is refused.
inline double measured_fma_peak_gflops(int threads, Isa isa, ProbeSpec spec = {}) {
  if (isa == Isa::best) isa = best_supported_isa();
  if (!isa_supported(isa)) throw std::invalid_argument(std::string("fma peak: this CPU lacks ") + to_string(isa));
  switch (isa) {
    case Isa::avx512_bf16:
    case Isa::avx512: return fma_peak_gflops_avx512(threads, spec);
    case Isa::avx2: return fma_peak_gflops_avx2(threads, spec);
    default: throw std::invalid_argument(std::string("fma peak: no vector FMA for ") + to_string(isa));
  }
}

}  // namespace gpt2attn::bench
