// One rank skips a collective: the others' wait() throws CommError naming the operation, its
// sequence number, the group and the rank that did not arrive, within the timeout. The late
// rank then issues it, so the pending operation completes and the job ends cleanly.
#include <gtest/gtest.h>

#include "comm/mpi/mpi_backend.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

TEST(MpiTimeout, SkippedCollectiveFailsTheOthersWithinTheTimeout) {
  CommOptions patient, impatient;
  patient.timeout = 30s;
  impatient.timeout = 1s;
  auto world = make_mpi_world(patient);
  if (world->size() == 1) GTEST_SKIP() << "needs two ranks";
  // The skipped collective runs on a group of its own, so the world stays in step.
  auto group = make_mpi_world(impatient)->split(0, world->rank());
  const int skipper = world->size() - 1;
  Tensor t = Tensor::from_vector({1, 2, 3, 4}, {4});
  WorkHandle pending;
  if (world->rank() != skipper) {
    pending = group->all_reduce_async(t, ReduceOp::kSum);
    const auto start = std::chrono::steady_clock::now();
    try {
      pending->wait();
      FAIL() << "expected a timeout";
    } catch (const CommError& e) {
      const auto elapsed = std::chrono::steady_clock::now() - start;
      EXPECT_GE(elapsed, 1s);
      EXPECT_LT(elapsed, 5s);
      const std::string message = e.what();
      for (const char* part : {"timed out after 1000 ms", "all_reduce #0", "world/split(color=0)",
                               "size ", "did not arrive"}) {
        EXPECT_NE(message.find(part), std::string::npos)
            << "'" << part << "' missing from: " << message;
      }
      EXPECT_NE(message.find("size " + std::to_string(world->size())), std::string::npos)
          << message;
      // The arrival board names the rank that skipped it (all ranks are on this node).
      EXPECT_NE(message.find("rank(s) " + std::to_string(skipper) + " did not arrive"),
                std::string::npos)
          << message;
    }
  }
  world->barrier();  // the skipper waits here until the others timed out
  if (world->rank() == skipper) {
    group->all_reduce(t);  // arrives late
  } else {
    pending->wait();  // and the pending operation completes
  }
  const float n = static_cast<float>(world->size());
  EXPECT_EQ(t.to_vector(), (std::vector<float>{n, 2 * n, 3 * n, 4 * n}));
}

}  // namespace
}  // namespace loom
