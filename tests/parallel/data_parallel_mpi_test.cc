// Data and pipeline parallelism over the mpi backend (issues 4, 6): `run_training` started by
// mpirun trains with dp = the job's size (ZeRO 0-3), then with pp = the job's size (1F1B and
// GPipe); the losses match a single-device run (computed by rank 0 on a local world of one) to
// 1e-5 relative at every step. Runs under mpirun -np 2 and 3. HybridMpi (issue 7): under
// mpirun -np 4, hybrid layouts (dp × tp, pp × tp with sequence parallelism, dp × pp with ZeRO-1
// and interleaving, ZeRO-3 sharded in two pairs: parallel.dp_shard) as processes, against one
// device the same way.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/local/local_backend.h"
#include "comm/mpi/mpi_backend.h"
#include "data/dataset.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

std::vector<double> losses(const fs::path& run) {
  std::ifstream in(run / "metrics.jsonl");
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

TEST(DataParallelMpi, EveryZeroStageMatchesOneDevice) {
  std::unique_ptr<Communicator> world = make_mpi_world();
  if (world->size() > 3) GTEST_SKIP() << "runs under mpirun -np 2 and 3";
  // The ranks of one mpirun share its pid as their parent: one directory for the job.
  const fs::path root = fs::temp_directory_path() / ("loom_dp_mpi_" + std::to_string(getppid()));
  if (world->rank() == 0) {
    fs::remove_all(root);
    synthesize_addition((root / "data").string(), 40000, 4000, 3);
  }
  world->barrier();

  Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 2
n_heads = 2
[train]
steps = 6
batch_size = 12
micro_batch_size = 2
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 0
[runtime]
threads_per_rank = 1
)", "dp_mpi_test.toml");
  c.data.train = (root / "data" / "train_*.bin").string();
  c.train.batch_size = 12;
  c.train.micro_batch_size = world->size() == 3 ? 2 : 3;  // 2 micro-batches either way

  TrainOptions o;
  o.progress = false;
  for (int zero = 0; zero <= 3; ++zero) {
    Config dp = c;
    dp.parallel.zero = zero;
    o.run_dir = (root / ("zero" + std::to_string(zero))).string();
    run_training(dp, o);  // under mpirun: the mpi backend, dp = world size
  }
  if (world->rank() == 0) {
    Config one = c;
    one.train.micro_batch_size = 6;
    o.run_dir = (root / "one").string();
    auto local = make_local_world(1);
    train_on(*local[0], one, o, Device::cpu());
    const std::vector<double> ref = losses(root / "one");
    ASSERT_EQ(ref.size(), 6u);
    for (int zero = 0; zero <= 3; ++zero) {
      const std::vector<double> got = losses(root / ("zero" + std::to_string(zero)));
      ASSERT_EQ(got.size(), ref.size()) << "zero " << zero;
      for (size_t i = 0; i < ref.size(); ++i)
        EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << "zero " << zero << " step " << i + 1;
    }
  }
  // Pipeline parallelism over MPI send/recv (np 2: pp = 2, both schedules; np 3: pp = 3).
  for (const char* schedule : {"1f1b", "gpipe"}) {
    Config pp = c;
    pp.parallel.pp = world->size();
    pp.parallel.schedule = schedule;
    pp.model.n_layers = 3;
    pp.train.micro_batch_size = 2;  // 6 micro-batches through the pipeline
    o.run_dir = (root / (std::string("pp_") + schedule)).string();
    run_training(pp, o);
  }
  if (world->rank() == 0) {
    Config one = c;
    one.model.n_layers = 3;
    one.train.micro_batch_size = 6;
    o.run_dir = (root / "one_3layers").string();
    auto local = make_local_world(1);
    train_on(*local[0], one, o, Device::cpu());
    const std::vector<double> ref = losses(root / "one_3layers");
    for (const char* schedule : {"1f1b", "gpipe"}) {
      const std::vector<double> got = losses(root / (std::string("pp_") + schedule));
      ASSERT_EQ(got.size(), ref.size()) << schedule;
      for (size_t i = 0; i < ref.size(); ++i)
        EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << schedule << " step " << i + 1;
    }
  }
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}

TEST(HybridMpi, LayoutsOfFourProcessesMatchOneDevice) {
  std::unique_ptr<Communicator> world = make_mpi_world();
  if (world->size() != 4) GTEST_SKIP() << "needs mpirun -np 4";
  const fs::path root = fs::temp_directory_path() / ("loom_hybrid_mpi_" + std::to_string(getppid()));
  if (world->rank() == 0) {
    fs::remove_all(root);
    synthesize_addition((root / "data").string(), 40000, 4000, 3);
  }
  world->barrier();
  Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 4
n_heads = 4
[train]
steps = 6
batch_size = 8
micro_batch_size = 2
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 0
[runtime]
threads_per_rank = 1
)", "hybrid_mpi_test.toml");
  c.data.train = (root / "data" / "train_*.bin").string();
  struct Layout {
    const char* name;
    int dp, pp, tp, zero;
    const char* schedule;
    int chunks;
    bool sp;
    int dp_shard;
  };
  const Layout layouts[] = {{"dp2_tp2", 2, 1, 2, 0, "1f1b", 1, false, 0},
                            {"pp2_tp2_sp", 1, 2, 2, 0, "1f1b", 1, true, 0},
                            {"dp2_pp2_zero1_interleaved", 2, 2, 1, 1, "interleaved", 2, false, 0},
                            // hybrid sharding: ZeRO-3 in two pairs of processes
                            {"dp4_zero3_shard2", 4, 1, 1, 3, "1f1b", 1, false, 2}};
  TrainOptions o;
  o.progress = false;
  for (const Layout& l : layouts) {
    Config h = c;
    h.parallel.dp = l.dp;
    h.parallel.pp = l.pp;
    h.parallel.tp = l.tp;
    h.parallel.zero = l.zero;
    h.parallel.schedule = l.schedule;
    h.parallel.virtual_stages = l.chunks;
    h.parallel.sequence_parallel = l.sp;
    h.parallel.dp_shard = l.dp_shard;
    o.run_dir = (root / l.name).string();
    run_training(h, o);  // under mpirun: the mpi backend
  }
  if (world->rank() == 0) {
    Config one = c;
    one.train.micro_batch_size = 8;
    o.run_dir = (root / "one").string();
    auto local = make_local_world(1);
    train_on(*local[0], one, o, Device::cpu());
    const std::vector<double> ref = losses(root / "one");
    ASSERT_EQ(ref.size(), 6u);
    for (const Layout& l : layouts) {
      const std::vector<double> got = losses(root / l.name);
      ASSERT_EQ(got.size(), ref.size()) << l.name;
      for (size_t i = 0; i < ref.size(); ++i)
        EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << l.name << " step " << i + 1;
    }
  }
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}

}  // namespace
}  // namespace loom
