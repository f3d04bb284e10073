#include "harness/thread_ranks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/local/local_backend.h"

namespace loom::testing {

std::vector<RankResult> run_ranks_collect(int ranks, const std::function<void(Communicator&)>& body,
                                          CommOptions options, std::chrono::seconds test_timeout) {
  std::vector<std::unique_ptr<Communicator>> world = make_local_world(ranks, options);
  auto& abort_target = dynamic_cast<LocalCommunicator&>(*world[0]);
  std::vector<RankResult> results(ranks);
  int failures = 0;
  std::mutex mutex;
  std::condition_variable done_cv;
  int done = 0;

  auto record = [&](int r, bool ok, const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      results[r].ok = ok;
      results[r].error = error;
      results[r].finished = true;
      if (!ok) results[r].failure_order = failures++;
      ++done;
    }
    done_cv.notify_all();
    if (!ok) abort_target.abort("rank " + std::to_string(r) + " failed: " + error);
  };

  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      SCOPED_TRACE("rank " + std::to_string(r));
      const bool had_fatal = ::testing::Test::HasFatalFailure();
      try {
        body(*world[r]);
      } catch (const std::exception& e) {
        return record(r, false, e.what());
      } catch (...) {
        return record(r, false, "unknown exception");
      }
      // An ASSERT_* in the body returns early: treat it as this rank failing. (gtest's flag is
      // per test, not per thread: another rank's fatal failure can be attributed here too.)
      if (!had_fatal && ::testing::Test::HasFatalFailure())
        return record(r, false, "a fatal gtest assertion failed (see above)");
      record(r, true, "");
    });
  }

  std::vector<int> unfinished;  // when the test timeout expired
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!done_cv.wait_for(lock, test_timeout, [&] { return done == ranks; })) {
      for (int r = 0; r < ranks; ++r) {
        if (!results[r].finished) unfinished.push_back(r);
      }
    }
  }
  if (!unfinished.empty()) {
    abort_target.abort("test timed out after " + std::to_string(test_timeout.count()) + " s");
  }
  for (auto& t : threads) t.join();  // ranks blocked in communication wake up from the abort
  for (int r : unfinished) {
    results[r] = {false, false, results[r].failure_order,
                  "did not finish within the test timeout of " +
                      std::to_string(test_timeout.count()) + " s (then: " + results[r].error + ")"};
  }
  return results;
}

void run_on_thread_ranks(int ranks, const std::function<void(Communicator&)>& body,
                         CommOptions options, std::chrono::seconds test_timeout) {
  std::vector<RankResult> results = run_ranks_collect(ranks, body, options, test_timeout);
  std::vector<int> failed;  // the cause first
  for (int r = 0; r < ranks; ++r) {
    if (!results[r].ok) failed.push_back(r);
  }
  std::sort(failed.begin(), failed.end(),
            [&](int a, int b) { return results[a].failure_order < results[b].failure_order; });
  for (int r : failed) ADD_FAILURE() << "rank " << r << " failed: " << results[r].error;
}

}  // namespace loom::testing
