// Tests of the process-rank harness (tests/harness/process_ranks.h): a passing body on 3 MPI
// processes with exact results, and, through the bodies of harness_process_child.cc that fail on
// purpose, what a failing rank, a fatal assertion, a hang and a missing device are reported as.
#include "harness/process_ranks.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "device/cuda/cuda_backend.h"

#ifndef HARNESS_PROCESS_CHILD
#error "HARNESS_PROCESS_CHILD: the path of the harness_process_child binary"
#endif

namespace loom {
namespace {

using loom::testing::launch_process_ranks;
using loom::testing::run_on_process_ranks;
using namespace std::chrono_literals;

#define SKIP_WITHOUT_MPIRUN()                                                       \
  do {                                                                              \
    if (loom::testing::find_mpirun().empty()) GTEST_SKIP() << "mpirun not found";   \
  } while (0)

// Every rank r contributes r + 1 + i at element i (exact in f32 and i32); the sum over 3 ranks
// is 6 + 3i, bit for bit, on every rank.
TEST(HarnessProcessRanks, AllReduceOnThreeProcessesIsExact) {
  run_on_process_ranks(3, [](Communicator& comm) {
    ASSERT_EQ(comm.size(), 3);
    ASSERT_EQ(comm.backend(), "mpi");
    const int64_t n = 1001;
    Tensor f = Tensor::zeros({n}, DType::kF32);
    Tensor k = Tensor::zeros({n}, DType::kI32);
    for (int64_t i = 0; i < n; ++i) {
      f.data<float>()[i] = static_cast<float>(comm.rank() + 1 + i);
      k.data<int32_t>()[i] = static_cast<int32_t>(comm.rank() + 1 + i);
    }
    comm.all_reduce(f, ReduceOp::kSum);
    comm.all_reduce(k, ReduceOp::kMax);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(f.data<float>()[i], static_cast<float>(6 + 3 * i)) << "element " << i;
      ASSERT_EQ(k.data<int32_t>()[i], static_cast<int32_t>(3 + i)) << "element " << i;
    }
  });
}

TEST(HarnessProcessRanks, ThrowingRankIsReportedAndStopsTheOthers) {
  SKIP_WITHOUT_MPIRUN();
  const auto run = launch_process_ranks(3, HARNESS_PROCESS_CHILD, "ChildBodies.Rank1Throws", 30s);
  ASSERT_TRUE(run.started) << run.error;
  EXPECT_FALSE(run.timed_out) << run.output;
  EXPECT_NE(run.exit_code, 0);
  ASSERT_EQ(run.failures.size(), 1u) << run.output;
  EXPECT_NE(run.failures[0].find("rank 1 failed: boom from rank 1"), std::string::npos) << run.failures[0];
  EXPECT_NE(run.failures[0].find("harness_process_child.cc:"), std::string::npos) << run.failures[0];
  // Ranks 0 and 2 wait in a barrier with a 120 s timeout: only the abort ends them this soon
  // (the time includes starting mpirun and MPI, ~1 s here).
  EXPECT_LT(run.seconds, 10.0) << run.output;
}

TEST(HarnessProcessRanks, FatalAssertionIsReportedWithItsLocation) {
  SKIP_WITHOUT_MPIRUN();
  const auto run = launch_process_ranks(2, HARNESS_PROCESS_CHILD, "ChildBodies.Rank1AssertFails", 30s);
  ASSERT_TRUE(run.started) << run.error;
  EXPECT_FALSE(run.timed_out) << run.output;
  EXPECT_NE(run.exit_code, 0);
  ASSERT_FALSE(run.failures.empty()) << run.output;
  const std::string& f = run.failures[0];
  EXPECT_EQ(f.rfind("rank 1 failed: ", 0), 0u) << f;
  EXPECT_NE(f.find("rank one is not welcome"), std::string::npos) << f;
  EXPECT_NE(f.find("harness_process_child.cc:36)"), std::string::npos) << f;  // the ASSERT_NE
  EXPECT_LT(run.seconds, 10.0) << run.output;
}

TEST(HarnessProcessRanks, NonFatalFailureIsReportedToo) {
  SKIP_WITHOUT_MPIRUN();
  const auto run = launch_process_ranks(2, HARNESS_PROCESS_CHILD, "ChildBodies.Rank0ExpectFails", 30s);
  ASSERT_TRUE(run.started) << run.error;
  EXPECT_FALSE(run.timed_out) << run.output;
  EXPECT_NE(run.exit_code, 0);
  ASSERT_EQ(run.failures.size(), 1u) << run.output;
  EXPECT_EQ(run.failures[0].rfind("rank 0 failed: ", 0), 0u) << run.failures[0];
  EXPECT_NE(run.failures[0].find("rank zero is off by one"), std::string::npos) << run.failures[0];
  EXPECT_NE(run.failures[0].find("harness_process_child.cc:"), std::string::npos) << run.failures[0];
}

TEST(HarnessProcessRanks, TimeoutKillsEveryRank) {
  SKIP_WITHOUT_MPIRUN();
  const auto run = launch_process_ranks(2, HARNESS_PROCESS_CHILD, "ChildBodies.Hangs", 3s);
  ASSERT_TRUE(run.started) << run.error;
  EXPECT_TRUE(run.timed_out) << run.output;
  EXPECT_FALSE(run.passed());
  // 3 s, then SIGTERM, SIGKILL a second later; the output pipe closes only when every rank is gone.
  EXPECT_TRUE(run.output_closed) << "a rank outlived the timeout";
  EXPECT_LT(run.seconds, 7.0);
}

TEST(HarnessProcessRanks, TestNeedingMoreDevicesIsSkippedNotPassed) {
  EXPECT_FALSE(loom::testing::cuda_devices_missing(cuda::device_count() + 1).empty());
  EXPECT_TRUE(loom::testing::cuda_devices_missing(0).empty());
  const std::string cmd = std::string(HARNESS_PROCESS_CHILD) +
                          " --gtest_filter=ChildBodies.NeedsMoreDevicesThanExist --gtest_color=no 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("[  SKIPPED ] ChildBodies.NeedsMoreDevicesThanExist"), std::string::npos) << out;
  EXPECT_NE(out.find("needs "), std::string::npos) << out;
  EXPECT_EQ(out.find("[       OK ]"), std::string::npos) << out;
}

}  // namespace
}  // namespace loom
