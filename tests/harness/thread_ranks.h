// Multi-rank test harness: runs a test body on N thread-ranks of a local world (issue 3).
//
//   run_on_thread_ranks(4, [](Communicator& comm) { ... EXPECT_EQ(...) ... });
//
// Each rank runs on its own thread with its own communicator. When a rank throws (or returns
// after a fatal gtest assertion), the world is aborted, so the other ranks stop within
// milliseconds instead of waiting for the communication timeout, and the harness reports
// "rank R failed: <message>" as a test failure on the main thread. EXPECT_* failures in rank
// threads are recorded by gtest itself (thread-safe on pthreads), each tagged "rank R" by a
// per-thread SCOPED_TRACE. A whole-test timeout reports the ranks that did not finish.
//
// Forked-process ranks over the mpi backend: process_ranks.h. Device requirements: devices.h.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "harness/devices.h"  // LOOM_SKIP_UNLESS_CUDA_DEVICES

namespace loom::testing {

// The outcome of one rank: ok, or the message of what it threw.
struct RankResult {
  bool ok = true;
  bool finished = false;   // false: still running when the test timeout expired
  int failure_order = -1;  // 0 for the first rank to fail (the cause), 1 for the next...
  std::string error;
};

// Runs body on `ranks` thread-ranks and returns each rank's result, adding no test failure:
// for tests that expect ranks to fail. A rank that throws aborts the world with reason
// "rank R failed: <what>".
std::vector<RankResult> run_ranks_collect(
    int ranks, const std::function<void(Communicator&)>& body, CommOptions options = {},
    std::chrono::seconds test_timeout = std::chrono::seconds(60));

// Runs body on `ranks` thread-ranks; every failing rank becomes a test failure on the calling
// thread, the first failure (the cause) first.
void run_on_thread_ranks(int ranks, const std::function<void(Communicator&)>& body,
                         CommOptions options = {},
                         std::chrono::seconds test_timeout = std::chrono::seconds(60));

}  // namespace loom::testing
