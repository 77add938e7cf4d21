// bench/mpi_allreduce.cpp: times MPI_Allreduce(MPI_IN_PLACE, float, MPI_SUM), the one collective of the
// tensor-parallel layer, over message sizes from 4 B up, so bench/scaling_model.py can fit its latency and bandwidth
// terms (docs/scaling.md). It measures the MPI library and the transport under it, nothing of gpt2attn.
//
// Usage: mpirun -np N mpi_allreduce [--max-bytes B] [--repeats R]
//   Sizes 4, 8, 16, ... B (powers of 2) up to --max-bytes (default 64 MiB; a multiple of 4, at most 1 GiB). Each
//   timed call is preceded by a barrier and timed on every rank; a repeat's time is the slowest rank's (the layer
//   waits for it), and the printed figure is the median over repeats. --repeats R times every size R times; without
//   it the count falls with size: 1000 up to 64 KiB, then 64 MiB / size, at least 20 (from 4 MiB on).
// Rank 0 prints one JSON line per size:
//   {"ranks":N,"bytes":n,"repeats":R,"median_us":t,"min_us":t0,"algbw_gbs":n/t,"busbw_gbs":n/t*2(N-1)/N}
// algbw is bytes / time; busbw (nccl-tests' convention) scales it by the ring's 2(N-1)/N, the bytes each rank sends.
#include <mpi.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage = "usage: mpirun -np N mpi_allreduce [--max-bytes B] [--repeats R]";

// Strict positive integer: the whole string is digits and fits, otherwise false.
bool parse_positive(const char* s, long long& out) {
  if (s == nullptr || *s == '\0' || *s == '-' || *s == '+') return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < 1) return false;
  out = v;
  return true;
}

// Repeats for one size when --repeats is not given: enough that the median is stable for small messages, bounded
// total time (about a second per size here) for large ones.
int default_repeats(int64_t bytes) {
  const int64_t by_size = (int64_t{64} << 20) / std::max<int64_t>(bytes, 1);  // 64 MiB / bytes
  return static_cast<int>(std::clamp<int64_t>(by_size, 20, 1000));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  // Every rank parses the same arguments, so every rank reaches the same verdict; rank 0 alone reports it.
  long long max_bytes = 64LL << 20, repeats = 0;
  std::string error;
  for (int i = 1; i < argc && error.empty(); ++i) {
    const std::string a = argv[i];
    if (a == "--max-bytes" || a == "--repeats") {
      const char* v = i + 1 < argc ? argv[++i] : nullptr;
      long long n = 0;
      if (!parse_positive(v, n)) {
        error = a + " needs a positive integer, got '" + (v ? v : "") + "'";
      } else if (a == "--max-bytes") {
        if (n < 4 || n % 4 != 0 || n > (1LL << 30))  // 1 GiB: the float count stays an int
          error = "--max-bytes must be a multiple of 4 (one float) between 4 and 1 GiB, got " + std::to_string(n);
        max_bytes = n;
      } else {
        if (n > 1000000) error = "--repeats must be at most 1000000, got " + std::to_string(n);
        repeats = n;
      }
    } else {
      error = "unknown argument '" + a + "'";
    }
  }
  if (!error.empty()) {
    if (rank == 0) std::fprintf(stderr, "mpi_allreduce: %s\n%s\n", error.c_str(), kUsage);
    MPI_Finalize();
    return 2;
  }

  std::vector<float> buf(static_cast<size_t>(max_bytes / 4));
  for (int64_t bytes = 4; bytes <= max_bytes; bytes *= 2) {
    const int count = static_cast<int>(bytes / 4);
    const int reps = repeats > 0 ? static_cast<int>(repeats) : default_repeats(bytes);

    // One checked call: rank r contributes r + 1, so every element must come back as N(N+1)/2 on every rank. It
    // also warms the transport's buffers for this size.
    std::fill(buf.begin(), buf.begin() + count, static_cast<float>(rank + 1));
    MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const float want = 0.5f * static_cast<float>(ranks) * static_cast<float>(ranks + 1);
    int bad = 0;
    for (int i = 0; i < count; ++i) bad |= buf[static_cast<size_t>(i)] != want;
    int any_bad = 0;
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any_bad) {
      if (rank == 0) std::fprintf(stderr, "mpi_allreduce: wrong sum at %lld bytes\n", static_cast<long long>(bytes));
      MPI_Finalize();
      return 1;
    }

    // Zeros from here on: the sums stay 0, never overflow or go subnormal, so every repeat does the same arithmetic.
    std::fill(buf.begin(), buf.begin() + count, 0.0f);
    MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);  // warm-up
    std::vector<double> mine(static_cast<size_t>(reps)), slowest(static_cast<size_t>(reps));
    for (int r = 0; r < reps; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      mine[static_cast<size_t>(r)] = MPI_Wtime() - t0;
    }
    // The slowest rank per repeat, gathered after the loop so no extra collective sits between timed calls.
    MPI_Reduce(mine.data(), slowest.data(), reps, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      const double med = median(slowest);
      const double lo = *std::min_element(slowest.begin(), slowest.end());
      const double algbw = static_cast<double>(bytes) / med / 1e9;
      const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
      std::printf(
          "{\"ranks\":%d,\"bytes\":%lld,\"repeats\":%d,\"median_us\":%.3f,\"min_us\":%.3f,\"algbw_gbs\":%.4f,"
          "\"busbw_gbs\":%.4f}\n",
          ranks, static_cast<long long>(bytes), reps, med * 1e6, lo * 1e6, algbw, busbw);
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
