// tests/test_team.cpp: engine/team.hpp, the helpers every OpenMP team of the project starts through: each item runs
// once, round robin keeps item i on thread i % team, a team's shares cut [0, n) exactly, and an exception thrown
// on any thread comes back to the caller instead of ending the process.
#include "engine/team.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace gpt2attn::detail {
namespace {

TEST(Team, EveryItemRunsOnceOnAThreadOfTheTeam) {
  for (int threads : {1, 2, 3}) {
    for (int64_t n : {0, 1, 7, 100}) {
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

TEST(Team, RoundRobinPutsItemIOnThreadIModTheTeam) {
  const int threads = 2;
  const int64_t n = 9;
  std::vector<int> on(static_cast<size_t>(n), -1);
  const int granted = team_run(threads, [](int, int) {});
  team_for_round_robin(threads, n, [&](int64_t item, int t) { on[static_cast<size_t>(item)] = t; });
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(on[static_cast<size_t>(i)], static_cast<int>(i % granted)) << "item " << i;
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

TEST(Team, RunStartsEveryThreadOfTheTeamOnce) {
  std::vector<std::atomic<int>> ran(4);
  const int team = team_run(4, [&](int t, int) { ran[static_cast<size_t>(t)].fetch_add(1); });
  ASSERT_GE(team, 1);
  ASSERT_LE(team, 4);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(ran[static_cast<size_t>(t)].load(), t < team ? 1 : 0) << "thread " << t;
}

TEST(Team, AnExceptionOnAnyThreadReachesTheCaller) {
  std::atomic<int> ran{0};
  EXPECT_THROW(team_for(2, 10, [&](int64_t item, int) {
                 ran.fetch_add(1);
                 if (item == 7) throw std::runtime_error("item 7");
               }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 10);  // the other items still ran
  EXPECT_THROW(team_for_round_robin(2, 10, [](int64_t item, int) { if (item == 3) throw std::runtime_error("3"); }),
               std::runtime_error);
  EXPECT_THROW(team_run(2, [](int t, int team) { if (t == team - 1) throw std::runtime_error("last"); }),
               std::runtime_error);
  // The team is usable afterwards.
  std::atomic<int> count{0};
  team_for(2, 5, [&](int64_t, int) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 5);
}

}  // namespace
}  // namespace gpt2attn::detail
