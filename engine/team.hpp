// engine/team.hpp: the OpenMP teams that the engine's loops run on, as three small helpers. bench/, tools/ and tests/
// start their teams through them too (to time, probe and flush caches on the threads the layer uses, or to play a
// server's own parallel region), so that `#pragma omp` stays in engine/; kernels/ are single-threaded. The engine's
// other regions keep their pragma beside the code they split: loops with a reduction or a size threshold
// (validate.cpp, convert.cpp, reference.cpp), and the decode step's one region of three stages (serving.cpp).
#pragma once

#include <omp.h>

#include <cstdint>
#include <exception>
#include <utility>

namespace gpt2attn::detail {

// The first exception any thread of a team throws, kept until the team has ended and then rethrown on the calling
// thread: an exception must not leave an OpenMP region (the runtime would terminate the process). keep() and
// rethrow() are compiled once, in engine/team.cpp with the baseline flags: this header is also included by files
// built for one instruction set (bench's probes), whose copy of an inline function the linker could otherwise pick
// for the whole program.
class FirstError {
 public:
  template <class F>
  void run(F&& f) noexcept {
    try {
      f();
    } catch (...) {
      keep(std::current_exception());
    }
  }
  void rethrow() const;

 private:
  void keep(std::exception_ptr e) noexcept;
  std::exception_ptr error_;
};

// Runs f(item, thread) for items [0, n) on a team of `threads`, taken dynamically one at a time (thread: 0 ..
// threads - 1, the slot of per-thread scratch). The first exception an item throws is rethrown after the loop; the
// other items still run (an OpenMP loop cannot be left early).
template <class F>
void team_for(int threads, int64_t n, F&& f) {
  FirstError error;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t item = 0; item < n; ++item) error.run([&] { f(item, omp_get_thread_num()); });
  error.rethrow();
}

// team_for, but item i always goes to thread i % team, the size OpenMP granted (schedule(static, 1)): the same call
// shape puts the same items on the same threads every time, for work whose per-thread state is keyed by the thread.
template <class F>
void team_for_round_robin(int threads, int64_t n, F&& f) {
  FirstError error;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int64_t item = 0; item < n; ++item) error.run([&] { f(item, omp_get_thread_num()); });
  error.rethrow();
}

// Runs f(thread, team) once on each thread of a team of `threads`, all of them released together by a barrier, so
// no thread's share starts before the last one is awake (a timed team: the FMA probe, the STREAM triad, a flush).
// team is the size OpenMP granted (OMP_THREAD_LIMIT may grant fewer than asked), which a share must be cut by; it is
// also returned. Exceptions as in team_for.
template <class F>
int team_run(int threads, F&& f) {
  FirstError error;
  int granted = 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    if (t == 0) granted = team;
#pragma omp barrier
    error.run([&] { f(t, team); });
  }
  error.rethrow();
  return granted;
}

// Thread t's contiguous share [begin, end) of [0, n) among `threads`, cut as OpenMP's schedule(static) cuts it: each
// n / threads, the first n % threads one more. The same cut for a first touch and the passes after it puts each
// thread on the pages it placed.
inline std::pair<int64_t, int64_t> static_share(int64_t n, int threads, int t) {
  const int64_t q = n / threads, r = n % threads;
  const int64_t begin = t * q + (t < r ? t : r);
  return {begin, begin + q + (t < r ? 1 : 0)};
}

}  // namespace gpt2attn::detail
