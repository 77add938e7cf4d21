// tests/test_team.cpp: engine/team.hpp, the engine's own thread team: each item runs once on a thread of the team,
// a stage's items all end before the next stage's begin, team_run starts every thread once, a region started inside
// a region runs on its thread, callers on several threads each get a team of their own, thousands of regions of
// changing sizes neither lose an item nor hang (run under ThreadSanitizer by scripts/tsan.sh), a team's shares cut
// [0, n) exactly, and an exception thrown on any thread comes back to the caller.
#include "engine/team.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

namespace gpt2attn::detail {
namespace {

TEST(Team, EveryItemRunsOnceOnAThreadOfTheTeam) {
  for (int threads : {1, 2, 3, 4}) {
    for (int64_t n : {0, 1, 7, 100, 1000}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      std::atomic<int> bad_thread{0};
      team_for(threads, n, [&](int64_t item, int t) {
        runs[static_cast<size_t>(item)].fetch_add(1);
        if (t < 0 || t >= threads) bad_thread.fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[static_cast<size_t>(i)].load(), 1) << "item " << i;
      EXPECT_EQ(bad_thread.load(), 0);
    }
  }
}

// Every item of a stage ends before any item of the next one begins; empty stages are passed over.
TEST(Team, StagesRunInOrder) {
  for (int threads : {1, 2, 4}) {
    const std::vector<int64_t> counts = {5, 0, 17, 1, 3};
    std::atomic<int64_t> clock{0};
    std::vector<std::vector<int64_t>> began(counts.size()), ended(counts.size());
    for (size_t s = 0; s < counts.size(); ++s) {
      began[s].assign(static_cast<size_t>(counts[s]), -1);
      ended[s].assign(static_cast<size_t>(counts[s]), -1);
    }
    team_stages(threads, {5, 0, 17, 1, 3}, [&](int stage, int64_t item, int t) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, threads);
      began[static_cast<size_t>(stage)][static_cast<size_t>(item)] = clock.fetch_add(1);
      std::this_thread::yield();
      ended[static_cast<size_t>(stage)][static_cast<size_t>(item)] = clock.fetch_add(1);
    });
    int64_t last_end = -1;
    for (size_t s = 0; s < counts.size(); ++s) {
      if (counts[s] == 0) continue;
      int64_t first_begin = INT64_MAX, stage_end = -1;
      for (int64_t i = 0; i < counts[s]; ++i) {
        ASSERT_GE(began[s][static_cast<size_t>(i)], 0) << "stage " << s << " item " << i << " never ran";
        first_begin = std::min(first_begin, began[s][static_cast<size_t>(i)]);
        stage_end = std::max(stage_end, ended[s][static_cast<size_t>(i)]);
      }
      EXPECT_GT(first_begin, last_end) << "stage " << s << " began before the stage before it ended";
      last_end = stage_end;
    }
  }
}

TEST(Team, RunStartsEveryThreadOfTheTeamOnce) {
  std::vector<std::atomic<int>> ran(4);
  std::atomic<int> in{0};
  std::atomic<int> saw_all{0};
  const int team = team_run(4, [&](int t, int n) {
    ran[static_cast<size_t>(t)].fetch_add(1);
    in.fetch_add(1);
    // Released together: every thread is running, so each sees all of them arrive.
    while (in.load() < n) std::this_thread::yield();
    saw_all.fetch_add(1);
  });
  ASSERT_EQ(team, 4);
  EXPECT_EQ(saw_all.load(), 4);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(ran[static_cast<size_t>(t)].load(), 1) << "thread " << t;
}

// A region started from inside a region runs there, on its one thread, as OpenMP runs a nested region.
TEST(Team, ARegionInsideARegionRunsOnItsThread) {
  std::atomic<int> inner_items{0}, bad{0};
  team_for(2, 4, [&](int64_t, int) {
    const std::thread::id here = std::this_thread::get_id();
    team_for(3, 5, [&](int64_t, int t) {
      inner_items.fetch_add(1);
      if (t != 0 || std::this_thread::get_id() != here) bad.fetch_add(1);
    });
    if (team_run(3, [](int, int) {}) != 1) bad.fetch_add(1);
  });
  EXPECT_EQ(inner_items.load(), 20);
  EXPECT_EQ(bad.load(), 0);
}

// Callers on their own threads run regions at once, each on a team of its own, and thousands of regions of changing
// sizes and stages, most too short for every thread to join, lose no item and end.
TEST(Team, ManyRegionsFromSeveralCallers) {
  constexpr int kCallers = 3, kRegions = 2000;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      std::vector<int> hits(64);
      for (int r = 0; r < kRegions; ++r) {
        const int threads = 1 + (r + c) % 4;
        const int64_t n = (r * 7 + c) % 40;
        for (int& h : hits) h = 0;
        if (r % 3 == 0) {
          team_stages(threads, {n, 3, n / 2}, [&](int stage, int64_t item, int) {
            std::atomic_ref<int>(hits[static_cast<size_t>(stage == 0 ? item : stage == 1 ? 40 + item : 43 + item)])
                .fetch_add(1);
          });
          for (int64_t i = 0; i < n; ++i) wrong += hits[static_cast<size_t>(i)] != 1;
          for (int64_t i = 40; i < 43; ++i) wrong += hits[static_cast<size_t>(i)] != 1;
          for (int64_t i = 0; i < n / 2; ++i) wrong += hits[static_cast<size_t>(43 + i)] != 1;
        } else {
          team_for(threads, n, [&](int64_t item, int) { std::atomic_ref<int>(hits[static_cast<size_t>(item)]).fetch_add(1); });
          for (int64_t i = 0; i < n; ++i) wrong += hits[static_cast<size_t>(i)] != 1;
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Team, StaticSharesCutTheRangeExactlyAndEvenly) {
  for (int threads : {1, 2, 3, 7}) {
    for (int64_t n : {0, 1, 6, 7, 1000, 1001}) {
      int64_t next = 0;
      for (int t = 0; t < threads; ++t) {
        const auto [begin, end] = static_share(n, threads, t);
        EXPECT_EQ(begin, next) << "n " << n << " threads " << threads << " t " << t;
        EXPECT_GE(end - begin, n / threads);
        EXPECT_LE(end - begin, n / threads + 1);
        next = end;
      }
      EXPECT_EQ(next, n) << "n " << n << " threads " << threads;
    }
  }
}

TEST(Team, AnExceptionOnAnyThreadReachesTheCaller) {
  for (int threads : {1, 2}) {
    std::atomic<int> ran{0};
    EXPECT_THROW(team_for(threads, 10, [&](int64_t item, int) {
                   ran.fetch_add(1);
                   if (item == 7) throw std::runtime_error("item 7");
                 }),
                 std::runtime_error);
    EXPECT_GE(ran.load(), 8);  // items 0..7 at least; those not begun by then are skipped
    EXPECT_THROW(team_stages(threads, {2, 2}, [](int stage, int64_t, int) {
                   if (stage == 0) throw std::runtime_error("stage 0");
                   ADD_FAILURE() << "a stage after a failed one ran";
                 }),
                 std::runtime_error);
    EXPECT_THROW(team_run(threads, [](int t, int team) { if (t == team - 1) throw std::runtime_error("last"); }),
                 std::runtime_error);
    // The team is usable afterwards.
    std::atomic<int> count{0};
    team_for(threads, 5, [&](int64_t, int) { count.fetch_add(1); });
    EXPECT_EQ(count.load(), 5);
  }
}

}  // namespace
}  // namespace gpt2attn::detail
