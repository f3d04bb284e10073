#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <thread>
#include <vector>

namespace loom {
namespace {

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int threads : {1, 2, 3, 4}) {
    ThreadPool pool(threads);
    std::vector<int> hits(1000, 0);
    pool.parallel_for(1000, 7, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int h : hits) ASSERT_EQ(h, 1) << "threads=" << threads;
  }
}

TEST(ThreadPool, RangesAreAFunctionOfSizeOnly) {
  ThreadPool pool(3);
  std::vector<std::pair<int64_t, int64_t>> a(3, {-1, -1}), b(3, {-1, -1});
  for (auto* out : {&a, &b}) {
    pool.parallel_for(100, 1, [&](int64_t begin, int64_t end) {
      (*out)[(begin * 3 + 99) / 100] = {begin, end};  // begins are 0, 33, 66
    });
  }
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[0].first, 0);
  EXPECT_EQ(a[2].second, 100);
}

TEST(ThreadPool, GrainLimitsParts) {
  ThreadPool pool(4);
  std::atomic<int> calls{0};
  pool.parallel_for(10, 8, [&](int64_t, int64_t) { calls++; });
  EXPECT_EQ(calls.load(), 2);
}

TEST(ThreadPool, ParallelTasksRunsEachTaskOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(257);
  pool.parallel_tasks(257, [&](int64_t t) { hits[t]++; });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e) {
    pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { sum += (e2 - b2) * (e - b); });
  });
  EXPECT_EQ(sum.load(), 40);
}

TEST(ThreadPool, ManyPoolsInManyThreads) {
  // Thread ranks each own a pool: pools must not interfere.
  std::vector<std::thread> ranks;
  std::vector<int64_t> sums(4, 0);
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([r, &sums] {
      ThreadPool pool(2);
      std::vector<int64_t> part(2, 0);
      for (int rep = 0; rep < 50; ++rep)
        pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) {
          int64_t s = 0;
          for (int64_t i = b; i < e; ++i) s += i;
          part[b == 0 ? 0 : 1] += s;
        });
      sums[r] = part[0] + part[1];
    });
  }
  for (auto& t : ranks) t.join();
  for (int64_t s : sums) EXPECT_EQ(s, 50 * 999 * 1000 / 2);
}

}  // namespace
}  // namespace loom
