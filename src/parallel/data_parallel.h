// Data parallelism with ZeRO stages 0-3 (issue 4): every rank of the dp group runs the whole
// model on its own part of the global batch; gradients are combined so that the run equals one
// device with the global batch.
//
// Stage 0 (DDP): full parameters, gradients and AdamW moments on every rank. Gradients are
//   grouped into buckets (DataParallelConfig::bucket_bytes, 25 MiB like PyTorch DDP) in reverse
//   order of the units (the order backward produces them); on the last micro-batch of a step,
//   each bucket's all-reduce (avg) starts from the hook that finalises its last unit, so it runs
//   on the communicator's progress thread while backward goes on.
// Stage 1 (Megatron-LM's distributed optimizer): full gradients accumulate over the micro-batches
//   as in stage 0, but on the last one each unit's gradient is reduce-scattered (avg) from the
//   hook that finalises it, the reduced chunk written over the rank's own part of the buffer;
//   each rank keeps the moments of its own chunk of every unit only, updates that chunk, then
//   all-gathers each unit's parameters. A reduce-scatter and an all-gather a step: 2Ψ on the
//   wire where stage 0's all-reduce plus the gather would be 3Ψ, and no more than stage 0's
//   all-reduce alone.
// Stage 2: also shards gradients: a unit's full gradient exists only from its before_backward to
//   its after_backward, where it is reduce-scattered (avg) into the rank's gradient shard; with
//   accumulation this happens every micro-batch (like DeepSpeed ZeRO-2 and FSDP without no_sync),
//   so no full-size gradient outlives one unit's backward.
// Stage 3 (FSDP): also shards parameters: each unit's values are all-gathered right before its
//   forward and its backward and freed after; the next unit's gather is issued (prefetched)
//   before the current one computes, so it overlaps compute. The root unit (embeddings, final
//   LayerNorm) is held from the start of forward to its end, and again through backward.
//
// Chunks: with N ranks every unit is padded to a multiple of 16·N elements (ParameterStore's
// unit_multiple), and rank r owns the r-th of its N equal chunks; the rank's shard buffers
// (moments, and gradients/values in stages 2/3) are its chunks of all units, concatenated.
//
// Hybrid sharding (HSDP; DataParallelConfig::shard_group / replicate_group, parallel.dp_shard):
// the stages' sharding spans a group of S of the dp ranks, not all of them, and the dp / S groups
// are replicas of each other — torchtitan's HSDP, DeepSpeed's MiCS. A rank's chunks are its
// shard group's; stages 1-3 reduce-scatter a unit over the shard group and then all-reduce the
// chunk over the replica group (the ranks holding the same chunk), issued a unit later so that
// both exchanges overlap the backward; ZeRO-3's gathers and stages 1/2's parameter gathers stay
// within the shard group.
// On a cluster the shard group is a node's GPUs (fast links) and only the replicas' all-reduce
// of 1/S of the gradients crosses nodes, where plain ZeRO-3 gathers every weight across them
// twice a step; the state per rank is 1/S, not 1/dp.
//
// Expert units (ParamUnit::experts, under expert parallelism): their own buckets (stage 0),
// reduced, sharded and gathered over DataParallelConfig::experts_data_parallel — the chunks then
// split that group's ranks, a rank's chunk of an expert unit is its rank there.
//
// Equivalence with one device: each rank's loss is the mean over its micro-batch tokens scaled by
// 1/micro-batches; the avg over ranks makes the gradient the mean over the global batch. The
// global-norm clip uses the norm of the full gradient (in stages 2/3 the sum of squares of the
// shards, all-reduced). Every reduction has a fixed order, so the same layout run twice gives the
// same bits.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "base/thread_pool.h"
#include "comm/communicator.h"
#include "nn/hooks.h"
#include "nn/parameter.h"
#include "nn/rounded_weights.h"
#include "optim/adamw.h"

namespace loom {

struct DataParallelConfig {
  int zero = 0;                             // ZeRO stage 0..3
  int64_t bucket_bytes = int64_t{25} << 20;  // stage 0's all-reduce bucket size
  // What gradients are reduced in over dp (parallel.grad_reduce_dtype): kF32, or kBF16 — each
  // bucket (stage 0) or unit (stages 1-3) rounded to bf16 before its collective and widened
  // after, into the fp32 gradients (Megatron's --grad-reduce-in-bf16, DeepSpeed's
  // communication_data_type): half the bytes on the wire, gradients rounded once to bf16 plus
  // the backend's bf16 sums.
  DType reduce_dtype = DType::kF32;
  // What ZeRO-3 gathers the parameters in for forward and backward (parallel.param_gather_dtype):
  // kF32, or kBF16 — each rank's chunk rounded to bf16, gathered, widened (FSDP's
  // MixedPrecision(param_dtype=bfloat16)): half the bytes of the gathers, and the forward and
  // backward compute with the weights rounded to bf16 (the fp32 shards stay the optimizer's).
  DType gather_dtype = DType::kF32;
  // When the model is itself split over a tensor-parallel group: the gradient norm then sums
  // the sharded parameters' squares over that group and counts replicated ones (those without
  // ShardPiece pieces) once.
  Communicator* tensor_parallel = nullptr;
  // When the model holds a block of a mixture's experts (expert parallelism, parallel/
  // expert_parallel.h; the store's ParamUnit::experts units): the ranks holding the same experts,
  // over which those units are averaged, sharded and gathered instead of over dp, their gradients
  // divided by the expert-parallel group's size first (each sums its group's tokens); and the
  // expert-parallel group, over which the gradient norm sums their squares (whole gradients:
  // stage 0; the pipeline engine's norm too).
  Communicator* experts_data_parallel = nullptr;
  Communicator* expert_parallel = nullptr;
  // Hybrid sharding (both or neither; split_shard_groups): the ranks a rank's ZeRO state is
  // sharded over, a subgroup of the `dp` given to DataParallel::create, and the ranks holding
  // the same chunks, over which stages 2/3 all-reduce the reduce-scattered gradients. Expert
  // units stay sharded over experts_data_parallel.
  Communicator* shard_group = nullptr;
  Communicator* replicate_group = nullptr;
};

// Hybrid sharding's groups out of the gradients' group `gradients` (dp, or dp × cp with context
// parallelism: rank d·cp + c), for shard_degree dividing dp: the shard group of dp rank d is dp
// ranks [d − d mod S, + S) with all their cp ranks (torchtitan shards over dp_shard × cp), the
// replicate group the ranks with the same d mod S and cp rank. Collective over `gradients`.
struct ShardGroups {
  std::unique_ptr<Communicator> shard, replicate;
};
ShardGroups split_shard_groups(Communicator& gradients, int shard_degree, int cp = 1);

// Bytes this rank holds, measured on its allocator when the buffers were made.
struct DataParallelMemory {
  int64_t params = 0;     // persistent parameter values (full, or the shard in stage 3)
  int64_t grads = 0;      // persistent gradients (full, or the shard in stages 2/3)
  int64_t optimizer = 0;  // AdamW moments (full, or the shard in stages 1-3)
  int64_t state() const { return params + grads + optimizer; }
};

// What the last step's communication did (for metrics and the overlap test).
struct DataParallelStepStats {
  int64_t collectives = 0;           // gradient/parameter collectives issued
  int64_t done_before_backward_end = 0;  // gradient collectives seen complete from a hook
  double wait_seconds = 0;           // time spent blocked on communication
};

class DataParallel : public ParamHooks {
 public:
  // Lays out, allocates (f32, on `device`) and initialises (from `seed`, as one device would)
  // the store's state for the stage; the store must hold registered, unallocated parameters.
  // `pool` runs the engine's element loops. Collective over `dp`.
  static std::unique_ptr<DataParallel> create(ParameterStore& params, Communicator& dp,
                                              ThreadPool& pool, Device device,
                                              const DataParallelConfig& config,
                                              const AdamWConfig& adamw, uint64_t seed);
  ~DataParallel() override = default;

  // One optimizer step:
  //   begin_step();
  //   for m in 0..count-1: begin_micro_batch(m, count); forward; backward(scale 1/count);
  //                        end_micro_batch();
  //   norm = clip_grad_norm(max_norm); optimizer_step(lr);
  virtual void begin_step() = 0;
  virtual void begin_micro_batch(int64_t index, int64_t count) = 0;
  // Waits for the gradient communication this micro-batch started.
  virtual void end_micro_batch() = 0;
  // The global gradient norm (of the full, averaged gradient). When it exceeds max_norm > 0 the
  // gradients are clipped by max_norm / norm: the stored gradients stay as they are and the
  // next optimizer_step reads them times that factor (the same rounded values an in-place
  // scaling would store, without a pass of its own over every gradient).
  // `loss_scale` (a power of two, optim/loss_scaler.h): the backward pass ran on loss ×
  // loss_scale; the norm returned is the unscaled gradient's and the optimizer reads the
  // gradients times clip factor / loss_scale — bit for bit the unscaled run's values. A
  // non-finite result means an overflow: the caller skips optimizer_step (begin_step clears).
  virtual double clip_grad_norm(double max_norm, double loss_scale = 1.0) = 0;
  // Sets the factor the next optimizer_step reads the gradients with, as clip_grad_norm does,
  // for a caller that computed the global norm itself (the pipeline, over all its stages).
  virtual void set_gradient_factor(float factor) = 0;
  // For a caller summing the norm over several engines (the pipeline's stages) under stages 1-3:
  // the sum of squares of the reduced gradient, summed over the ranks that share it out (dp, or
  // the shard group and the replicas, the experts' groups) as clip_grad_norm sums it, but not
  // over tp (a parameter replicated over tp counted on tp rank 0 only); `skip`'s elements left
  // out (the pipeline's second copy of a tied embedding). Collective over dp.
  virtual double grad_sum_squares(const Parameter* skip) = 0;
  // Stage 1: the unit holding `p` is not reduce-scattered by the backward hooks but by
  // reduce_deferred(), once the caller has added what it must to its gradient (the pipeline's
  // tied embedding: both copies' sums over this rank's micro-batches, before the average over dp).
  // Called before the first step.
  virtual void defer_reduction(const Parameter* p) = 0;
  // The deferred units' reduce-scatters, issued and waited for (after the step's last
  // end_micro_batch; collective over dp).
  virtual void reduce_deferred() = 0;
  virtual void optimizer_step(float lr) = 0;

  // The whole model state on every rank (collective: stages 1-3 all-gather their shards), for
  // checkpoints; and back from a whole state, each rank keeping its part.
  virtual FlatModelState gather_state() = 0;
  virtual void load_state(const FlatModelState& state, int64_t optimizer_steps) = 0;
  virtual int64_t optimizer_steps() const = 0;
  // What this rank writes of a sharded checkpoint (checkpoint/sharded_checkpoint.h), without
  // communicating: flat ranges of the store's layout — its chunk of every unit; in stage 0, where
  // every rank holds everything, the same split, so that the ranks write disjoint parts — and
  // the values and moments of those ranges, concatenated (on the engine's device).
  virtual FlatModelState owned_state(std::vector<std::pair<int64_t, int64_t>>& ranges) = 0;

  virtual int zero_stage() const = 0;
  const DataParallelMemory& memory() const { return memory_; }
  // On a GPU at bf16 / fp16 matmul precision under stages 0-2, the 16-bit copies of this rank's
  // weights that its GEMMs read (nn/rounded_weights.h; a training step puts them in its Context):
  // made again at their first use after each optimizer_step or load_state, counted in
  // memory().params. Stage 3 holds no whole weights between a unit's forward and its backward:
  // with bf16 gathers at bf16 matmul precision it lends the gathered bf16 values as the copies
  // while the unit is gathered (kept that long beside the fp32 ones); else its GEMMs cast the
  // gathered values as they come (null).
  RoundedWeights* rounded_weights() const { return rounded_weights_.get(); }
  const DataParallelStepStats& step_stats() const { return step_stats_; }

 protected:
  DataParallelMemory memory_;
  DataParallelStepStats step_stats_;
  std::unique_ptr<RoundedWeights> rounded_weights_;
};

}  // namespace loom
