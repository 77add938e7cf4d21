// bench/fma_peak_cli.cpp: prints a measured compute peak as JSON lines, one per thread count, for scripts
// (peer_torch.py) that need the peak_frac denominator:
//   {"threads": n, "gflops": x, "isa": "avx512", "op": "fma"}       fp32 FMA (default)
//   {"threads": n, "gflops": x, "isa": "avx512_bf16", "op": "bf16dot"}   vdpbf16ps (--op bf16dot)
//   {"threads": n, "gflops": x, "isa": "avx512_vnni", "op": "int8dot"}   vpdpbusd, GOP/s (--op int8dot)
// Usage: fma_peak_cli [--threads N]... [--isa best|avx512|avx2] [--op fma|bf16dot|int8dot]   (threads: 1 .. nproc)
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "bench/fma_peak.hpp"

int main(int argc, char** argv) {
  namespace ga = gpt2attn;
  std::vector<int> threads;
  ga::Isa isa = ga::Isa::best;
  std::string op = "fma";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if ((a == "--threads" || a == "--isa" || a == "--op") && i + 1 < argc) {
        const std::string v = argv[++i];
        if (a == "--isa") {
          isa = ga::isa_from_string(v);
        } else if (a == "--op") {
          if (v != "fma" && v != "bf16dot" && v != "int8dot") {
            throw std::invalid_argument("--op is fma, bf16dot or int8dot, got '" + v + "'");
          }
          op = v;
        } else {
          const int n = std::atoi(v.c_str());
          if (n < 1) throw std::invalid_argument("--threads must be >= 1, got " + v);
          threads.push_back(n);
        }
      } else {
        throw std::invalid_argument("unknown argument '" + a +
                                    "' (usage: fma_peak_cli [--threads N]... [--isa ISA] [--op fma|bf16dot|int8dot])");
      }
    }
    if (threads.empty())
      for (int n = 1; n <= omp_get_num_procs(); ++n) threads.push_back(n);
    if (isa == ga::Isa::best) isa = ga::best_supported_isa();
    for (int n : threads) {
      const bool bf16 = op == "bf16dot", int8 = op == "int8dot";
      const double g = bf16   ? gpt2attn::bench::measured_bf16_dot_peak_gflops(n)
                       : int8 ? gpt2attn::bench::measured_int8_dot_peak_gops(n)
                              : gpt2attn::bench::measured_fma_peak_gflops(n, isa);
      std::printf("{\"threads\": %d, \"gflops\": %.3f, \"isa\": \"%s\", \"op\": \"%s\"}\n", n, g,
                  bf16 ? "avx512_bf16" : int8 ? "avx512_vnni" : ga::to_string(isa), op.c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fma_peak_cli: %s\n", e.what());
    return 2;
  }
  return 0;
}
