// What one training step measured on a rank, and the metrics.jsonl record world rank 0 writes
// from it (the fields: docs/formats.md, metrics.jsonl). Kept apart from the training loop, which
// gathers the figures, so that the loop reads as the step it runs.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/data_parallel.h"

namespace loom {

// One value per mesh axis, in the record's order.
// ep: expert parallelism's token exchange (recorded with StepFigures::expert_parallel only).
struct AxisFigures {
  double dp = 0, pp = 0, tp = 0, cp = 0, ep = 0;
};
struct AxisBytes {
  int64_t dp = 0, pp = 0, tp = 0, cp = 0, ep = 0;
};

// A pipeline's share of the record (pp > 1).
struct PipelineFigures {
  double bubble = 0;         // this rank's, over the step
  double bubble_theory = 0;  // the schedule's, at unit costs
  std::vector<double> bubble_by_pp_rank;
  int64_t bytes_sent = 0;
  // What the zero-bubble schedules' deferred weight gradients kept at most (zb-* only).
  std::optional<int64_t> max_deferred_bytes;
};

struct StepFigures {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double seconds = 0;            // the step's wall time on this rank
  double data_seconds = 0;       // in the loader, and copying batches to the device
  double comm_wait_seconds = 0;  // comm_wait_ms: the engine's waits (the stream's on GPUs)
  AxisFigures comm_seconds;      // blocked on each axis' communication
  AxisBytes comm_bytes;          // handed to each axis' communicator
  bool expert_parallel = false;  // parallel.ep > 1: the records' per-axis figures include "ep"
  // Hybrid sharding (parallel.dp_shard < dp): the part of comm_bytes.dp all-reduced over the
  // replicas (between shard groups: between nodes when a shard group is a node).
  std::optional<int64_t> dp_replicate_bytes;
  int64_t tokens_per_step = 0;
  int64_t tokens_total = -1;  // the run's tokens up to this step's end; -1: step × tokens_per_step
  int64_t batch_size = 0;     // the step's global batch in sequences (train.batch_rampup); 0: none
  double flops_per_step = 0;  // the model's, all ranks
  double peak_tflops = 0;     // one rank's, for the MFU
  int world_size = 1;
  int64_t peak_bytes = 0;  // the allocator's peak during the step
  int64_t held_bytes = 0;  // in use when the step began: the peak above it is activations
  DataParallelMemory state_bytes;
  std::optional<double> val_loss;
  std::vector<std::pair<std::string, double>> val_losses;  // data.val_sets', by name
  std::vector<double> data_epochs;   // each training source's epochs read (TrainData::epochs_read)
  std::optional<double> loss_scale;  // with loss scaling on
  std::optional<double> z_loss;  // with train.z_loss: the z-loss the step added (z · mean lse²)
  // With a mixture of experts: the balance losses the step added (coefficient × Σ over blocks of
  // the mean per-sequence balance loss; nn/moe_mlp.h).
  std::optional<double> moe_aux_loss;
  // With a mixture of experts: the busiest expert's share of the step's tokens over the mean
  // expert's, in the block where it is largest (1 = evenly spread).
  std::optional<double> moe_expert_load;
  // With an expert capacity (model.moe_capacity_factor): the share of the step's (token, expert)
  // choices, over every block, that the capacity dropped.
  std::optional<double> moe_dropped;
  bool skipped = false;              // overflowed gradients: no optimizer step
  std::optional<PipelineFigures> pipeline;

  // Where the step went apart from the loader and the waits on communication: computing.
  double compute_seconds() const {
    const double c = seconds - data_seconds - comm_seconds.dp - comm_seconds.pp - comm_seconds.tp -
                     comm_seconds.cp - comm_seconds.ep;
    return c > 0 ? c : 0.0;
  }
};

nlohmann::json step_record(const StepFigures& f);

// The progress line of an evaluation step, "step 8: val loss 4.1234 | web 4.0012 | code 4.3001"
// (data.val's loss, then data.val_sets'), or "" on a step without evaluation.
std::string validation_message(const StepFigures& f);

}  // namespace loom
