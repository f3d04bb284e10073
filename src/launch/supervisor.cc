#include "launch/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/error.h"
#include "base/timer.h"
#include "checkpoint/checkpoint.h"

namespace loom {
namespace fs = std::filesystem;

namespace {

// The child being supervised and the stop signal received, for the signal handler. One
// supervisor runs at a time in a process (the `loom launch` command, or a test).
std::atomic<pid_t> g_child{0};
volatile sig_atomic_t g_stop_signal = 0;
static_assert(std::atomic<pid_t>::is_always_lock_free, "the signal handler reads g_child");

void on_stop_signal(int sig) {
  g_stop_signal = sig;
  const pid_t child = g_child.load();
  if (child > 0) kill(child, sig);  // passed on once; the child decides how to stop
}

// Installs the handler for SIGINT, SIGTERM and SIGHUP while the supervisor runs. No SA_RESTART:
// a signal interrupts the sleeps of the wait loop.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~StopSignals() {
    for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  static constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction old_[3];
};

void sleep_for(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

// Sleeps up to `seconds`, waking early when a stop signal arrives.
void sleep_unless_stopped(double seconds) {
  const double end = now_seconds() + seconds;
  while (!g_stop_signal && now_seconds() < end) sleep_for(std::min(0.05, end - now_seconds()));
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string newest_checkpoint(const std::string& run_dir) {
  if (run_dir.empty()) return "";
  return find_latest_checkpoint((fs::path(run_dir) / "checkpoints").string());
}

std::string name_of(const std::string& checkpoint) {
  return checkpoint.empty() ? "none" : fs::path(checkpoint).filename().string();
}

// A sign of life of the training: the size and modification time of RUN_DIR/metrics.jsonl,
// which gains a line per step (and is cut back when a run resumes).
struct Heartbeat {
  std::string path;
  off_t size = -1;
  timespec mtime{};

  bool changed() {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return false;
    const bool moved = st.st_size != size || st.st_mtim.tv_sec != mtime.tv_sec ||
                       st.st_mtim.tv_nsec != mtime.tv_nsec;
    size = st.st_size;
    mtime = st.st_mtim;
    return moved;
  }
};

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 10 ? "%.1fs" : "%.0fs", s);
  return buf;
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

// Starts the command in a process group of its own (so that a stalled job's whole tree can be
// stopped, and a terminal's Ctrl-C reaches it once, through the supervisor), dying with the
// supervisor. An exec failure comes back through a close-on-exec pipe as the child's errno.
pid_t spawn(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) fail("pipe: ", std::strerror(errno));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) fail("fork: ", std::strerror(errno));
  if (pid == 0) {
    // Only async-signal-safe calls from here to exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the supervisor is already gone
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &dfl, nullptr);
    execvp(argv[0], argv.data());
    const int err = errno;
    (void)!write(pipe_fds[1], &err, sizeof err);
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so that it holds before the first kill(-pid)
  close(pipe_fds[1]);
  int err = 0;
  ssize_t n;
  do n = read(pipe_fds[0], &err, sizeof err);
  while (n < 0 && errno == EINTR);
  close(pipe_fds[0]);
  if (n == static_cast<ssize_t>(sizeof err)) {
    waitpid(pid, nullptr, 0);
    fail("cannot run ", command[0], ": ", std::strerror(err));
  }
  return pid;
}

// Waits for the child, stopping it when it stalls. Fills exit_code/signal/stalled.
void wait_for(pid_t pid, const LaunchOptions& options, LaunchAttempt& attempt,
              const std::function<void(const std::string&)>& log) {
  Heartbeat heartbeat{(fs::path(options.run_dir) / "metrics.jsonl").string()};
  if (options.stall_timeout_s > 0) heartbeat.changed();
  double last_beat = now_seconds(), kill_at = 0;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) fail("waitpid: ", std::strerror(errno));
    const double now = now_seconds();
    if (options.stall_timeout_s > 0 && !attempt.stalled && !g_stop_signal) {
      if (heartbeat.changed()) last_beat = now;
      if (now - last_beat > options.stall_timeout_s) {
        attempt.stalled = true;
        log("no training step for " + format_seconds(now - last_beat) + " (--stall-timeout " +
            format_seconds(options.stall_timeout_s) + "): stopping the attempt (SIGTERM, then " +
            "SIGKILL after " + format_seconds(options.kill_grace_s) + ")");
        kill(-pid, SIGTERM);
        kill_at = now + options.kill_grace_s;
      }
    }
    if (kill_at > 0 && now >= kill_at) {
      kill(-pid, SIGKILL);
      kill_at = 0;
    }
    sleep_for(0.05);
  }
  if (WIFSIGNALED(status)) {
    attempt.signal = WTERMSIG(status);
    attempt.exit_code = -1;
  } else {
    attempt.exit_code = WEXITSTATUS(status);
  }
}

void append_record(const std::string& run_dir, const std::vector<std::string>& command,
                   const LaunchAttempt& a, double started_at) {
  nlohmann::json record = {
      {"attempt", a.number},
      {"command", command},
      {"started_at", started_at},
      {"seconds", a.seconds},
      {"exit_code", a.signal ? nlohmann::json() : nlohmann::json(a.exit_code)},
      {"signal", a.signal ? nlohmann::json(signal_name(a.signal)) : nlohmann::json()},
      {"stalled", a.stalled},
      {"checkpoint_before", name_of(a.checkpoint_before)},
      {"checkpoint_after", name_of(a.checkpoint_after)}};
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  std::ofstream out(fs::path(run_dir) / "launch.jsonl", std::ios::app);
  out << record.dump() << "\n";
}

}  // namespace

std::string LaunchAttempt::describe() const {
  if (stalled)
    return "stalled, stopped" + (signal ? " (" + signal_name(signal) + ")" : std::string());
  if (signal) return "killed by " + signal_name(signal);
  return "exit status " + std::to_string(exit_code);
}

TrainCommand inspect_train_command(const std::vector<std::string>& command) {
  TrainCommand t;
  for (size_t i = 0; i + 1 < command.size(); ++i) {
    const std::string base = fs::path(command[i]).filename().string();
    if (base != "loom" || command[i + 1] != "train") continue;
    t.is_loom_train = true;
    std::string config;
    for (size_t j = i + 2; j < command.size(); ++j) {
      const std::string& a = command[j];
      const bool has_value = j + 1 < command.size();
      if (a == "--resume" || a.rfind("--resume=", 0) == 0) t.resumes = true;
      if (a == "--run-dir" && has_value) t.run_dir = command[j + 1];
      if (a.rfind("--run-dir=", 0) == 0) t.run_dir = a.substr(10);
      // Skip the values of loom train's options that take one; the first other word is the config.
      for (const char* o : {"--set", "--run-dir", "--resume", "--stop-after", "--ranks"})
        if (a == o) ++j;
      if (config.empty() && !a.empty() && a[0] != '-') config = a;
    }
    // loom train's own default (apps/loom.cc): runs/<config name>.
    if (t.run_dir.empty() && !config.empty())
      t.run_dir = "runs/" + fs::path(config).stem().string();
    break;
  }
  return t;
}

LaunchResult supervise(const std::vector<std::string>& command, const LaunchOptions& options,
                       const std::function<void(const std::string&)>& log) {
  if (command.empty()) fail("no command to run (loom launch [options] -- COMMAND ...)");
  if (options.max_restarts < 0) fail("--max-restarts must be >= 0, got ", options.max_restarts);
  if (!(options.restart_delay_s >= 0))
    fail("--restart-delay must be >= 0, got ", options.restart_delay_s);
  if (!(options.stall_timeout_s >= 0))
    fail("--stall-timeout must be >= 0, got ", options.stall_timeout_s);
  if (options.stall_timeout_s > 0 && options.run_dir.empty())
    fail("--stall-timeout watches RUN_DIR/metrics.jsonl: give --run-dir");

  StopSignals stop_signals;
  LaunchResult result;
  int failures_without_progress = 0;
  for (int number = 1;; ++number) {
    if (g_stop_signal) {  // arrived while waiting to restart
      result.interrupted = true;
      log("stopped by " + signal_name(g_stop_signal) + ": not restarting");
      break;
    }
    LaunchAttempt a;
    a.number = number;
    a.checkpoint_before = newest_checkpoint(options.run_dir);
    log("attempt " + std::to_string(number) + ": " + join(command) +
        (options.run_dir.empty() ? ""
                                 : " (newest checkpoint: " + name_of(a.checkpoint_before) + ")"));
    const double t0 = now_seconds();
    const double started_at = static_cast<double>(std::time(nullptr));
    const pid_t pid = spawn(command);
    g_child.store(pid);
    if (g_stop_signal) kill(pid, g_stop_signal);  // arrived while it was being started
    try {
      wait_for(pid, options, a, log);
    } catch (...) {
      g_child.store(0);
      throw;
    }
    g_child.store(0);
    a.seconds = now_seconds() - t0;
    a.checkpoint_after = newest_checkpoint(options.run_dir);
    if (!options.run_dir.empty()) append_record(options.run_dir, command, a, started_at);
    result.attempts.push_back(a);
    result.exit_code = a.signal ? 128 + a.signal : a.exit_code;
    if (a.stalled && result.exit_code == 0) result.exit_code = 1;
    if (!a.failed()) {
      log("attempt " + std::to_string(number) + " succeeded after " + format_seconds(a.seconds));
      break;
    }
    // Exit status 128 + SIGTERM: `loom train` stopped by SIGTERM with a checkpoint, or srun /
    // mpirun reporting tasks that were. The ranks got the signal without the supervisor (Slurm's
    // `--signal=TERM@T` and `scancel --signal=TERM` signal a job's tasks, not its batch
    // script): a stop the scheduler asked for, not a failure to restart.
    const bool stopped_by_term = !a.stalled && !a.signal && a.exit_code == 128 + SIGTERM;
    std::string ended = "attempt " + std::to_string(number) +
                        (g_stop_signal || stopped_by_term ? " ended after " : " failed after ") +
                        format_seconds(a.seconds) + ": " + a.describe();
    if (!options.run_dir.empty())
      ended += "; newest checkpoint " + name_of(a.checkpoint_after) +
               (a.progressed() ? " (new)" : " (no new one)");
    log(ended);
    if (g_stop_signal || stopped_by_term) {
      result.interrupted = true;
      log(g_stop_signal ? "stopped by " + signal_name(g_stop_signal) + ": not restarting"
                        : "exit status 143: its ranks were stopped by SIGTERM: not restarting");
      break;
    }
    if (!a.stalled && !a.signal && a.exit_code == 2) {
      log("exit status 2 is a command-line usage error: not restarting");
      break;
    }
    const bool progressed = !options.run_dir.empty() && a.progressed();
    failures_without_progress = progressed ? 0 : failures_without_progress + 1;
    if (options.max_restarts == 0 || failures_without_progress > options.max_restarts) {
      log("giving up: " + std::to_string(failures_without_progress) + " failure" +
          (failures_without_progress == 1 ? "" : "s") + " in a row" +
          (options.run_dir.empty() ? "" : " without a new checkpoint") + " (--max-restarts " +
          std::to_string(options.max_restarts) + ")");
      break;
    }
    log("restarting in " + format_seconds(options.restart_delay_s) +
        (progressed ? " (the attempt saved a new checkpoint: the count of failures starts again)"
                    : " (restart " + std::to_string(failures_without_progress) + " of at most " +
                          std::to_string(options.max_restarts) + " without a new checkpoint)"));
    sleep_unless_stopped(options.restart_delay_s);
  }
  if (result.interrupted && result.attempts.empty()) result.exit_code = 128 + g_stop_signal;
  return result;
}

}  // namespace loom
