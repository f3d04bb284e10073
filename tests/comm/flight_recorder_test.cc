#include "comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "base/error.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

class FlightRecorderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_flight_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Rank r completes all_reduce #0..#(done-1) on "world" and issues #done without completing it
// when `stuck` (it waits there); with stuck == false it never issues #done.
void record(FlightRecorder& fr, int done, bool stuck) {
  fr.add_group("world", {0, 1, 2, 3});
  for (int s = 0; s < done; ++s) {
    const uint64_t id = fr.issued("world", s, "all_reduce", "f32", 1024);
    fr.started(id);
    fr.completed(id);
  }
  if (stuck) fr.started(fr.issued("world", done, "all_reduce", "f32", 1024));
}

TEST_F(FlightRecorderTest, NamesTheRankThatNeverArrived) {
  for (int r = 0; r < 4; ++r) {
    FlightRecorder fr;
    record(fr, 5, /*stuck=*/r != 3);  // rank 3 skipped all_reduce #5
    fr.dump(dir_.string(), r, 4, "timeout");
  }
  HangReport report = analyze_flight_dumps(dir_.string());
  ASSERT_FALSE(report.findings.empty());
  const std::string& line = report.findings.front();
  EXPECT_NE(line.find("rank(s) 0, 1, 2 wait in all_reduce #5"), std::string::npos) << line;
  EXPECT_NE(line.find("rank(s) 3 never reached #5"), std::string::npos) << line;
  EXPECT_NE(line.find("rank 3 all_reduce #4 completed"), std::string::npos) << line;
  EXPECT_TRUE(report.missing_dumps.empty());
}

TEST_F(FlightRecorderTest, ReportsMissingDumps) {
  for (int r = 0; r < 3; ++r) {  // rank 3 died without a dump
    FlightRecorder fr;
    record(fr, 2, true);
    fr.dump(dir_.string(), r, 4, "timeout");
  }
  HangReport report = analyze_flight_dumps(dir_.string());
  EXPECT_EQ(report.missing_dumps, std::vector<int>{3});
  EXPECT_NE(report.text().find("no dump from rank(s) 3"), std::string::npos) << report.text();
}

// Thread ranks under nccl write two dumps each: their host bootstrap's (rank_N.json) and nccl's
// (rank_N.nccl.json). They count as one rank: no rank is missing, and each group is judged on
// the records of the dump that has it.
TEST_F(FlightRecorderTest, ARanksDumpsOfTwoBackendsCountAsOne) {
  for (int r = 0; r < 4; ++r) {
    FlightRecorder host;
    record(host, 1, false);  // the bootstrap's broadcast, completed
    host.dump(dir_.string(), r, 4, "world aborted");
    if (r == 2) continue;  // rank 2's nccl records were never dumped
    FlightRecorder nccl;
    nccl.add_group("nccl:world", {0, 1, 2, 3});
    for (int s = 0; s < 3; ++s) nccl.completed(nccl.issued("nccl:world", s, "all_reduce", "f32", 8));
    if (r != 1) nccl.started(nccl.issued("nccl:world", 3, "all_reduce", "f32", 8));
    EXPECT_EQ(nccl.dump(dir_.string(), r, 4, "timeout", "nccl"),
              (dir_ / ("rank_0000" + std::to_string(r) + ".nccl.json")).string());
  }
  const HangReport report = analyze_flight_dumps(dir_.string());
  EXPECT_TRUE(report.missing_dumps.empty()) << report.text();
  ASSERT_FALSE(report.findings.empty());
  const std::string& line = report.findings.front();
  EXPECT_NE(line.find("group 'nccl:world' (ranks 0, 1, 2, 3): rank(s) 0, 3 wait in all_reduce "
                      "#3; rank(s) 1 never reached #3"),
            std::string::npos)
      << report.text();
  EXPECT_NE(line.find("; no records of this group from rank(s) 2"), std::string::npos)
      << report.text();
  EXPECT_EQ(report.text().find("group 'world'"), std::string::npos) << report.text();
}

TEST_F(FlightRecorderTest, AllCompletedMeansNoHang) {
  for (int r = 0; r < 4; ++r) {
    FlightRecorder fr;
    record(fr, 3, false);
    fr.dump(dir_.string(), r, 4, "manual");
  }
  EXPECT_NE(analyze_flight_dumps(dir_.string()).text().find("no hang"), std::string::npos);
}

TEST_F(FlightRecorderTest, RingKeepsTheLastRecords) {
  FlightRecorder fr(4);
  for (int s = 0; s < 10; ++s) fr.completed(fr.issued("g", s, "barrier", "f32", 0));
  auto snap = fr.snapshot();
  ASSERT_EQ(snap.size(), 4u);
  EXPECT_EQ(snap.front().seq, 6);
  EXPECT_EQ(snap.back().seq, 9);
  EXPECT_EQ(snap.back().state, FlightState::kCompleted);
  fr.completed(0);  // long overwritten: ignored
}

TEST_F(FlightRecorderTest, ConcurrentRecording) {
  FlightRecorder fr(64);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&fr, t] {
      const std::string group = std::string("group") + std::to_string(t);
      for (int s = 0; s < 200; ++s) fr.completed(fr.issued(group, s, "send", "f32", 1));
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(fr.snapshot().size(), 64u);
}

TEST_F(FlightRecorderTest, BadDirectoryIsAClearError) {
  EXPECT_THROW(analyze_flight_dumps((dir_ / "nope").string()), Error);
  fs::create_directories(dir_);
  std::ofstream(dir_ / "rank_00000.json") << "{not json";
  try {
    analyze_flight_dumps(dir_.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank_00000.json"), std::string::npos);
  }
}

// A damaged dump among good ones (found by tests/fuzz: a dump without "rank", a record without
// "seq", a world of 2^31 ranks escaped as the JSON library's exceptions, or listed every rank of
// that world) is named and skipped; the others still say who never arrived, and its rank counts
// as one without a dump.
TEST_F(FlightRecorderTest, ADamagedDumpIsNamedAndSkipped) {
  for (int r = 0; r < 4; ++r) {
    FlightRecorder fr;
    record(fr, 5, /*stuck=*/r != 3);
    fr.dump(dir_.string(), r, 4, "timeout");
  }
  const auto damage = [&](const std::string& text) {
    std::ofstream(dir_ / "rank_00002.json") << text;
    return analyze_flight_dumps(dir_.string());
  };
  for (
      const char* text :
      {R"({"format": "loom-flight-recorder", "world_size": 4, "groups": {}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 2147483647, "groups": {}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 4, "groups": {"world": [0, 9]}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 4, "groups": {}, "records": [{"group": "world"}]})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 4, "groups": {}, "records": [{"group": "world", "seq": 1, "op": "send", "state": "lost"}]})",
       R"([1, 2])",
       // Numbers that are no int: read with a plain cast, UBSan's float-cast-overflow (CI's
       // fuzzing found the first) or a rank that wraps into range.
       R"({"format": "loom-flight-recorder", "rank": 6.66667e+27, "world_size": 4, "groups": {}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 4294967298, "world_size": 4, "groups": {}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 4, "groups": {"world": [0, 1.5]}, "records": []})",
       R"({"format": "loom-flight-recorder", "rank": 2, "world_size": 4, "groups": {}, "records": [{"group": "world", "seq": 1e300, "op": "send", "state": "started"}]})"}) {
    const HangReport report = damage(text);
    SCOPED_TRACE(text);
    EXPECT_EQ(report.world_size, 4);
    EXPECT_EQ(report.missing_dumps, std::vector<int>{2});
    const std::string out = report.text();
    EXPECT_NE(out.find("rank(s) 3 never reached #5"), std::string::npos) << out;
    EXPECT_NE(out.find("flight recorder dump " + (dir_ / "rank_00002.json").string() + ": "),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("; skipped"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace loom
