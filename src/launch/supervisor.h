// The job supervisor behind `loom launch`: runs a training command (a `loom train`, or an
// `mpirun`/`srun` of one) as a child process and, when it fails, runs it again, so that a job
// which lost a process, a node or its network resumes from its newest checkpoint instead of
// waiting for a person (the command resumes itself: `loom train ... --resume auto`).
//
// What counts as failure: a non-zero exit, death by a signal, or (with a stall timeout) no new
// training step for that long; a stalled child's process group is sent SIGTERM, then SIGKILL.
// Not restarted: exit 0 (done), exit 2 (a command-line usage error: the same command fails the
// same way), exit 143 = 128 + SIGTERM (its ranks were stopped by SIGTERM: `loom train` saved a
// checkpoint and exited so, or srun / mpirun reports tasks that did — a scheduler signalling the
// tasks themselves, as Slurm's `--signal=TERM@T` does, asks the job to stop), and a child that
// ended after the supervisor was itself asked to stop (SIGINT, SIGTERM, SIGHUP are passed on to
// the child once, and the supervisor then exits with its status).
//
// The restart budget counts failures in a row without progress: with a run directory, an
// attempt that wrote a newer checkpoint than the one it started from resets the count, so a
// days-long job survives any number of separate failures, while one that fails at the same step
// every time gives up after max_restarts restarts. Without a run directory every failure counts.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace loom {

struct LaunchOptions {
  int max_restarts = 3;        // restarts after failures in a row without a new checkpoint
  double restart_delay_s = 5;  // wait before each restart
  std::string run_dir;         // the run's directory: progress (checkpoints, metrics); "" = none
  double stall_timeout_s = 0;  // > 0 (needs run_dir): a step must be logged at least this often
  double kill_grace_s = 10;    // SIGTERM to SIGKILL when a stalled child is stopped
};

// One run of the command.
struct LaunchAttempt {
  int number = 0;                 // 1-based
  int exit_code = -1;             // the child's exit status, or -1 when a signal ended it
  int signal = 0;                 // the signal that ended it, 0 when it exited
  bool stalled = false;           // stopped by the supervisor after stall_timeout_s without a step
  double seconds = 0;             // wall time of the attempt
  std::string checkpoint_before;  // the newest complete checkpoint when it started ("" = none)
  std::string checkpoint_after;   // ... and when it ended
  bool failed() const { return stalled || signal != 0 || exit_code != 0; }
  bool progressed() const { return checkpoint_after != checkpoint_before; }
  std::string describe()
      const;  // "exit status 1", "killed by SIGKILL", "stalled (no step for 30s)"
};

struct LaunchResult {
  std::vector<LaunchAttempt> attempts;
  // the supervisor was asked to stop (SIGINT/SIGTERM/SIGHUP), or the child's ranks were
  // (exit status 143)
  bool interrupted = false;
  int exit_code =
      0;  // what `loom launch` exits with: 0, the last child's exit status, or 128 + its signal
};

// Runs `command` (argv, looked up in PATH) until it succeeds, the budget is spent, a usage error
// or an interruption. `log` gets one line per event (attempt started, ended, restart). With a run
// directory, each attempt is also appended to RUN_DIR/launch.jsonl. Throws loom::Error for an
// empty command, a command that cannot be started, or a stall timeout without a run directory.
LaunchResult supervise(const std::vector<std::string>& command, const LaunchOptions& options,
                       const std::function<void(const std::string&)>& log);

// For `loom launch`'s checks of its command: where `loom train` appears in it (argv[i] ending in
// "loom" and argv[i+1] == "train"), whether that command resumes (--resume ...) and its run
// directory (--run-dir DIR or --run-dir=DIR, else loom train's default runs/<config name>; ""
// when the command is not a loom train).
struct TrainCommand {
  bool is_loom_train = false;
  bool resumes = false;
  std::string run_dir;
};
TrainCommand inspect_train_command(const std::vector<std::string>& command);

}  // namespace loom
