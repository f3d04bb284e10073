// What stops or breaks a run from outside: the signals `loom train` stops on gracefully, and the
// faults the tests inject to see a job fail the way real ones do (docs/launch.md).
#pragma once

#include <cstdint>

namespace loom {

// For `loom train`: from now on SIGTERM and SIGINT ask a run with TrainOptions::stop_on_signal
// to end at the end of the step in progress, with a checkpoint, so that a preempted job (Slurm
// sends SIGTERM, then SIGKILL after its KillWait) or one stopped by hand resumes without losing
// steps. A second SIGINT (Ctrl-C twice) ends the process at once; a repeated SIGTERM is ignored
// (a scheduler and `loom launch` may both send one).
void install_stop_signals();
int stop_signal_received();  // the first such signal so far, 0 if none

// LOOM_TEST_FAULT = "kill@N": world rank 0 kills its process with SIGKILL once step N is logged;
// "hang@N": it stops responding there; "term@N": it sends its process SIGTERM there — a crashed
// rank, a wedged one, a scheduler's preemption. The trainer strikes only in a run that started at
// step 0, so that the restarted run (resumed from a checkpoint) goes past it. For the tests of
// `loom launch` and the graceful stop (tests/apps/cli_test.cc). "slow@N": from step N on it
// sleeps kSlowStepMs after each step, so that a signal sent after step N surely lands before a
// short run ends, however slowly the machine delivers it (tests/deploy/slurm_test.sh's
// preemption: under load its scancel once arrived after all 8000 steps). "savefail@N": world rank
// 0's asynchronous checkpoint write of step N throws, as a full disk would (train.async_checkpoint;
// tests/train/train_test.cc).
struct TestFault {
  enum Kind { kNone, kKill, kHang, kTerm, kSlow, kSaveFail } kind = kNone;
  static constexpr int kSlowStepMs = 20;
  int64_t step = 0;

  // Throws loom::Error naming the variable for a value that is not one of the above.
  static TestFault from_env();
  void strike_at(int64_t step_done) const;  // does what it says when step_done == step
  bool fails_save(int64_t step_saved) const { return kind == kSaveFail && step_saved == step; }
};

}  // namespace loom
