// bench/mpi_weight_check.cpp: what WeightCheck::full costs a ShardedAttention at construction, against the sampled
// check: each preset's layer built from Weights::random's values with one check and then the other, alternated, and
// the median of each over the repeats. The difference is the cost of hashing every byte of the layer on each rank.
//
// Usage: mpirun -np N mpi_weight_check [--repeats R] [--preset P ...]   (default 5 repeats, the four GPT-2 sizes)
// Rank 0 prints one JSON line per preset:
//   {"preset":P,"ranks":N,"layer_mb":M,"full_ms":t,"sampled_ms":t0,"check_ms":t-t0,"check_gbs":M/(t-t0)}
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpt2attn/gpt2attn.hpp"
#include "gpt2attn/parallel.hpp"

namespace ga = gpt2attn;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One build's wall time on the slowest rank: the check is collective, so every rank waits for the last.
double build_ms(const ga::Config& c, const ga::WeightsView& w, ga::WeightCheck check) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  { const ga::ShardedAttention layer(c, w, MPI_COMM_WORLD, {}, check); }
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int repeats = 5;
  std::vector<std::string> presets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--preset" && i + 1 < argc) {
      presets.push_back(argv[++i]);
    } else {
      if (rank == 0) std::fprintf(stderr, "usage: mpirun -np N mpi_weight_check [--repeats R] [--preset P ...]\n");
      MPI_Finalize();
      return 2;
    }
  }
  if (presets.empty()) presets = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"};
  int rc = 0;
  try {
    for (const std::string& p : presets) {
      const ga::Config c = ga::preset(p);
      const ga::Weights w = ga::Weights::random(c, 1);
      const ga::WeightsView v = w.view(c);
      double bytes = 0;
      for (const auto* t : {&w.w_q, &w.w_k, &w.w_v, &w.w_o, &w.b_q, &w.b_k, &w.b_v, &w.b_o}) {
        bytes += static_cast<double>(t->size() * sizeof(float));
      }
      std::vector<double> full, sampled;
      for (int r = 0; r < repeats; ++r) {
        // Alternated, the order swapped every repeat, so drift over the run falls on both alike.
        if (r % 2 == 0) {
          full.push_back(build_ms(c, v, ga::WeightCheck::full));
          sampled.push_back(build_ms(c, v, ga::WeightCheck::sampled));
        } else {
          sampled.push_back(build_ms(c, v, ga::WeightCheck::sampled));
          full.push_back(build_ms(c, v, ga::WeightCheck::full));
        }
      }
      const double f = median(full), s = median(sampled), mb = bytes / 1e6;
      if (rank == 0) {
        std::printf(
            "{\"preset\":\"%s\",\"ranks\":%d,\"layer_mb\":%.1f,\"full_ms\":%.2f,\"sampled_ms\":%.2f,\"check_ms\":%.2f,"
            "\"check_gbs\":%.2f}\n",
            p.c_str(), ranks, mb, f, s, f - s, f > s ? mb / (f - s) : 0.0);
        std::fflush(stdout);
      }
    }
  } catch (const ga::Error& e) {
    if (rank == 0) std::fprintf(stderr, "mpi_weight_check: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
