// run_training: the job's ranks (thread ranks of this process, or one process of an MPI job),
// the device each computes on, and the communicators between them; each rank then runs train_on
// (trainer.cc). GPU ranks talk through nccl, or through their host communicator with tensors
// staged through host memory (comm/staged.h).
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "comm/local/local_backend.h"
#include "comm/mpi/launch_env.h"
#include "comm/staged.h"
#ifdef LOOM_WITH_MPI
#include "comm/mpi/mpi_backend.h"
#endif
#ifdef LOOM_WITH_NCCL
#include "comm/nccl/nccl_backend.h"
#endif
#include "device/cuda/cuda_backend.h"
#include "kernels/ops.h"
#include "train/trainer.h"

namespace loom {
namespace fs = std::filesystem;

namespace {

// GPU jobs (runtime.device = "cuda") talk through nccl built over their host communicator, or,
// under runtime.backend = "local" / "mpi", through the host communicator itself with every tensor
// staged through host memory (comm/staged.h).
bool host_staged(const Config& config) {
  return config.runtime.backend == "local" || config.runtime.backend == "mpi";
}

// The rank with local index r computes on GPU r (one rank alone on the configured cuda:N); host
// staged ranks may share GPUs, round robin.
Device rank_device(const Config& config, int local_rank) {
  const Device configured = Device::parse(config.runtime.device);
  if (!configured.is_cuda()) return Device::cpu(local_rank);
  if (config.runtime.ranks == 1) return configured;
  return Device::cuda(host_staged(config) ? local_rank % cuda::device_count() : local_rank);
}

std::unique_ptr<Communicator> gpu_world(Communicator& host, const Config& config, Device device,
                                        int local_rank, const CommOptions& options) {
  if (!device.is_cuda()) return nullptr;
  if (host_staged(config))
    return std::make_unique<StagedCommunicator>(host, Device::cpu(local_rank));
#ifdef LOOM_WITH_NCCL
  return make_nccl_world(host, device.index, options);
#else
  fail("runtime.device = '", config.runtime.device,
       "': GPU ranks talk through nccl, which this "
       "build lacks (LOOM_CUDA=OFF)");
#endif
}

// One rank of a job on `host` (its local or mpi communicator), on its device.
TrainSummary train_rank(Communicator& host, const Config& config, const TrainOptions& options,
                        int local_rank, const CommOptions& comm_options) {
  const Device device = rank_device(config, local_rank);
  std::unique_ptr<Communicator> gpu = gpu_world(host, config, device, local_rank, comm_options);
  // Under nccl the pipeline's messages go GPU to GPU, one nccl communicator per direction
  // (train_on wraps the pp axis: comm/directed_p2p.h).
  return train_on(gpu ? *gpu : host, config, options, device);
}

// Thread ranks of the local backend: rank r computes on cpu:r (its own allocator, so memory
// figures are per rank), or on GPU r. The first rank to fail aborts the world, so the others stop
// at their next communication, and its error is the one reported.
TrainSummary train_local_ranks(const Config& config, const TrainOptions& options, int ranks) {
  CommOptions comm_options;
  comm_options.flight_dir = (fs::path(options.run_dir) / "flight").string();
  std::vector<std::unique_ptr<Communicator>> world = make_local_world(ranks, comm_options);
  if (ranks == 1) return train_rank(*world[0], config, options, 0, comm_options);
  auto& abort_target = dynamic_cast<LocalCommunicator&>(*world[0]);
  std::mutex mutex;
  std::string first_error;
  TrainSummary summary;
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        TrainSummary s = train_rank(*world[r], config, options, r, comm_options);
        if (r == 0) summary = s;
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        if (first_error.empty()) {
          first_error = "rank " + std::to_string(r) + ": " + e.what();
          abort_target.abort("rank " + std::to_string(r) + " failed: " + e.what());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!first_error.empty()) throw Error(first_error);
  return summary;
}

}  // namespace

// runtime.backend = "auto": mpi when started by mpirun/srun, else local; an explicit value wins.
// "nccl" (GPUs) bootstraps over mpi under a launcher, over local thread ranks otherwise.
bool started_by_launcher(const Config& config) {
  const std::string& backend = config.runtime.backend;
  return backend == "mpi" ||
         ((backend == "auto" || backend == "nccl") && detect_launch_env().under_launcher);
}

void resolve_layout(Config& config) {
  const int world = started_by_launcher(config) ? detect_launch_env().size : config.runtime.ranks;
  resolve_parallel_degrees(config.parallel, world);
  config.runtime.ranks = world;
}

TrainSummary run_training(const Config& config_in, const TrainOptions& options) {
  Config config = config_in;
  resolve_layout(config);
  validate(config);
  const bool use_mpi = started_by_launcher(config);
  const Device device = Device::parse(config.runtime.device);
  if (device.is_cuda()) {
    if (!cuda_available())
      fail("runtime.device = '", config.runtime.device, "': no usable GPU (",
           cuda::unavailable_reason(), ")");
    const int gpus = cuda::device_count();
    const int local_ranks = use_mpi ? 1 : config.runtime.ranks;  // this process drives them
    // nccl needs a GPU per rank; host-staged ranks share what there is.
    const int needed = config.runtime.ranks == 1 ? device.index + 1
                       : host_staged(config)     ? 1
                       : use_mpi                 ? detect_launch_env().local_rank + 1
                                                 : local_ranks;
    if (needed > gpus)
      fail("runtime.device = '", config.runtime.device, "' with ", config.runtime.ranks,
           " rank(s): needs GPU cuda:", needed - 1, " but only ", gpus, " GPU(s) are visible",
           use_mpi ? " on this node"
                   : " (nccl: one GPU per rank; runtime.backend = \"local\" "
                     "shares GPUs through host memory)");
  }
  // The process's GEMM precision for this run: the GPUs', and at bf16 the CPU's too (ops.h).
  const ops::MatmulPrecisionScope precision(config.runtime.matmul_precision,
                                            config.runtime.fp8_block);
  if (use_mpi) {
#ifdef LOOM_WITH_MPI
    CommOptions comm_options;
    comm_options.flight_dir = (fs::path(options.run_dir) / "flight").string();
    std::unique_ptr<Communicator> world = make_mpi_world(comm_options);
    return train_rank(*world, config, options, detect_launch_env().local_rank, comm_options);
#else
    fail(
        "runtime.backend = \"mpi\" (or started by mpirun/srun), but this build has no MPI "
        "backend (LOOM_MPI=OFF)");
#endif
  }
  return train_local_ranks(config, options, config.runtime.ranks);
}

}  // namespace loom
