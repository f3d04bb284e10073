// detect_launch_env — is this process one rank of a job started by a launcher, and which one?
//
// Reads only environment variables (no MPI), so `loom train` can pick the mpi backend when it
// was started by mpirun or srun and the local backend otherwise. Checked in this order, the first
// launcher whose rank variable is set wins:
//   Open MPI (mpirun)   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   PMIx                PMIX_RANK (size and local rank from OMPI_* / PMI_* when also set)
//   MPICH / Hydra       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
//   Slurm (srun)        SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID
// Leaves out: a batch script's own shell under sbatch sets SLURM_PROCID too; we only count it
// as launched when SLURM_STEP_NUM_TASKS or SLURM_NTASKS says how many ranks there are.
#pragma once

#include <string>

namespace loom {

struct LaunchEnv {
  bool under_launcher = false;
  int rank = 0;
  int size = 1;
  int local_rank = 0;    // rank among the processes of this machine
  std::string launcher;  // "openmpi", "pmix", "mpich", "slurm"; empty when not launched
};

// Throws loom::Error naming the variable and its text when a set variable is not a valid
// number or the rank is outside [0, size).
LaunchEnv detect_launch_env();

}  // namespace loom
