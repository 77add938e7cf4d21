// bench/fma_peak_avx512.cpp: the AVX-512 instantiation of the FMA peak loop (16 zmm accumulators).
#include "bench/fma_peak.hpp"
#include "bench/fma_peak_impl.hpp"

namespace gpt2attn::bench {
double fma_peak_gflops_avx512(int threads, ProbeSpec spec) {
  return fma_peak_gflops<xsimd::avx512f, 16>(threads, spec);
}
}  // namespace gpt2attn::bench
