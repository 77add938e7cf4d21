// tests/mpi/test_deadline.cpp: a rank that stops answering must not hang the others (parallel.hpp, "Deadlines").
// Run on 2 ranks by test_deadline.py, which checks what follows from outside: rank 1 stops itself with SIGSTOP (and
// is never resumed), rank 0 must throw CollectiveTimeout within a few seconds of its 2 s deadline, naming itself, the
// library call and the collective, while using little CPU; then rank 0, the embedding program, ends the job with
// MPI_Abort, which must end the stopped rank too. Rank 0 prints one line, "test_deadline: ok: <the error>" or
// "test_deadline: FAIL: <why>", and aborts with status 3 either way (rank 1 never returns), so the script reads the
// verdict from that line. Modes:
//   before  rank 1 stops before ShardedKvCache::create: rank 0 times out in create's agreement;
//   during  rank 1 stops (from a timer thread) a third into computing a forward call: rank 0 times out
//           in the barrier before the all-reduce of the outputs.
#include <mpi.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/parallel.hpp"

namespace gpt2attn {
namespace {

constexpr double kDeadlineS = 2;
// Seconds rank 0 computes in the `during` call before it waits (measured there; 0 for `before`).
double compute_s = 0;

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

std::string check_message(const CollectiveTimeout& e, const std::vector<const char*>& wanted) {
  const std::string m = e.what();
  for (const char* w : wanted) {
    if (m.find(w) == std::string::npos) return std::string("the message lacks \"") + w + "\"";
  }
  if (e.rank() != 0) return "rank() is " + std::to_string(e.rank()) + ", not 0";
  if (e.deadline_s() != kDeadlineS) return "deadline_s() is " + std::to_string(e.deadline_s());
  if (e.code() != ErrorCode::internal) return "the code is not internal";
  return "";
}

// Rank 0's verdict on `call` (which must time out): "" or why not.
template <class F>
std::string expect_timeout(F&& call, double least_s, const std::vector<const char*>& wanted, std::string* message,
                           ShardedAttention& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = cpu_seconds();
  try {
    call();
    return "the call returned although rank 1 is stopped";
  } catch (const CollectiveTimeout& e) {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = cpu_seconds() - cpu0;
    *message = std::string(e.what()) + " [after " + std::to_string(wall) + " s, " + std::to_string(cpu) + " CPU s]";
    if (wall < least_s) return "gave up after " + std::to_string(wall) + " s, before the deadline";
    if (wall > least_s + compute_s + 8) {
      return "gave up after " + std::to_string(wall) + " s, long after the deadline (the call computes for " +
             std::to_string(compute_s) + " s)";
    }
    // The wait (the call's last kDeadlineS) sleeps between polls, where spinning would take a CPU second per second
    // waited: it may take a quarter of that; the compute before it (in `during`, one thread) all of its wall time.
    if (cpu > wall - kDeadlineS + 0.25 * kDeadlineS) {
      return "used " + std::to_string(cpu) + " CPU s in " + std::to_string(wall) + " s: the wait spins";
    }
    const std::string bad = check_message(e, wanted);
    if (!bad.empty()) return bad + ": " + e.what();
  } catch (const std::exception& e) {
    return std::string("threw another error: ") + e.what();
  }
  // Every later collective of the process is refused at once, naming why.
  try {
    ShardedKvCache cache(layer, {.capacity_tokens = 16});
    return "a collective after the timeout was not refused";
  } catch (const Error& e) {
    if (std::strstr(e.what(), "an earlier collective of this process passed its deadline") == nullptr) {
      return std::string("the collective after the timeout failed otherwise: ") + e.what();
    }
  }
  return "";
}

int run(const std::string& mode, int rank) {
  Config c;
  c.d_model = 512, c.num_heads = 8, c.causal = true, c.context_length = 4096;
  ShardedAttention layer = ShardedAttention::random(c, 7, MPI_COMM_WORLD, {.threads = 1}, kDeadlineS);
  std::string why, message;
  if (mode == "before") {
    ShardedKvCache cache(layer, {.capacity_tokens = 64});
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) raise(SIGSTOP);  // never resumed: mpirun's abort must end this process
    why = expect_timeout([&] { cache.create(); }, kDeadlineS,
                         {"ShardedKvCache::create: all-reduce agreeing the ranks' checks and arguments: rank 0 of 2",
                          "waited 2 s (its deadline)", "MPI_Abort"},
                         &message, layer);
  } else if (mode == "during") {
    // B x T tokens 512 wide: about 40 GFLOP, half on each rank: over a second of one thread's compute with AVX2
    // GEMMs, about 0.2 s on the Xeon VM's AVX-512 ones. Rank 1 stops a third of the way through the compute it
    // measured on the first call, so that the stop falls inside it at any speed, after the agreement, which both
    // ranks enter together after the barrier. A sanitizer build computes 20-50x slower (T = 4096 took 54 s under
    // ASan): a quarter of the tokens keep it seconds.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    const int64_t B = 2, T = 1024;
#else
    const int64_t B = 2, T = 4096;
#endif
    std::vector<float> x(static_cast<size_t>(B * T * c.d_model), 0.5f), out(x.size());
    AttentionInputs in;
    in.query = TensorView::f32(x.data(), {B, T, c.d_model});
    // The same call with both ranks answering: its time is what rank 0 computes before the wait starts, which the
    // bound on the stopped call's time must allow beside the deadline.
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    layer.forward(in, out.data());
    compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) {
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::duration<double>(compute_s / 3));
        raise(SIGSTOP);
      }).detach();
    }
    why = expect_timeout([&] { layer.forward(in, out.data()); }, kDeadlineS,
                         {"ShardedAttention::forward: barrier before the all-reduce of the outputs: rank 0 of 2",
                          "waited 2 s (its deadline)", "MPI_Abort"},
                         &message, layer);
  } else {
    why = "unknown mode '" + mode + "' (before or during)";
  }
  if (rank == 0) {
    if (why.empty()) {
      std::printf("test_deadline: ok: %s\n", message.c_str());
    } else {
      std::printf("test_deadline: FAIL: %s\n", why.c_str());
    }
    std::fflush(stdout);
  }
  return why.empty() ? 0 : 1;
}

}  // namespace
}  // namespace gpt2attn

int main(int argc, char** argv) {
  int provided = 0, rank = 0, size = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2 || argc != 2) {
    if (rank == 0) std::fprintf(stderr, "usage: mpiexec -n 2 test_deadline before|during\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  try {
    gpt2attn::run(argv[1], rank);
  } catch (const std::exception& e) {
    std::printf("test_deadline: FAIL: rank %d: %s\n", rank, e.what());
    std::fflush(stdout);
  }
  // Rank 1 is stopped inside a collective rank 0 abandoned: MPI_Finalize would wait for it forever.
  MPI_Abort(MPI_COMM_WORLD, 3);
}
