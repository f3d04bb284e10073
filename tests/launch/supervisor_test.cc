// The job supervisor (launch/supervisor.h) on small shell commands standing in for training
// jobs: which endings it restarts, how it counts them, how it stops a stalled job, and how it
// passes a stop signal on. The real `loom train` under `loom launch` is in tests/apps/cli_test.cc.
#include "launch/supervisor.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/timer.h"
#include "harness/error_of.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using loom::testutil::error_of;

class Supervisor : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_supervisor_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    options_.restart_delay_s = 0;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Runs a shell script under the supervisor, in the test's directory.
  LaunchResult run(const std::string& script) {
    log_.clear();
    return supervise({"sh", "-c", "cd '" + dir_.string() + "' && " + script}, options_,
                     [this](const std::string& line) { log_ += line + "\n"; });
  }
  fs::path dir_;
  LaunchOptions options_;
  std::string log_;
};

// The number of the attempt, counted in a file by the script itself: "n=$(...)".
const std::string kCount = "n=$(( $(cat count 2>/dev/null || echo 0) + 1 )); echo $n > count; ";

TEST_F(Supervisor, ASuccessIsRunOnce) {
  const LaunchResult r = run("exit 0");
  ASSERT_EQ(r.attempts.size(), 1u);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_FALSE(r.attempts[0].failed());
}

TEST_F(Supervisor, RestartsAFailingCommandUntilItSucceeds) {
  const LaunchResult r = run(kCount + "[ $n -ge 3 ] || exit 1");
  ASSERT_EQ(r.attempts.size(), 3u) << log_;
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.attempts[0].exit_code, 1);
  EXPECT_EQ(r.attempts[2].exit_code, 0);
  EXPECT_NE(log_.find("restart 2 of at most 3"), std::string::npos) << log_;
}

TEST_F(Supervisor, GivesUpAfterMaxRestartsAndExitsWithTheCommandsStatus) {
  options_.max_restarts = 2;
  const LaunchResult r = run("exit 5");
  EXPECT_EQ(r.attempts.size(), 3u) << log_;
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_NE(log_.find("giving up: 3 failures in a row"), std::string::npos) << log_;
}

TEST_F(Supervisor, NoRestartsAtAllWithZero) {
  options_.max_restarts = 0;
  EXPECT_EQ(run("exit 1").attempts.size(), 1u);
}

TEST_F(Supervisor, AUsageErrorIsNotRestarted) {
  const LaunchResult r = run("exit 2");
  EXPECT_EQ(r.attempts.size(), 1u);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(log_.find("usage error"), std::string::npos) << log_;
}

TEST_F(Supervisor, DeathByASignalIsAFailureAndExitsAsTheShellWould) {
  options_.max_restarts = 1;
  const LaunchResult r = run("kill -KILL $$");
  ASSERT_EQ(r.attempts.size(), 2u);
  EXPECT_EQ(r.attempts[0].signal, SIGKILL);
  EXPECT_EQ(r.attempts[0].describe(), "killed by SIGKILL");
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
}

// Each attempt saves a newer checkpoint before failing: with a run directory, none of them
// counts against the budget, so the job goes on to succeed with max_restarts = 1.
TEST_F(Supervisor, AnAttemptThatSavedANewCheckpointStartsTheCountAgain) {
  options_.max_restarts = 1;
  options_.run_dir = dir_.string();
  const std::string save =
      "mkdir -p checkpoints/step_$n && echo {} > checkpoints/step_$n/state.json; ";
  const LaunchResult r = run(kCount + save + "[ $n -ge 5 ] || exit 1");
  ASSERT_EQ(r.attempts.size(), 5u) << log_;
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(fs::path(r.attempts[0].checkpoint_after).filename(), "step_1");
  EXPECT_EQ(fs::path(r.attempts[3].checkpoint_before).filename(), "step_3");
  EXPECT_TRUE(r.attempts[3].progressed());
  // Every attempt is on record in RUN_DIR/launch.jsonl.
  std::ifstream in(path("launch.jsonl"));
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[1]["attempt"], 2);
  EXPECT_EQ(records[1]["exit_code"], 1);
  EXPECT_EQ(records[1]["checkpoint_before"], "step_1");
  EXPECT_EQ(records[1]["checkpoint_after"], "step_2");
  EXPECT_EQ(records[4]["exit_code"], 0);
}

// The same job saving nothing new after its first attempt: the first restart is free (that
// attempt saved step_7), the next one is the one restart without progress max_restarts = 1 allows.
TEST_F(Supervisor, FailuresWithoutANewCheckpointSpendTheBudget) {
  options_.max_restarts = 1;
  options_.run_dir = dir_.string();
  const LaunchResult r =
      run("mkdir -p checkpoints/step_7 && echo {} > checkpoints/step_7/state.json; exit 1");
  ASSERT_EQ(r.attempts.size(), 3u) << log_;
  EXPECT_TRUE(r.attempts[0].progressed());   // none -> step_7
  EXPECT_FALSE(r.attempts[1].progressed());  // step_7 -> step_7
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(log_.find("giving up: 2 failures in a row without a new checkpoint"), std::string::npos)
      << log_;
}

TEST_F(Supervisor, AStalledAttemptIsStoppedWithSigterm) {
  options_.max_restarts = 0;
  options_.run_dir = dir_.string();
  options_.stall_timeout_s = 0.5;
  const double t0 = now_seconds();
  const LaunchResult r = run("sleep 30");
  ASSERT_EQ(r.attempts.size(), 1u);
  EXPECT_TRUE(r.attempts[0].stalled);
  EXPECT_EQ(r.attempts[0].signal, SIGTERM);
  EXPECT_LT(now_seconds() - t0, 10.0);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(log_.find("no training step for"), std::string::npos) << log_;
}

// SIGTERM ignored by the whole process group: SIGKILL after the grace period.
TEST_F(Supervisor, AStalledAttemptThatIgnoresSigtermIsKilled) {
  options_.max_restarts = 0;
  options_.run_dir = dir_.string();
  options_.stall_timeout_s = 0.3;
  options_.kill_grace_s = 0.3;
  const LaunchResult r = run("trap '' TERM; sleep 30");
  ASSERT_EQ(r.attempts.size(), 1u);
  EXPECT_TRUE(r.attempts[0].stalled);
  EXPECT_EQ(r.attempts[0].signal, SIGKILL);
}

// A job that logs a step more often than the timeout is left alone, however long it runs.
TEST_F(Supervisor, StepsLoggedInTimeKeepTheAttemptAlive) {
  options_.run_dir = dir_.string();
  options_.stall_timeout_s = 0.6;
  const LaunchResult r =
      run("for i in 1 2 3 4 5 6 7 8 9 10; do echo step >> metrics.jsonl; sleep 0.15; done");
  ASSERT_EQ(r.attempts.size(), 1u) << log_;
  EXPECT_FALSE(r.attempts[0].stalled);
  EXPECT_EQ(r.exit_code, 0);
}

// SIGTERM to the supervisor reaches the command once; the command's ending is not restarted and
// its status is the supervisor's.
TEST_F(Supervisor, AStopSignalIsPassedOnAndNothingIsRestarted) {
  std::thread stopper([this] {
    while (!fs::exists(path("started"))) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    kill(getpid(), SIGTERM);
  });
  const LaunchResult r =
      run("trap 'echo $(( $(cat got 2>/dev/null || echo 0) + 1 )) > got; exit 7' TERM; "
          "touch started; while :; do sleep 0.05; done");
  stopper.join();
  ASSERT_EQ(r.attempts.size(), 1u) << log_;
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.exit_code, 7);
  std::ifstream got(path("got"));
  int times = 0;
  got >> times;
  EXPECT_EQ(times,
            1);  // once: the supervisor passes it on, the terminal's group is not the child's
  EXPECT_NE(log_.find("stopped by SIGTERM: not restarting"), std::string::npos) << log_;
}

// Exit status 143 (128 + SIGTERM): the command's ranks were stopped by SIGTERM — Slurm's
// `--signal=TERM@T` signals a job's tasks, not the supervisor; they save a checkpoint and end
// so, and srun reports 143. A stop the scheduler asked for: not restarted, even with a new
// checkpoint and budget left (tests/deploy/slurm_test.sh runs it on a real Slurm). 137 (a rank
// killed) is still a failure.
TEST_F(Supervisor, RanksStoppedBySigtermAreNotRestarted) {
  options_.run_dir = dir_.string();
  const LaunchResult r = run(kCount +
                             "mkdir -p checkpoints/step_$n && echo {} > "
                             "checkpoints/step_$n/state.json; exit 143");
  ASSERT_EQ(r.attempts.size(), 1u) << log_;
  EXPECT_TRUE(r.attempts[0].progressed());
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.exit_code, 143);
  EXPECT_NE(log_.find("attempt 1 ended after"), std::string::npos) << log_;
  EXPECT_NE(log_.find("stopped by SIGTERM: not restarting"), std::string::npos) << log_;

  options_.max_restarts = 1;
  const LaunchResult killed = run(kCount + "exit 137");
  EXPECT_EQ(killed.attempts.size(), 2u) << log_;
}

TEST_F(Supervisor, ACommandThatCannotStartIsAnError) {
  const std::string e = error_of(
      [] { supervise({"/nonexistent/train"}, LaunchOptions{}, [](const std::string&) {}); });
  EXPECT_NE(e.find("cannot run /nonexistent/train"), std::string::npos) << e;
}

TEST_F(Supervisor, BadOptionsAreErrors) {
  const auto quiet = [](const std::string&) {};
  LaunchOptions o;
  o.stall_timeout_s = 5;
  EXPECT_NE(error_of([&] { supervise({"true"}, o, quiet); }).find("--run-dir"), std::string::npos);
  o = {};
  o.max_restarts = -1;
  EXPECT_NE(error_of([&] { supervise({"true"}, o, quiet); }).find("--max-restarts"),
            std::string::npos);
  EXPECT_NE(error_of([&] { supervise({}, LaunchOptions{}, quiet); }).find("no command"),
            std::string::npos);
}

TEST(InspectTrainCommand, FindsLoomTrainItsResumeAndItsRunDirectory) {
  TrainCommand t = inspect_train_command({"mpirun", "-n", "4", "/opt/loom/bin/loom", "train",
                                          "--set", "train.steps=9", "cfg.toml", "--run-dir",
                                          "/runs/a", "--resume", "auto"});
  EXPECT_TRUE(t.is_loom_train);
  EXPECT_TRUE(t.resumes);
  EXPECT_EQ(t.run_dir, "/runs/a");
  t = inspect_train_command({"loom", "train", "configs/gpt2.toml", "--resume=auto"});
  EXPECT_TRUE(t.resumes);
  EXPECT_EQ(t.run_dir, "runs/gpt2");  // loom train's default for that config
  t = inspect_train_command({"loom", "train", "c.toml", "--run-dir=out"});
  EXPECT_FALSE(t.resumes);
  EXPECT_EQ(t.run_dir, "out");
  t = inspect_train_command({"python", "train.py", "--resume"});
  EXPECT_FALSE(t.is_loom_train);
  EXPECT_EQ(t.run_dir, "");
}

}  // namespace
}  // namespace loom
