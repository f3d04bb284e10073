// The single-device training loop: data -> forward -> backward (accumulated over micro-batches)
// -> global-norm clip -> AdamW with warm-up + cosine LR -> metrics, evaluation, checkpoints.
//
// Determinism: the run is a pure function of the config. Initial weights come from the
// counter-based RNG, the loader position is saved in checkpoints and every kernel is
// deterministic, so a resumed run continues bit for bit as if never stopped.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "config/config.h"
#include "device/device.h"
#include "parallel/data_parallel.h"

namespace loom {

struct TrainOptions {
  std::string run_dir;      // metrics.jsonl, config.toml and checkpoints/ go here
  std::string resume;       // "" (fresh), "auto" (latest checkpoint, if any) or a step_N dir
  int64_t stop_after = 0;   // > 0: end cleanly after this step with a checkpoint
  bool progress = true;     // print the progress line
  // Stop gracefully on SIGTERM/SIGINT (train/run_control.h): every step's end agrees over
  // the world whether one arrived; if so the run saves a checkpoint there and returns.
  bool stop_on_signal = false;
};

struct TrainSummary {
  int64_t start_step = 0;   // steps already done when this run began (resume)
  int64_t last_step = 0;    // steps done when it ended
  double last_loss = 0;
  double first_loss = 0;    // loss of the first step this run took
  double last_val_loss = -1;
  std::map<std::string, double> last_val_losses;  // data.val_sets', at the last evaluation
  int64_t skipped_steps = 0;  // steps whose gradients overflowed under loss scaling
  double tokens_per_s = 0;  // mean over the steps this run took
  int64_t peak_bytes = 0;   // allocator peak on rank 0's device during a step
  int64_t activation_peak_bytes = 0;  // of which above what was held when the step began
  double comm_wait_s = 0;   // rank 0's time blocked on data-parallel communication, all steps
  DataParallelMemory memory;  // rank 0's parameter, gradient and optimizer bytes
  std::string last_checkpoint;
  // Rank 0's time the training loop spent in checkpoint saves, all of them (with
  // train.async_checkpoint: staging, and waiting for a write that was not done when needed).
  double checkpoint_stall_s = 0;
  std::string layout_report;               // printed at start-up (train/layout_report.h)
  int64_t expected_activation_bytes = 0;  // rank 0's estimate in that report
  int stopped_by_signal = 0;  // the signal that ended the run early (stop_on_signal), else 0
};

// Trains with the layout the config gives: thread ranks of the local backend
// (runtime.ranks, `loom train --ranks N`), or one process of an MPI job when started by
// mpirun/srun (or runtime.backend = "mpi"). Returns rank 0's summary.
TrainSummary run_training(const Config& config, const TrainOptions& options);

// One rank of a job whose ranks are those of `world` (any backend), computing on `device`; the
// config must be resolved (resolve_layout) for world.size() ranks. `pipeline_world`, when given,
// spans the same ranks in the same order and carries the pipeline axis instead of `world` (such
// as a comm/staged.h communicator, through the host); otherwise, under nccl, the pipeline's
// messages go GPU to GPU over one nccl communicator per direction (comm/directed_p2p.h). For
// tests and embedding: run_training makes the worlds itself.
class Communicator;
TrainSummary train_on(Communicator& world, const Config& config, const TrainOptions& options,
                      Device device, Communicator* pipeline_world = nullptr);

// Sets runtime.ranks to the job's size (the launcher's world size when started by mpirun/srun,
// else runtime.ranks) and infers the parallel degrees left out (resolve_parallel_degrees):
// `mpirun -n 4 loom train cfg.toml` and `loom train --ranks 4` train dp = 4; with tp = 2 set,
// dp = 2.
void resolve_layout(Config& config);

// Whether this process is one rank of a job started by mpirun/srun (runtime.backend "mpi", or
// "auto"/"nccl" under a launcher), not the one process of thread ranks.
bool started_by_launcher(const Config& config);

// The model shape a config describes.
struct Gpt2Config;
Gpt2Config model_config_of(const Config& config);

}  // namespace loom
