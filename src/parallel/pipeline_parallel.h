// Pipeline parallelism (issue 6): the model's blocks are cut into S = pp × v stages, placed on
// the pipeline ranks as the schedule says (pipeline_schedule.h: looped, stage s on rank s % pp
// as its chunk s / pp, or zb-v's V). Stage 0 holds the embedding, stage S−1 the final LayerNorm,
// LM head and loss; the tied token embedding lives on both and its two copies' gradients are
// summed, so they stay equal (on one rank, in the V, without a message).
//
// One engine runs any schedule: it walks this rank's action list; a forward stashes the chunk's
// activations per micro-batch (Gpt2::stash_activations) so several micro-batches can be in
// flight, a backward restores them. A zero-bubble schedule's B runs the backward with the
// Linears' weight gradients deferred (nn/deferred_weight_grads.h), its W runs them and only then
// lets the chunk's DataParallel engine see the units' gradients final. Activations and their
// gradients travel with tagged send/recv (shapes are known from the config: (micro_batch, seq_len,
// d_model) f32). Sends are asynchronous and waited for at the end of the step; receives block, and
// their waiting time is the measured bubble. A message between two stages of one rank (the V's
// turn) stays in memory.
//
// Each chunk's parameters are owned by a DataParallel engine over the dp group (a group of one
// without data parallelism), which allocates and initialises them as one device would and
// reduces their gradients; ZeRO stages 0 and 1 combine with pipelining.
//
// With tensor parallelism (PipelineConfig::tensor_parallel) every chunk is a TpGpt2 part split
// over the tp group: each tp rank of a stage talks to the same tp rank of the neighbouring
// stages (the pp group is the ranks with this rank's dp and tp coordinates), and the activations
// are (B·T, C), or the rank's (B·T/P, C) rows under sequence parallelism.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "models/gpt2.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline_schedule.h"

namespace loom {

struct PipelineConfig {
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  int microbatches = 1;
  int64_t micro_batch_size = 1;
  int64_t seq_len = 1;
  std::string layer_split;  // "" = balance by cost; else blocks per stage, "3,3,2"
  Communicator* tensor_parallel = nullptr;  // split each stage over this tp group
  ExpertExchange* experts = nullptr;        // a mixture's expert-parallel group (kept)
  bool sequence_parallel = false;           // (with tensor_parallel)
  bool tp_backward_overlap = true;          // (with tensor_parallel): Context::tp_backward_overlap
  float z_loss = 0;                         // the last stage's head: Context::z_loss
  bool reset_position_ids = false;          // the first stage's embedding: Context's
  // What stage boundaries send (parallel.pp_send_dtype): kF32, or kBF16 — activations and their
  // gradients rounded to bf16 for the message and widened on arrival (Megatron sends its
  // activations in the model's bf16): half the pp bytes, the residual stream rounded at each
  // boundary.
  DType send_dtype = DType::kF32;
  // Context parallelism: each micro-batch holds these positions of its sequences (seq_len of
  // them); null without.
  SequenceShard* sequence = nullptr;
  // train_step's and evaluate's token ids were checked against the vocabulary where they came
  // from (the trainer's loaders): a GPU's kernels skip their own check (kernels/exec.h).
  bool ids_checked = false;
};

// The blocks of each model stage: as `split` says (comma-separated block counts, one per stage,
// summing to n_layers), or, when it is empty, contiguous ranges that minimise the most
// expensive stage's forward FLOPs per token: 24·C² + 4·T·C per block, plus 2·V·C for the LM head
// on the last stage (the embedding lookup is free). Returns the first block of each stage and
// n_layers at the end (stages + 1 entries). Throws naming parallel.layer_split when it does not
// fit, or model.n_layers when there are fewer blocks than stages.
// With `v_placement` (zb-v: rank r runs stages r and S − 1 − r) the blocks instead balance each
// rank's two stages together (what bounds its step), then split each rank's blocks between its
// two stages as evenly as the costs allow.
std::vector<int64_t> pipeline_partition(const Gpt2Config& model, int64_t seq_len, int stages,
                                        const std::string& split, bool v_placement = false);

// What a micro-batch costs on each stage (stage_begin: pipeline_partition's), in FLOPs per token,
// for zb-v's list scheduler: forward the partition's cost; B the input gradients' GEMMs plus
// twice the attention; W the weight gradients' GEMMs (the LM head's on the last stage).
StageCosts pipeline_stage_costs(const Gpt2Config& model, int64_t seq_len,
                                const std::vector<int64_t>& stage_begin);

struct PipelineStepStats {
  double step_seconds = 0;
  double recv_wait_seconds = 0;  // time blocked waiting for a neighbour: the bubble
  int max_in_flight = 0;         // most micro-batches whose activations this rank held at once
  // Zero-bubble schedules: most micro-batches whose weight gradients waited for their W at once
  // (after B), and the most bytes they held then (each Linear's input and output gradient).
  int max_deferred = 0;
  int64_t max_deferred_bytes = 0;
  int64_t bytes_sent = 0;
  // With PipelineConfig::z_loss > 0: the step's mean lse² over its positions (every stage's
  // figure, as the loss), which times z_loss is the z-loss the step added.
  double mean_lse_square = 0;
  // The step's balance losses of a mixture of experts (Gpt2Stage::aux_loss): each stage's
  // summed, the mean over micro-batches and dp ranks, as the loss; 0 for dense blocks.
  double aux_loss = 0;
  // With a mixture of experts: the step's tokens per expert (n_layers × experts, block-major) and
  // the pairs dropped, summed over micro-batches, stages and dp ranks
  // (Gpt2Stage::add_expert_tokens).
  std::vector<double> expert_tokens;
  double bubble() const { return step_seconds > 0 ? recv_wait_seconds / step_seconds : 0; }
};

class PipelineParallel {
 public:
  // Collective over pp (and dp). Throws loom::Error for more stages than layers or an invalid
  // schedule (checked for deadlocks before any step runs).
  PipelineParallel(const Gpt2Config& model, Communicator& pp, Communicator& dp, ThreadPool& pool,
                   Device device, const PipelineConfig& config, const DataParallelConfig& dp_config,
                   const AdamWConfig& adamw, uint64_t seed);

  // Forward and backward of every micro-batch along the schedule; gradients end reduced over dp
  // and the tied embedding's copies summed. tokens/targets: one (micro_batch, seq_len) i32
  // tensor per micro-batch (read on the first / last stage). Returns the mean loss over the
  // micro-batches, on every rank of the pp group. The backward pass starts from the loss times
  // `loss_scale` (optim/loss_scaler.h; clip_grad_norm takes the same factor back out).
  // `documents`: with document masking, each micro-batch's document starts (nn/context.h,
  // Context::documents), which every stage's attention reads in its forward and backward.
  double train_step(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets,
                    double loss_scale = 1.0, const std::vector<Tensor>* documents = nullptr);
  // The global gradient norm (all stages, the tied embedding counted once, parameters replicated
  // over tp counted once); clips.
  double clip_grad_norm(double max_norm, double loss_scale = 1.0);
  void optimizer_step(float lr);
  // Mean loss of one batch through the stages, forward only (evaluation), on every pp rank. With
  // `queue`, the last stage's head queues the mean there instead (nn/step_losses.h) and every
  // rank returns 0; queued_loss_sum then gives the sum of the queued means on every pp rank, with
  // one read of the device and one collective for all the batches — on GPUs no wait per batch.
  double evaluate(const Tensor& tokens, const Tensor& targets, StepLosses* queue = nullptr,
                  const Tensor* documents = nullptr);
  double queued_loss_sum(StepLosses& queue);

  // Another number of micro-batches for the steps from here on (train.batch_rampup): the
  // schedule made again for it; the stages, their parameters and state stay. Throws, naming the
  // schedule, for a count it cannot take.
  void set_microbatches(int microbatches);

  const PipelineSchedule& schedule() const { return schedule_; }
  // The part of the model that stage s holds.
  Gpt2Part part_of_stage(int s) const;
  const PipelineStepStats& stats() const { return stats_; }
  // The model stage of this rank's chunk c, and which blocks it holds.
  int stage_of_chunk(int c) const { return schedule_.stage_of(pp_.rank(), c); }
  Gpt2Stage& chunk(int c) { return *chunks_[static_cast<size_t>(c)]; }
  DataParallel& chunk_engine(int c) { return *engines_[static_cast<size_t>(c)]; }
  int chunks() const { return static_cast<int>(chunks_.size()); }

 private:
  int rank_of_stage(int s) const { return schedule_.rank_of_stage(s); }
  int tag(int microbatch, int stage, bool backward) const;
  Tensor activation() const;  // an empty f32 buffer shaped like a stage boundary's activations
  void recv(Tensor& t, int src, int tag);
  // A boundary tensor on the wire: as it is, or rounded to bf16 (config_.send_dtype), and back.
  Tensor to_wire(const Tensor& t) const;
  // Sends a boundary tensor (as to_wire makes it) to pipeline rank dst; to this rank itself it
  // is kept for recv_boundary, and the handle is null.
  WorkHandle send_boundary(const Tensor& t, int dst, int tag_value);
  void recv_boundary(Tensor& t, int src, int tag_value, bool timed);

  Gpt2Config model_config_;
  Communicator& pp_;
  Communicator& dp_;
  ThreadPool& pool_;
  Device device_;
  PipelineConfig config_;
  PipelineSchedule schedule_;
  std::vector<int64_t> stage_begin_;  // pipeline_partition
  StageCosts stage_costs_;            // what zb-v's simulated order is made from
  std::vector<std::unique_ptr<Gpt2Stage>> chunks_;
  std::vector<std::unique_ptr<DataParallel>> engines_;
  std::unique_ptr<Communicator> tied_;  // first and last stage's ranks (null elsewhere)
  // Expert parallelism's group (DataParallelConfig::expert_parallel): the ranks holding the other
  // experts, over which the experts' squares of the gradient norm are summed. Null without it.
  Communicator* expert_parallel_ = nullptr;
  bool reduce_scatters_ = false;  // ZeRO-1: the engines reduce-scatter (DataParallel)
  // clip_grad_norm's end: each stage's sum of squares (this rank's stages), summed over pp in
  // stage order, then over tp; the engines' factor set.
  double finish_clip(std::vector<double> per_stage, double max_norm, double loss_scale);
  std::map<int, Tensor> to_self_;       // messages between this rank's stages, by tag
  PipelineStepStats stats_;
};

}  // namespace loom
