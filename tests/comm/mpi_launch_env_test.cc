// detect_launch_env: each launcher's variables, precedence, and malformed values.
#include <gtest/gtest.h>

#include <cstdlib>

#include "base/error.h"
#include "comm/mpi/launch_env.h"

namespace loom {
namespace {

constexpr const char* kAllVariables[] = {"OMPI_COMM_WORLD_RANK",
                                         "OMPI_COMM_WORLD_SIZE",
                                         "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "PMIX_RANK",
                                         "PMI_RANK",
                                         "PMI_SIZE",
                                         "MPI_LOCALRANKID",
                                         "PMI_LOCAL_RANK",
                                         "SLURM_PROCID",
                                         "SLURM_NTASKS",
                                         "SLURM_STEP_NUM_TASKS",
                                         "SLURM_LOCALID"};

// Clears every launcher variable before and after each test (the test may itself run under one).
class LaunchEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const char* name : kAllVariables) unsetenv(name);
  }
  static void set(const char* name, const char* value) { setenv(name, value, /*overwrite=*/1); }
};

TEST_F(LaunchEnvTest, NoLauncher) {
  LaunchEnv env = detect_launch_env();
  EXPECT_FALSE(env.under_launcher);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.launcher, "");
}

TEST_F(LaunchEnvTest, OpenMpi) {
  set("OMPI_COMM_WORLD_RANK", "5");
  set("OMPI_COMM_WORLD_SIZE", "8");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  set("PMIX_RANK", "5");  // Open MPI 4 sets both; its own variables win
  LaunchEnv env = detect_launch_env();
  EXPECT_TRUE(env.under_launcher);
  EXPECT_EQ(env.launcher, "openmpi");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.size, 8);
  EXPECT_EQ(env.local_rank, 1);
}

TEST_F(LaunchEnvTest, Pmix) {
  set("PMIX_RANK", "2");
  set("SLURM_NTASKS", "4");
  set("SLURM_LOCALID", "0");
  LaunchEnv env = detect_launch_env();
  EXPECT_TRUE(env.under_launcher);
  EXPECT_EQ(env.launcher, "pmix");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.size, 4);
  EXPECT_EQ(env.local_rank, 0);
}

TEST_F(LaunchEnvTest, MpichHydra) {
  set("PMI_RANK", "3");
  set("PMI_SIZE", "4");
  set("MPI_LOCALRANKID", "3");
  LaunchEnv env = detect_launch_env();
  EXPECT_TRUE(env.under_launcher);
  EXPECT_EQ(env.launcher, "mpich");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.size, 4);
  EXPECT_EQ(env.local_rank, 3);
}

TEST_F(LaunchEnvTest, SlurmSrun) {
  set("SLURM_PROCID", "6");
  set("SLURM_NTASKS", "16");         // the allocation
  set("SLURM_STEP_NUM_TASKS", "8");  // this srun step: wins
  set("SLURM_LOCALID", "2");
  LaunchEnv env = detect_launch_env();
  EXPECT_TRUE(env.under_launcher);
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.size, 8);
  EXPECT_EQ(env.local_rank, 2);
}

TEST_F(LaunchEnvTest, SlurmWithoutTaskCountIsNotLaunched) {
  set("SLURM_PROCID", "0");
  EXPECT_FALSE(detect_launch_env().under_launcher);
}

TEST_F(LaunchEnvTest, MissingLocalRankDefaultsToZero) {
  set("PMI_RANK", "1");
  set("PMI_SIZE", "2");
  EXPECT_EQ(detect_launch_env().local_rank, 0);
}

TEST_F(LaunchEnvTest, MalformedValueNamesTheVariable) {
  set("OMPI_COMM_WORLD_RANK", "two");
  set("OMPI_COMM_WORLD_SIZE", "4");
  try {
    detect_launch_env();
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_RANK='two'"), std::string::npos)
        << e.what();
  }
}

TEST_F(LaunchEnvTest, RankOutsideSizeThrows) {
  set("PMI_RANK", "4");
  set("PMI_SIZE", "4");
  EXPECT_THROW(detect_launch_env(), Error);
}

TEST_F(LaunchEnvTest, RankWithoutSizeThrows) {
  set("OMPI_COMM_WORLD_RANK", "0");
  EXPECT_THROW(detect_launch_env(), Error);
}

}  // namespace
}  // namespace loom
