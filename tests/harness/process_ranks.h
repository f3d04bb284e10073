// Multi-rank test harness, process ranks: runs a test body on N processes over the mpi backend
// (issue 3). The thread-rank twin is thread_ranks.h.
//
//   TEST(MyCollective, ThreeProcesses) {
//     run_on_process_ranks(3, [](Communicator& comm) { ... EXPECT_EQ(...) ... });
//   }
//
// How: the test binary, run as usual (by CTest, not under a launcher), re-executes itself
// (/proc/self/exe) under `mpirun --allow-run-as-root --oversubscribe --bind-to none -np N` with
// --gtest_filter=<this test's full name> and the marker LOOM_PROCESS_RANKS=N in the environment
// (and OMPI_MCA_btl_vader_single_copy_mechanism=none unless set: CMA is often blocked in
// containers). In each child the same test reaches the same call, sees the marker and runs the
// body on make_mpi_world(options). A child rank whose body throws or records any gtest failure
// prints one block "rank R failed: <message> (file:line)" and calls MPI_Abort, so mpirun stops
// the other ranks at once. The parent captures the children's output (stdout + stderr), kills
// them when `test_timeout` expires (SIGTERM to mpirun, SIGKILL a second later; every rank also
// dies with mpirun through PR_SET_PDEATHSIG), and turns a non-zero exit into test failures: one
// per "rank R failed" block, else the exit status and the output's tail. A child that skipped
// (GTEST_SKIP in the body) makes the parent skip too.
//
// In a block, the location of a gtest failure is the assertion's file:line; an exception has
// none, so its block names where run_on_process_ranks was called. The parent's failures are
// reported at that call too.
//
// Skips (GTEST_SKIP, with the reason) when Loom was built without MPI (LOOM_MPI=OFF) or mpirun
// is not found (LOOM_MPIRUN overrides the command). Like every GTEST_SKIP in a helper, it only
// returns from run_on_process_ranks: statements after the call still run in the parent.
// When the binary was itself started by a launcher without the marker (mpirun -np N test),
// the body runs directly on the launched world if its size is N, and skips otherwise.
//
// Leaves out: one host only (no hostfile); only the first failing rank is usually reported,
// because MPI_Abort kills the others before they can fail on their own.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "harness/devices.h"  // LOOM_SKIP_UNLESS_CUDA_DEVICES

namespace loom::testing {

// What one mpirun of a test produced (for tests of the harness itself; run_on_process_ranks
// turns it into failures).
struct ProcessRanksRun {
  bool started = false;       // false: could not start mpirun (see error)
  bool timed_out = false;     // killed after the timeout
  bool output_closed = false; // every process that held the output pipe is gone
  int exit_code = -1;         // mpirun's exit status; 128 + signal when killed by one
  double seconds = 0;         // wall time until every process was gone
  std::string error;          // why it did not start
  std::string output;         // every rank's stdout and stderr, interleaved
  std::vector<std::string> failures;  // the "rank R failed: ..." blocks, in output order
  bool passed() const { return started && !timed_out && exit_code == 0; }
};

// The mpirun command to use, or "" when none is found (LOOM_MPIRUN, else mpirun on PATH).
std::string find_mpirun();

// Runs `binary --gtest_filter=<test_name>` on `ranks` processes under mpirun with the marker,
// capturing the output; kills everything after `timeout`. Adds no test failure.
ProcessRanksRun launch_process_ranks(int ranks, const std::string& binary,
                                     const std::string& test_name,
                                     std::chrono::milliseconds timeout);

// True in a rank process started by run_on_process_ranks.
// Where a function was called from: std::source_location's role, from the __builtin_FILE/LINE
// that GCC and Clang both have (clang 14, which the sanitizer CI builds use, cannot compile
// libstdc++'s <source_location>).
struct CallSite {
  const char* file = "";
  int line = 0;
  static CallSite current(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return {file, line};
  }
  const char* file_name() const { return file; }
  int line_number() const { return line; }
};

bool in_process_rank();

// Runs body on `ranks` processes (see above). In the parent: reports failures, timeouts and
// skips of the children as this test's. In a child: runs the body on this rank.
void run_on_process_ranks(int ranks, const std::function<void(Communicator&)>& body,
                          CommOptions options = {},
                          std::chrono::seconds test_timeout = std::chrono::seconds(60),
                          CallSite where = CallSite::current());

}  // namespace loom::testing
