// Asynchronous checkpoints (train.async_checkpoint, train/async_checkpoint.h): the writer
// thread's contract, and training runs whose checkpoints are written while training goes on —
// the synchronous saves' files byte for byte, resumable bit for bit, a failed write failing the
// run and keeping what was published. Labelled concurrent: under ThreadSanitizer the writer
// reads only its staged copies while two thread ranks train on.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "base/error.h"
#include "config/config.h"
#include "data/dataset.h"
#include "harness/error_of.h"
#include "train/async_checkpoint.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testutil::error_of;

TEST(CheckpointWriter, RunsTheWriteOnAThreadAndGivesBackItsError) {
  CheckpointWriter writer;
  EXPECT_FALSE(writer.busy());
  EXPECT_FALSE(writer.done());
  std::atomic<bool> release{false}, wrote{false};
  writer.start([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    wrote = true;
  });
  EXPECT_TRUE(writer.busy());
  EXPECT_FALSE(writer.done()) << "done before the write returned";
  release = true;
  while (!writer.done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  writer.wait();
  EXPECT_TRUE(wrote.load());
  EXPECT_FALSE(writer.busy());
  writer.wait();  // nothing in flight: nothing to do

  writer.start([] { fail("disk full"); });
  EXPECT_NE(error_of([&] { writer.wait(); }).find("disk full"), std::string::npos);
  EXPECT_FALSE(writer.busy());
  writer.start([] {});  // usable again after a failed write
  writer.wait();
  {
    CheckpointWriter dropped;  // its destructor waits for the write in flight
    dropped.start([&] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  }
}

class AsyncCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_async_checkpoint_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    synthesize_addition((dir_ / "data").string(), 30000, 4000, 7);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Two data-parallel thread ranks, a checkpoint every 2 steps, the newest 2 kept.
  Config config(int64_t steps, const std::string& format, bool async) const {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 32
d_model = 32
n_layers = 2
n_heads = 2
[train]
batch_size = 8
micro_batch_size = 4
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 2
keep_checkpoints = 2
seed = 11
[runtime]
ranks = 2
threads_per_rank = 1
)", "test.toml");
    c.train.steps = steps;
    c.train.checkpoint_format = format;
    c.train.async_checkpoint = async;
    c.data.train = (dir_ / "data" / "train_*.bin").string();
    return c;
  }

  TrainOptions options(const std::string& run) const {
    TrainOptions o;
    o.run_dir = (dir_ / run).string();
    o.progress = false;
    return o;
  }

  std::vector<double> losses(const std::string& run) const {
    std::ifstream in(dir_ / run / "metrics.jsonl");
    std::vector<double> out;
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"]);
    return out;
  }

  // The digests of a checkpoint's tensor files (state.json's "files"): what was written.
  nlohmann::json files_of(const std::string& run, int64_t step) const {
    std::ifstream in(dir_ / run / "checkpoints" / ("step_" + std::to_string(step)) / "state.json");
    EXPECT_TRUE(in.good()) << run << " has no checkpoint of step " << step;
    if (!in.good()) return {};
    return nlohmann::json::parse(in)["files"];
  }

  fs::path dir_;
};

// Whole and sharded formats: the asynchronous run trains the synchronous run's losses, keeps the
// same checkpoints (steps 4 and 6; 2 pruned once 6 was published) with the same bytes in every
// file, ends with the last one published; a run stopped at step 4 resumes from its asynchronous
// checkpoint to the uninterrupted run, bit for bit.
TEST_F(AsyncCheckpointTest, FilesAreTheSynchronousOnesAndResumeBitForBit) {
  for (const std::string format : {"whole", "sharded"}) {
    SCOPED_TRACE(format);
    run_training(config(6, format, false), options("sync_" + format));
    const TrainSummary s = run_training(config(6, format, true), options("async_" + format));
    EXPECT_EQ(losses("async_" + format), losses("sync_" + format));
    EXPECT_EQ(s.last_checkpoint, (dir_ / ("async_" + format) / "checkpoints" / "step_6").string());
    for (int64_t step : {4, 6}) {
      const nlohmann::json files = files_of("async_" + format, step);
      EXPECT_FALSE(files.empty());
      EXPECT_EQ(files, files_of("sync_" + format, step)) << "step " << step;
    }
    EXPECT_FALSE(fs::exists(dir_ / ("async_" + format) / "checkpoints" / "step_2"))
        << "train.keep_checkpoints = 2 kept step 2";
    for (const auto& e : fs::directory_iterator(dir_ / ("async_" + format) / "checkpoints"))
      EXPECT_EQ(e.path().extension(), "") << e.path() << ": a save left unpublished";

    TrainOptions stop = options("resumed_" + format);
    stop.stop_after = 4;
    EXPECT_EQ(run_training(config(6, format, true), stop).last_step, 4);
    TrainOptions resume = options("resumed_" + format);
    resume.resume = "auto";
    EXPECT_EQ(run_training(config(6, format, true), resume).start_step, 4);
    EXPECT_EQ(losses("resumed_" + format), losses("sync_" + format));
  }
}

// A write that fails (LOOM_TEST_FAULT = "savefail@4": world rank 0's write of step 4 throws)
// fails the run, on every rank, at the step its save would have been published, naming the
// step; step 2's checkpoint stays published and the run resumes from it.
TEST_F(AsyncCheckpointTest, AFailedWriteFailsTheRunAndKeepsThePublishedOnes) {
  const Config c = config(8, "sharded", true);
  ASSERT_EQ(setenv("LOOM_TEST_FAULT", "savefail@4", 1), 0);
  const std::string error = error_of([&] { run_training(c, options("failing")); });
  unsetenv("LOOM_TEST_FAULT");
  EXPECT_NE(error.find("asynchronous checkpoint of step 4 failed"), std::string::npos) << error;
  EXPECT_NE(error.find("checkpoints published before it are intact"), std::string::npos) << error;
  EXPECT_TRUE(fs::exists(dir_ / "failing" / "checkpoints" / "step_2" / "state.json"));
  EXPECT_FALSE(fs::exists(dir_ / "failing" / "checkpoints" / "step_4"));
  TrainOptions resume = options("failing");
  resume.resume = "auto";
  EXPECT_EQ(run_training(c, resume).start_step, 2);
}

}  // namespace
}  // namespace loom
