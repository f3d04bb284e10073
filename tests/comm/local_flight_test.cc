// The local backend feeds the flight recorder and dumps it on a timeout (issue 3).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/flight_recorder.h"
#include "comm/local/local_backend.h"
#include "harness/thread_ranks.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using loom::testing::run_ranks_collect;

class LocalFlightTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_local_flight_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Every rank does 3 all_reduces; rank 3 then skips the 4th (#3), the others wait in it.
void skip_fourth(Communicator& comm) {
  Tensor t = Tensor::zeros({16});
  for (int i = 0; i < 3; ++i) comm.all_reduce(t);
  if (comm.rank() == 3) return;
  comm.all_reduce(t);
}

TEST_F(LocalFlightTest, TimeoutDumpsEveryRankAndNamesTheMissingOne) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(300);
  options.flight_dir = dir_.string();
  auto results = run_ranks_collect(4, skip_fourth, options);
  EXPECT_TRUE(results[3].ok) << results[3].error;
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(results[r].ok) << "rank " << r;
    EXPECT_NE(results[r].error.find("all_reduce #3 on group 'world'"), std::string::npos)
        << results[r].error;
    EXPECT_EQ(results[r].error.find("dump failed"), std::string::npos) << results[r].error;
  }
  for (int r = 0; r < 4; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.json", r);
    EXPECT_TRUE(fs::exists(dir_ / name)) << name;
  }
  const HangReport report = analyze_flight_dumps(dir_.string());
  EXPECT_TRUE(report.missing_dumps.empty());
  const std::string text = report.text();
  EXPECT_NE(text.find("rank(s) 0, 1, 2 wait in all_reduce #3"), std::string::npos) << text;
  EXPECT_NE(text.find("rank(s) 3 never reached #3"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3 all_reduce #2 completed"), std::string::npos) << text;
  // No stray temporary files: each rank dumped once.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().extension(), ".json") << entry.path();
    ++files;
  }
  EXPECT_EQ(files, 4);
}

TEST_F(LocalFlightTest, NoFlightDirWritesNothing) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(300);
  const fs::path cwd_before = fs::current_path();
  auto results = run_ranks_collect(4, skip_fourth, options);
  EXPECT_TRUE(results[3].ok);
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(results[r].ok) << "rank " << r;
  EXPECT_FALSE(fs::exists(dir_));
  EXPECT_FALSE(fs::exists(cwd_before / "rank_00000.json"));
}

TEST_F(LocalFlightTest, RecordsCarryOpDtypeCountAndState) {
  auto world = make_local_world(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = *world[r];
      Tensor t = Tensor::zeros({10}, DType::kBF16);
      comm.all_reduce(t);
      comm.barrier();
      auto sub = comm.split(0, -r);  // reversed order: new rank 0 is world rank 1
      Tensor u = Tensor::zeros({3});
      sub->broadcast(u, 0);
      if (r == 0) {
        comm.send(u, 1, 7);
      } else {
        comm.recv(u, 0, 7);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    const auto records = dynamic_cast<LocalCommunicator&>(*world[r]).flight_recorder().snapshot();
    ASSERT_EQ(records.size(), 5u) << "rank " << r;
    EXPECT_EQ(records[0].group, "world");
    EXPECT_EQ(records[0].seq, 0);
    EXPECT_EQ(records[0].op, "all_reduce");
    EXPECT_EQ(records[0].dtype, "bf16");
    EXPECT_EQ(records[0].count, 10);
    EXPECT_EQ(records[1].op, "barrier");
    EXPECT_EQ(records[1].seq, 1);
    EXPECT_EQ(records[2].op, "split");
    EXPECT_EQ(records[2].seq, 2);
    EXPECT_EQ(records[3].group, "world/split(color=0)");
    EXPECT_EQ(records[3].op, "broadcast");
    EXPECT_EQ(records[3].seq, 0);
    EXPECT_EQ(records[3].count, 3);
    EXPECT_EQ(records[3].dtype, "f32");
    EXPECT_EQ(records[4].group, "world:p2p");
    EXPECT_EQ(records[4].op, r == 0 ? "send(dst=1, tag=7)" : "recv(src=0, tag=7)");
    for (const FlightRecord& rec : records) {
      EXPECT_EQ(rec.state, FlightState::kCompleted) << rec.op;
      EXPECT_GT(rec.t_issued, 0);
      EXPECT_GE(rec.t_started, rec.t_issued);
      EXPECT_GE(rec.t_completed, rec.t_started);
    }
  }
  // Both groups are registered with their members' world ranks (sub-group: world ranks 1, 0).
  const std::string path = dynamic_cast<LocalCommunicator&>(*world[0]).flight_recorder().dump(
      dir_.string(), 0, 2, "test");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("\"world/split(color=0)\": [\n   1,\n   0\n  ]"), std::string::npos)
      << text.str();
}

}  // namespace
}  // namespace loom
