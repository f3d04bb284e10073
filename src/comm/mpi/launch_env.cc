#include "comm/mpi/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <optional>

#include "base/error.h"

namespace loom {
namespace {

// The value of `name` as a non-negative int, nullopt when unset or empty.
std::optional<int> env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < 0 || value > 1'000'000'000) {
    fail("environment variable ", name, "='", text, "' is not a rank or rank count");
  }
  return static_cast<int>(value);
}

// The first of `names` that is set.
std::optional<int> first_env_int(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto value = env_int(name)) return value;
  }
  return std::nullopt;
}

}  // namespace

LaunchEnv detect_launch_env() {
  LaunchEnv env;
  std::optional<int> rank, size, local_rank;
  if ((rank = env_int("OMPI_COMM_WORLD_RANK"))) {
    env.launcher = "openmpi";
    size = env_int("OMPI_COMM_WORLD_SIZE");
    local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK");
  } else if ((rank = env_int("PMIX_RANK"))) {
    env.launcher = "pmix";
    size =
        first_env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
    local_rank = first_env_int({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"});
  } else if ((rank = env_int("PMI_RANK"))) {
    env.launcher = "mpich";
    size = env_int("PMI_SIZE");
    local_rank = first_env_int({"MPI_LOCALRANKID", "PMI_LOCAL_RANK"});
  } else if ((rank = env_int("SLURM_PROCID"))) {
    size = first_env_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
    if (!size) return LaunchEnv{};  // a batch shell, not an srun step (see the header)
    env.launcher = "slurm";
    local_rank = env_int("SLURM_LOCALID");
  } else {
    return env;
  }
  if (!size || *size < 1)
    fail(env.launcher, " launcher: rank ", *rank, " is set but the job size is not");
  if (*rank >= *size)
    fail(env.launcher, " launcher: rank ", *rank, " is outside a job of size ", *size);
  env.under_launcher = true;
  env.rank = *rank;
  env.size = *size;
  env.local_rank = local_rank.value_or(0);
  return env;
}

}  // namespace loom
