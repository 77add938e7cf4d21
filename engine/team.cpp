// engine/team.cpp: the engine's thread team (engine/team.hpp): a pool per calling thread, regions of dynamic items
// in stages, bounded spins then futex sleeps; and the public run_on_threads over team_run.
#include "engine/team.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "engine/linear.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/options.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GPT2ATTN_PAUSE() _mm_pause()
#else
#define GPT2ATTN_PAUSE() ((void)0)
#endif

namespace gpt2attn {

int run_on_threads(int threads, const std::function<void(int thread, int team)>& f) {
  if (threads < 1 || threads > max_threads()) {
    invalid("run_on_threads: threads = " + std::to_string(threads) + " (must be 1.." +
                    std::to_string(max_threads()) + ")");
  }
  return detail::team_run(threads, f);
}

}  // namespace gpt2attn

namespace gpt2attn::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How long a thread spins before it sleeps. Inside a region, a thread that finds a stage's items all taken waits for
// the others' last ones: about one item, so it spins up to twice the longest item it ran itself in this region (at
// least kStageSpin, at most kMaxStageSpin); a partner that lost its core takes far longer, and past the spin sleeping
// gives the core to whoever needs it. A sleep is dear on a VM: waking a halted vCPU cost 150-270 us on the 2-vCPU Zen 3
// VM, and with a fixed 50 us spin a gpt2-small decode step of B=16 over 1024 tokens (attention items of ~1 ms) slept
// at both stage ends and ran 8% slower than on libgomp's spinning team (bench/ab.py, 5 rounds). Between regions,
// kIdleSpin keeps the team awake across back-to-back calls and a call's consecutive regions, while a thread left
// spinning beside a busy process wastes at most that much of the core it holds (libgomp's default spin wasted 5-9 ms
// after each region: bench/busy_machine.py).
constexpr Clock::duration kStageSpin = std::chrono::microseconds(50);
constexpr Clock::duration kMaxStageSpin = std::chrono::microseconds(1000);
constexpr Clock::duration kIdleSpin = std::chrono::microseconds(200);

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Spins up to `spin` for done(), then sleeps on `word` until done(). Whoever makes done() true then bumps `word` and,
// when `sleepers` is not zero, wakes it (wake()). The order (sleepers up, read word, test, sleep) against the waker's
// (make done, bump word, read sleepers), all sequentially consistent, loses no wake-up.
template <class Done>
void wait_until(Done&& done, std::atomic<uint32_t>& word, std::atomic<int>& sleepers, Clock::duration spin) {
  if (done()) return;
  const Clock::time_point until = Clock::now() + spin;
  for (int i = 1;; ++i) {
    GPT2ATTN_PAUSE();
    if (done()) return;
    if (i % 64 == 0 && Clock::now() >= until) break;
  }
  for (;;) {
    sleepers.fetch_add(1);
    const uint32_t w = word.load();
    if (done()) {
      sleepers.fetch_sub(1);
      return;
    }
    futex_wait(word, w);
    sleepers.fetch_sub(1);
    if (done()) return;
  }
}

void wake(std::atomic<uint32_t>& word, std::atomic<int>& sleepers) {
  word.fetch_add(1);
  if (sleepers.load() > 0) futex_wake(word);
}

// One region in flight, on its caller's stack; the pool's gate keeps it alive while any worker is inside.
struct Region {
  const RegionWork* work;
  int team;
  uint32_t epoch;
  int64_t total;
  std::atomic<int64_t> next{0};  // the next item to take
  std::atomic<int64_t> done{0};  // items ended (or skipped after an error)
  std::atomic<int> arrived{0};   // `each`: threads in so far
  std::atomic<uint32_t> word{0};
  std::atomic<int> sleepers{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;

  int stage_of(int64_t g) const {
    int s = 0;
    while (g >= work->starts[s + 1]) ++s;
    return s;
  }

  // Runs an item and keeps the longest one this thread ran (`longest`), which its waits spin for.
  void run_item(int stage, int64_t item, int thread, Clock::duration& longest) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      const Clock::time_point t0 = Clock::now();
      work->call(work->f, stage, item, thread, team);
      longest = std::max(longest, Clock::now() - t0);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }

  static Clock::duration spin_for(Clock::duration longest) {
    return std::clamp(2 * longest, kStageSpin, kMaxStageSpin);
  }

  // Thread `thread`'s part: items until none is left, each stage's after the stage before has ended. Returns the
  // longest item it ran.
  Clock::duration take_part(int thread) {
    Clock::duration longest{0};
    if (work->each) {
      if (arrived.fetch_add(1) + 1 == team) wake(word, sleepers);
      wait_until([&] { return arrived.load() == team; }, word, sleepers, kStageSpin);
      run_item(0, thread, thread, longest);
      if (done.fetch_add(1) + 1 == team) wake(word, sleepers);
      return longest;
    }
    for (;;) {
      const int64_t g = next.fetch_add(1, std::memory_order_relaxed);
      if (g >= total) return longest;
      const int s = stage_of(g);
      const int64_t stage_begin = work->starts[s];
      if (s > 0) wait_until([&] { return done.load() >= stage_begin; }, word, sleepers, spin_for(longest));
      run_item(s, g - stage_begin, thread, longest);
      if (done.fetch_add(1) + 1 == work->starts[s + 1]) wake(word, sleepers);  // the stage's (or region's) end
    }
  }
};

thread_local bool t_in_region = false;  // a worker always; a caller while its region runs

// The team of one calling thread: workers 1..n-1, started as regions need them, kept until the thread ends.
class Pool {
 public:
  ~Pool() {
    stop_.store(true);
    wake(epoch_, sleepers_);
    for (std::thread& t : workers_) t.join();
  }

  // The gate: (team << 16) | workers inside. A worker enters only while team > its index; the caller closes it
  // (team 0) when every item has ended, and returns once the last worker inside has left.
  static constexpr uint32_t kInside = 0xFFFF;

  int run(int threads, const RegionWork& work) {
    grow(threads - 1);
    Region r;
    r.work = &work;
    r.team = threads;
    r.total = work.each ? threads : work.starts[work.stages];
    r.epoch = epoch_.load(std::memory_order_relaxed) + 1;
    region_.store(&r, std::memory_order_relaxed);
    gate_.store(static_cast<uint32_t>(threads) << 16);
    wake(epoch_, sleepers_);  // epoch_ becomes r.epoch

    t_in_region = true;
    const Clock::duration longest = r.take_part(0);
    wait_until([&] { return r.done.load() >= r.total; }, r.word, r.sleepers, Region::spin_for(longest));
    gate_.fetch_and(kInside);  // closed: a worker that has not entered by now stays out
    wait_until([&] { return (gate_.load() & kInside) == 0; }, left_, left_sleepers_, kStageSpin);
    t_in_region = false;
    region_.store(nullptr, std::memory_order_relaxed);
    if (r.error) std::rethrow_exception(r.error);
    return threads;
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      const int index = static_cast<int>(workers_.size()) + 1;
      // The epoch before the region that needs it is published: the new thread sees that region's as a change.
      const uint32_t seen = epoch_.load();
      try {
        workers_.emplace_back([this, index, seen] { work(index, seen); });
      } catch (const std::system_error& e) {
        fail(ErrorCode::out_of_memory, "team: could not start thread " + std::to_string(index) + ": " + e.what());
      }
    }
  }

  void work(int index, uint32_t seen) {
    t_in_region = true;
    // oneDNN's GEMMs on this thread run single-threaded: a team of one starts no OpenMP team.
    ScopedOmpThreads one(1);
    for (;;) {
      wait_until([&] { return epoch_.load() != seen || stop_.load(); }, epoch_, sleepers_, kIdleSpin);
      if (stop_.load()) return;
      seen = epoch_.load();
      uint32_t g = gate_.load();
      bool entered = false;
      while ((g >> 16) > static_cast<uint32_t>(index)) {
        if (gate_.compare_exchange_weak(g, g + 1)) {
          entered = true;
          break;
        }
      }
      if (!entered) continue;
      Region& r = *region_.load(std::memory_order_relaxed);
      seen = r.epoch;  // the region entered, which may be later than the epoch that woke this thread
      r.take_part(index);
      if (gate_.fetch_sub(1) - 1 == 0) wake(left_, left_sleepers_);  // the last one out of a closed region
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<uint32_t> gate_{0};
  std::atomic<uint32_t> left_{0};  // bumped by the last worker out of a closed region
  std::atomic<int> left_sleepers_{0};
  std::atomic<Region*> region_{nullptr};
  std::atomic<bool> stop_{false};
};

}  // namespace

int run_region(int threads, const RegionWork& work) {
  const int64_t total = work.each ? threads : work.starts[work.stages];
  if (threads <= 1 || t_in_region || (!work.each && total <= 1)) return run_serial(work);
  thread_local std::unique_ptr<Pool> pool;
  if (!pool) pool = std::make_unique<Pool>();
  return pool->run(threads, work);
}

}  // namespace gpt2attn::detail
