// bench/fma_peak_avx2.cpp: the AVX2+FMA instantiation of the FMA peak loop (12 ymm accumulators).
#include "bench/fma_peak.hpp"
#include "bench/fma_peak_impl.hpp"

namespace gpt2attn::bench {
double fma_peak_gflops_avx2(int threads, ProbeSpec spec) {
  return fma_peak_gflops<xsimd::fma3<xsimd::avx2>, 12>(threads, spec);
}
}  // namespace gpt2attn::bench
