#include "harness/process_ranks.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>

#include "comm/mpi/launch_env.h"
#ifdef LOOM_WITH_MPI
#include <mpi.h>

#include "comm/mpi/mpi_backend.h"
#endif

namespace loom::testing {
namespace {

constexpr const char* kMarker = "LOOM_PROCESS_RANKS";

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[maybe_unused]] std::string self_exe() {
  char buf[4096];
  const ssize_t len = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return len > 0 ? std::string(buf, static_cast<size_t>(len)) : std::string();
}

bool is_executable(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// The "rank R failed: ..." blocks: the line and the lines indented by two spaces after it.
[[maybe_unused]] std::vector<std::string> failure_blocks(const std::string& output) {
  std::vector<std::string> blocks;
  std::istringstream in(output);
  std::string line;
  bool in_block = false;
  while (std::getline(in, line)) {
    const size_t at = line.find("rank ");
    const bool starts = at != std::string::npos && line.find(" failed: ", at) != std::string::npos &&
                        line.compare(0, 5, "rank ") == 0;
    if (starts) {
      blocks.push_back(line);
      in_block = true;
    } else if (in_block && line.compare(0, 2, "  ") == 0) {
      blocks.back() += "\n" + line;
    } else {
      in_block = false;
    }
  }
  return blocks;
}

[[maybe_unused]] std::string tail(const std::string& s, size_t n = 3000) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - n);
}

#ifdef LOOM_WITH_MPI
// Child side: the failures gtest records in this rank process while a body runs.
struct ChildFailure {
  std::string message, file;
  int line = 0;
  bool fatal = false;
};

std::mutex g_child_mutex;
std::vector<ChildFailure> g_child_failures;
int g_child_rank = -1;  // >= 0 while a body runs

// One write() of the whole block, so that ranks' blocks do not interleave.
void print_failure(int rank, const std::string& message, const std::string& where) {
  std::string text = "rank " + std::to_string(rank) + " failed: ";
  for (char c : message) text += c == '\n' ? std::string("\n  ") : std::string(1, c);
  while (text.size() > 2 && text.compare(text.size() - 3, 3, "\n  ") == 0) text.resize(text.size() - 3);
  text += " (" + where + ")\n";
  std::fflush(stdout);
  std::fflush(stderr);
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t w = write(STDERR_FILENO, p, left);
    if (w <= 0) break;
    p += w;
    left -= static_cast<size_t>(w);
  }
}

[[noreturn]] void abort_job(int rank, const std::string& message, const std::string& where) {
  print_failure(rank, message, where);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

class ChildFailureListener : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    ChildFailure f{result.message(), result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.fatally_failed()};
    int rank = -1;
    {
      std::lock_guard<std::mutex> lock(g_child_mutex);
      rank = g_child_rank;
      if (rank < 0) return;
      g_child_failures.push_back(f);
    }
    // A fatal failure stops the job now, even from a helper the body goes on after.
    if (f.fatal) abort_job(rank, f.message, f.file + ":" + std::to_string(f.line));
  }
};

void run_child(int ranks, const std::function<void(Communicator&)>& body,
               const CommOptions& options, const CallSite& where) {
  // Die with mpirun, whatever kills it (the parent's timeout ends in SIGKILL).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  static std::once_flag once;
  std::call_once(once, [] {
    ::testing::UnitTest::GetInstance()->listeners().Append(new ChildFailureListener);
  });
  std::unique_ptr<Communicator> world = make_mpi_world(options);
  const int rank = world->rank();
  const std::string call_site = std::string(where.file_name()) + ":" +
                                std::to_string(where.line_number()) +
                                ", the run_on_process_ranks call";
  if (world->size() != ranks) {
    abort_job(rank, "the test asks for " + std::to_string(ranks) + " ranks, the job has " +
                        std::to_string(world->size()),
              call_site);
  }
  {
    std::lock_guard<std::mutex> lock(g_child_mutex);
    g_child_failures.clear();
    g_child_rank = rank;
  }
  std::string thrown;
  try {
    body(*world);
  } catch (const std::exception& e) {
    thrown = e.what();
  } catch (...) {
    thrown = "unknown exception";
  }
  std::vector<ChildFailure> failures;
  {
    std::lock_guard<std::mutex> lock(g_child_mutex);
    failures = g_child_failures;
    g_child_rank = -1;
  }
  if (!thrown.empty()) abort_job(rank, thrown, "thrown in the body; " + call_site);
  if (!failures.empty()) {
    for (size_t i = 1; i < failures.size(); ++i) {
      print_failure(rank, failures[i].message, failures[i].file + ":" + std::to_string(failures[i].line));
    }
    abort_job(rank, failures[0].message, failures[0].file + ":" + std::to_string(failures[0].line));
  }
  world->barrier();  // no rank leaves (and finalises MPI) while another still communicates
}
#endif

}  // namespace

std::string find_mpirun() {
  if (const char* env = std::getenv("LOOM_MPIRUN"); env && *env) return is_executable(env) ? env : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t pos = 0;
  while (pos <= dirs.size()) {
    size_t colon = dirs.find(':', pos);
    if (colon == std::string::npos) colon = dirs.size();
    const std::string candidate = dirs.substr(pos, colon - pos) + "/mpirun";
    if (colon > pos && is_executable(candidate)) return candidate;
    pos = colon + 1;
  }
  return "";
}

bool in_process_rank() {
  const char* marker = std::getenv(kMarker);
  return marker && *marker && detect_launch_env().under_launcher;
}

ProcessRanksRun launch_process_ranks(int ranks, const std::string& binary, const std::string& test_name,
                                     std::chrono::milliseconds timeout) {
  ProcessRanksRun run;
  const std::string mpirun = find_mpirun();
  if (mpirun.empty()) {
    run.error = "mpirun not found (install openmpi-bin, or set LOOM_MPIRUN)";
    return run;
  }
  std::vector<std::string> args = {mpirun};
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "--bind-to", "none", "-np"}) args.push_back(a);
  args.push_back(std::to_string(ranks));
  args.push_back(binary);
  args.push_back("--gtest_filter=" + test_name);
  args.push_back("--gtest_also_run_disabled_tests");
  args.push_back("--gtest_color=no");

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    run.error = std::string("pipe: ") + std::strerror(errno);
    return run;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const double t0 = now_s();
  const pid_t pid = fork();
  if (pid < 0) {
    run.error = std::string("fork: ") + std::strerror(errno);
    close(fds[0]);
    close(fds[1]);
    return run;
  }
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    setenv(kMarker, std::to_string(ranks).c_str(), 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    unsetenv("GTEST_OUTPUT");  // N ranks writing one report file would garble it
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    const std::string msg = "cannot exec " + args[0] + ": " + std::strerror(errno) + "\n";
    (void)!write(STDERR_FILENO, msg.data(), msg.size());
    _exit(127);
  }
  close(fds[1]);
  run.started = true;

  const double deadline = t0 + std::chrono::duration<double>(timeout).count();
  double kill_at = 0;     // when SIGKILL follows the SIGTERM
  double give_up_at = 0;  // after mpirun exited: how long to wait for the ranks' output to end
  bool eof = false, reaped = false;
  int status = 0;
  char buf[65536];
  while (!(eof && reaped)) {
    pollfd p{fds[0], POLLIN, 0};
    if (!eof && poll(&p, 1, 50) > 0) {
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n > 0) run.output.append(buf, static_cast<size_t>(n));
      else if (n == 0 || errno != EINTR) eof = true;
    } else if (eof) {
      usleep(20000);
    }
    if (!reaped && waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      give_up_at = now_s() + 2.0;
    }
    const double t = now_s();
    if (!reaped && !run.timed_out && t > deadline) {
      run.timed_out = true;
      kill(-pid, SIGTERM);  // mpirun forwards it to the ranks and cleans up
      kill_at = t + 1.0;
    }
    if (!reaped && kill_at > 0 && t > kill_at) {
      kill(-pid, SIGKILL);  // the ranks follow through PR_SET_PDEATHSIG
      kill_at = 0;
    }
    if (reaped && !eof && t > give_up_at) break;  // a rank still holds the pipe: stop reading
  }
  close(fds[0]);
  run.output_closed = eof;
  run.seconds = now_s() - t0;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  run.failures = failure_blocks(run.output);
  return run;
}

void run_on_process_ranks(int ranks, const std::function<void(Communicator&)>& body,
                          CommOptions options, std::chrono::seconds test_timeout, CallSite where) {
#ifndef LOOM_WITH_MPI
  (void)ranks, (void)body, (void)options, (void)test_timeout, (void)where;
  GTEST_SKIP() << "process ranks need the mpi backend: this Loom was built without MPI (LOOM_MPI=OFF)";
#else
  const LaunchEnv env = detect_launch_env();
  if (env.under_launcher) {
    if (!std::getenv(kMarker) && env.size != ranks) {
      GTEST_SKIP() << "the test needs " << ranks << " ranks; this job was launched with " << env.size;
    }
    run_child(ranks, body, options, where);
    return;
  }
  if (find_mpirun().empty()) {
    GTEST_SKIP() << "process ranks need mpirun: not found (install openmpi-bin, or set LOOM_MPIRUN)";
  }
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (!info) {
    ADD_FAILURE_AT(where.file_name(), where.line_number())
        << "run_on_process_ranks must be called from inside a test";
    return;
  }
  const std::string test_name = std::string(info->test_suite_name()) + "." + info->name();
  const std::string binary = self_exe();
  ProcessRanksRun run = launch_process_ranks(
      ranks, binary, test_name, std::chrono::duration_cast<std::chrono::milliseconds>(test_timeout));
  if (!run.started) {
    ADD_FAILURE_AT(where.file_name(), where.line_number())
        << "could not start " << ranks << " process ranks: " << run.error;
    return;
  }
  if (run.timed_out) {
    ADD_FAILURE_AT(where.file_name(), where.line_number())
        << "test timed out after " << test_timeout.count() << " s on " << ranks
        << " process ranks; killed them. Their output:\n"
        << tail(run.output);
    return;
  }
  if (run.exit_code != 0) {
    for (const std::string& f : run.failures)
      ADD_FAILURE_AT(where.file_name(), where.line_number()) << f;
    if (run.failures.empty()) {
      ADD_FAILURE_AT(where.file_name(), where.line_number())
          << "the " << ranks << " process ranks exited with status " << run.exit_code
          << " and no rank reported a failure. Their output:\n"
          << tail(run.output);
    }
    return;
  }
  if (run.output.find("[  SKIPPED ] " + test_name) != std::string::npos) {
    GTEST_SKIP() << "skipped on the process ranks; their output:\n" << tail(run.output, 1500);
  }
  if (run.output.find("[       OK ] " + test_name) == std::string::npos) {
    ADD_FAILURE_AT(where.file_name(), where.line_number())
        << "the process ranks did not run " << test_name << "; their output:\n"
        << tail(run.output);
  }
#endif
}

}  // namespace loom::testing
