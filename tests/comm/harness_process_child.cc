// Test bodies that fail on purpose, run only by harness_process_test.cc (through
// launch_process_ranks or directly) to check what the process-rank harness reports. Not
// registered with CTest: each of these tests fails or hangs by design.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "base/error.h"
#include "device/cuda/cuda_backend.h"
#include "harness/process_ranks.h"

namespace loom {
namespace {

using loom::testing::run_on_process_ranks;

// Rank 1 throws after one collective; ranks 0 and 2 then wait in a barrier that rank 1 never
// joins (a 120 s communication timeout): only the abort stops them quickly.
TEST(ChildBodies, Rank1Throws) {
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  run_on_process_ranks(3, [](Communicator& comm) {
    Tensor t = Tensor::from_vector({1.0f}, {1});
    comm.all_reduce(t, ReduceOp::kSum);
    if (comm.rank() == 1) fail("boom from rank 1");
    comm.barrier();
  }, options);
}

// Rank 1's ASSERT fails: the report names the assertion's file:line.
TEST(ChildBodies, Rank1AssertFails) {
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  run_on_process_ranks(2, [](Communicator& comm) {
    ASSERT_NE(comm.rank(), 1) << "rank one is not welcome";
    comm.barrier();
  }, options);
}

// Rank 0's EXPECT fails (not fatal): the body goes on, then the rank reports and aborts.
TEST(ChildBodies, Rank0ExpectFails) {
  run_on_process_ranks(2, [](Communicator& comm) {
    if (comm.rank() == 0) {
      EXPECT_EQ(comm.rank() + 40, 41) << "rank zero is off by one";
    }
    comm.barrier();
  });
}

// Rank 0 sleeps far beyond the test timeout the driver gives.
TEST(ChildBodies, Hangs) {
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  run_on_process_ranks(2, [](Communicator& comm) {
    if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(100));
    comm.barrier();
  }, options);
}

// Needs one GPU more than there are: must be reported as skipped, not passed.
TEST(ChildBodies, NeedsMoreDevicesThanExist) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(cuda::device_count() + 1);
  FAIL() << "ran although it needs more devices than exist";
}

}  // namespace
}  // namespace loom
