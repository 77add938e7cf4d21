// bench/stream_triad_cli.cpp: prints the measured STREAM-style triad bandwidth as JSON lines, one per thread
// count, for scripts (peer_torch_decode.py) that need the bw_frac denominator:  {"threads": n, "gbps": x}.
// Usage: stream_triad_cli [--threads N]... [--mib M]   (default: 1 .. number of processors, 64 MiB arrays)
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/stream_triad.hpp"

int main(int argc, char** argv) {
  std::vector<int> threads;
  long mib = 64;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if ((a == "--threads" || a == "--mib") && i + 1 < argc) {
        const std::string v = argv[++i];
        const long n = std::atol(v.c_str());
        if (n < 1) throw std::invalid_argument(a + " must be >= 1, got " + v);
        if (a == "--mib") {
          mib = n;
        } else {
          threads.push_back(static_cast<int>(n));
        }
      } else {
        throw std::invalid_argument("unknown argument '" + a + "' (usage: stream_triad_cli [--threads N]... [--mib M])");
      }
    }
    if (threads.empty())
      for (int n = 1; n <= omp_get_num_procs(); ++n) threads.push_back(n);
    for (int n : threads) {
      const double g = gpt2attn::bench::stream_triad_gbps(n, static_cast<size_t>(mib) << 20);
      std::printf("{\"threads\": %d, \"gbps\": %.3f}\n", n, g);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stream_triad_cli: %s\n", e.what());
    return 2;
  }
  return 0;
}
