// engine/team.hpp: the engine's own thread team, which every parallel loop of a call runs on. bench/, tools/ and
// tests/ start their teams through it too (to time, probe and flush caches on the threads the layer uses, or to play
// a server's own threads); kernels/ are single-threaded.
//
// Why not OpenMP's team: a server shares its cores. libgomp's default waits spin about 300,000 iterations at every
// barrier and after every region (5-9 ms of a core on a 2-vCPU VM) before sleeping, and the process cannot change
// that once libgomp has read OMP_WAIT_POLICY; a spinning thread keeps its core while its partner waits for a core
// another process holds, so a decode step beside a one-core busy loop took 3-7x its quiet time. This team spins only
// briefly (kStageSpin inside a region, kIdleSpin between regions), then sleeps on a futex; it hands out work
// item by item to whichever thread is running, and a thread that is late for a region does not hold up its end: it
// finds the region closed and waits for the next one (bench/busy_machine.py measures this). oneDNN's GEMMs run on
// the team's threads, each single-threaded (ScopedOmpThreads(1)), so libgomp starts no team of its own on a call.
//
// Each calling thread has a team of its own (kept, like libgomp's, for the thread's life): several server threads
// each calling with their own Workspace run on disjoint threads. A region started from inside a region (a call made
// by a team thread, run_on_threads' f calling the layer) runs on that one thread, as OpenMP runs nested regions.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

namespace gpt2attn::detail {

// What a region runs: stages of items, stage s holding items [starts[s], starts[s + 1]) of the global count; every
// item of a stage ends before any item of the next begins; items are taken one at a time by whichever thread is
// free. With `each`, there is one stage of `team` items and thread t runs item t, after every thread has arrived.
struct RegionWork {
  const int64_t* starts = nullptr;  // stages + 1 prefix sums
  int stages = 0;
  bool each = false;
  void (*call)(void* f, int stage, int64_t item, int thread, int team) = nullptr;
  void* f = nullptr;
};

// Runs `work` on a team of `threads` (the caller is thread 0); returns the team's size. The first exception an item
// throws is rethrown here once the region has ended; after it, the items not yet started are skipped.
int run_region(int threads, const RegionWork& work);
// Runs `work` on the calling thread alone, items in order (a region of one thread); the first exception ends it.
int run_serial(const RegionWork& work);

// Runs f(item, thread) for items [0, n) on a team of `threads`, taken dynamically one at a time (thread: 0 ..
// threads - 1, the slot of per-thread scratch and of ExecContext's primitives).
template <class F>
void team_for(int threads, int64_t n, F&& f) {
  using Fn = std::remove_reference_t<F>;
  const int64_t starts[2] = {0, n};
  RegionWork w;
  w.starts = starts, w.stages = 1;
  w.call = [](void* p, int, int64_t item, int thread, int) { (*static_cast<Fn*>(p))(item, thread); };
  w.f = const_cast<void*>(static_cast<const void*>(&f));
  run_region(threads, w);
}

// Stages in order, stage s holding counts[s] items: f(stage, item, thread). All of stage s's items end before any of
// stage s + 1's begin, and the threads that finish a stage early take the next one's items (one region, where a
// team_for per stage would start the team again for each).
template <class F>
void team_stages(int threads, std::initializer_list<int64_t> counts, F&& f) {
  using Fn = std::remove_reference_t<F>;
  constexpr int kMaxStages = 8;
  int64_t starts[kMaxStages + 1] = {0};
  int stages = 0;
  for (int64_t c : counts) {
    if (stages == kMaxStages) break;
    starts[stages + 1] = starts[stages] + c;
    ++stages;
  }
  RegionWork w;
  w.starts = starts, w.stages = stages;
  w.call = [](void* p, int stage, int64_t item, int thread, int) { (*static_cast<Fn*>(p))(stage, item, thread); };
  w.f = const_cast<void*>(static_cast<const void*>(&f));
  run_region(threads, w);
}

// Runs f(thread, team) once on each thread of a team of `threads`, all of them released together, so no thread's
// share starts before the last one is awake (a timed team: the FMA probe, the STREAM triad, a flush; first touch).
// Returns the team's size: `threads`, or 1 for a region started inside a region.
template <class F>
int team_run(int threads, F&& f) {
  using Fn = std::remove_reference_t<F>;
  RegionWork w;
  w.each = true, w.stages = 1;
  w.call = [](void* p, int, int64_t, int thread, int team) { (*static_cast<Fn*>(p))(thread, team); };
  w.f = const_cast<void*>(static_cast<const void*>(&f));
  return run_region(threads, w);
}

// Thread t's contiguous share [begin, end) of [0, n) among `threads`: each n / threads, the first n % threads one
// more. The same cut for a first touch and the passes after it puts each thread on the pages it placed.
inline std::pair<int64_t, int64_t> static_share(int64_t n, int threads, int t) {
  const int64_t q = n / threads, r = n % threads;
  const int64_t begin = t * q + (t < r ? t : r);
  return {begin, begin + q + (t < r ? 1 : 0)};
}

}  // namespace gpt2attn::detail
