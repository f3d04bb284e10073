// main() of the MPI test binaries, run under mpirun: initialises MPI through make_mpi_world,
// prints gtest's output on rank 0 only, prints the failures of the other ranks prefixed with
// their rank, and aborts the whole job (MPI_Abort) after the first failed test on any rank: the
// ranks' collectives are then out of step, and going on would hang instead of failing.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "comm/mpi/mpi_backend.h"

namespace {

class AbortOnFailure : public ::testing::EmptyTestEventListener {
 public:
  AbortOnFailure(int rank, bool print_failures) : rank_(rank), print_failures_(print_failures) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed() || !print_failures_) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s.%s: aborting the job\n", rank_,
                 info.test_suite_name(), info.name());
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  int rank_;
  bool print_failures_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = loom::make_mpi_world()->rank();  // initialises MPI (finalised at exit)
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new AbortOnFailure(rank, /*print_failures=*/rank != 0));
  return RUN_ALL_TESTS();
}
