// The mpi backend's reliability under mpirun (np 2 and 3 from CTest): a timed-out collective
// names the ranks that did not arrive (the arrival board), every rank dumps its flight recorder
// — also the rank that skipped the collective — and analyze_flight_dumps names that rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "comm/flight_recorder.h"
#include "comm/mpi/mpi_backend.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

CommOptions patient() {
  CommOptions options;
  options.timeout = 30s;
  return options;
}

// A directory every rank agrees on (rank 0's pid), empty at the start.
fs::path shared_dir(Communicator& world, const char* tag) {
  Tensor pid = Tensor::from_vector({static_cast<float>(getpid())}, {1});
  world.broadcast(pid, 0);
  const fs::path dir = fs::temp_directory_path() /
                       (std::string("loom_mpi_flight_") + tag + "_" +
                        std::to_string(static_cast<long>(pid.to_vector()[0])));
  if (world.rank() == 0) fs::remove_all(dir);
  world.barrier();
  return dir;
}

// Rank N-1 skips all_reduce #3 of a sub-group; the others time out after 2 s. The skipped
// collective runs on a group of its own (split from a world with flight_dir) and the ranks
// resynchronise on a patient world without one, so no world is left out of step.
TEST(MpiFlight, SkippedCollectiveIsNamedAndEveryRankDumps) {
  auto sync = make_mpi_world(patient());
  if (sync->size() == 1) GTEST_SKIP() << "needs two ranks";
  const fs::path dir = shared_dir(*sync, "skip");
  CommOptions impatient;
  impatient.timeout = 2s;
  impatient.flight_dir = dir.string();
  auto world = make_mpi_world(impatient);
  auto group = world->split(0, world->rank());
  const int n = world->size();
  const int skipper = n - 1;
  Tensor t = Tensor::zeros({16});
  for (int i = 0; i < 3; ++i) group->all_reduce(t);

  WorkHandle pending;
  if (world->rank() != skipper) {
    pending = group->all_reduce_async(t, ReduceOp::kSum);
    const auto start = std::chrono::steady_clock::now();
    try {
      pending->wait();
      ADD_FAILURE() << "expected a timeout";
    } catch (const CommError& e) {
      const auto elapsed = std::chrono::steady_clock::now() - start;
      EXPECT_GE(elapsed, 2s);
      EXPECT_LT(elapsed, 5s);
      const std::string message = e.what();
      if (world->rank() == 0) std::fprintf(stderr, "rank 0 got: %s\n", message.c_str());
      const std::string missing = "rank(s) " + std::to_string(skipper) + " did not arrive";
      for (const std::string& part :
           {std::string("timed out after 2000 ms"), std::string("all_reduce #3"), missing,
            "rank " + std::to_string(skipper) + " #2"}) {
        EXPECT_NE(message.find(part), std::string::npos)
            << "'" << part << "' missing from: " << message;
      }
      EXPECT_EQ(message.find("dump failed"), std::string::npos) << message;
    }
  }
  sync->barrier();  // the skipper waits here until the others timed out (and dumped)
  if (world->rank() == skipper) {
    group->all_reduce(t);  // late: the others' pending all_reduce completes; dumped before it
  } else {
    pending->wait();
  }
  sync->barrier();

  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.json", world->rank());
  EXPECT_TRUE(fs::exists(dir / name)) << dir / name;
  sync->barrier();  // every dump written before rank 0 reads them
  if (world->rank() == 0) {
    const HangReport report = analyze_flight_dumps(dir.string());
    EXPECT_TRUE(report.missing_dumps.empty());
    const std::string text = report.text();
    std::fprintf(stderr, "loom debug hang would print:\n%s", text.c_str());
    std::string waiting;
    for (int r = 0; r < skipper; ++r) waiting += (r ? ", " : "") + std::to_string(r);
    EXPECT_NE(text.find("rank(s) " + waiting + " wait in all_reduce #3"), std::string::npos)
        << text;
    EXPECT_NE(text.find("rank(s) " + std::to_string(skipper) + " never reached #3"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("rank " + std::to_string(skipper) + " all_reduce #2 completed"),
              std::string::npos)
        << text;
    fs::remove_all(dir);
  }
  sync->barrier();
}

// The records carry group, sequence number, op, dtype, count and state, as in the local backend.
TEST(MpiFlight, RecordsCarryOpDtypeCountAndState) {
  auto world = make_mpi_world(patient());
  const int me = world->rank();
  const int n = world->size();
  Tensor t = Tensor::zeros({10}, DType::kBF16);
  world->all_reduce(t);
  world->barrier();
  auto sub = world->split(0, -me);  // reversed order
  Tensor u = Tensor::zeros({3});
  sub->broadcast(u, 0);
  if (n > 1) {
    if (me == 0) world->send(u, 1, 7);
    if (me == 1) world->recv(u, 0, 7);
  }
  const auto records = static_cast<MpiCommunicator&>(*world).flight_recorder().snapshot();
  const size_t expected = n > 1 && me < 2 ? 5 : 4;
  ASSERT_EQ(records.size(), expected);
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
  if (expected == 5) {
    EXPECT_EQ(records[4].group, "world:p2p");
    EXPECT_EQ(records[4].op, me == 0 ? "send(dst=1, tag=7)" : "recv(src=0, tag=7)");
  }
  for (const FlightRecord& rec : records) {
    EXPECT_EQ(rec.state, FlightState::kCompleted) << rec.op;
    EXPECT_GT(rec.t_issued, 0);
    EXPECT_GE(rec.t_started, rec.t_issued);
    EXPECT_GE(rec.t_completed, rec.t_started);
  }
  world->barrier();
}

}  // namespace
}  // namespace loom
