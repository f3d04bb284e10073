// GPT-2 with Megatron-style tensor parallelism (issue 5): the vocabulary-parallel embedding and
// tied head (tensor_parallel_vocab.h), tensor-parallel blocks (tensor_parallel_block.h) and a
// replicated final LayerNorm, over the tp group; optionally sequence parallel. The same
// parameter names, units and hooks as Gpt2 (unit 0 = root: wte slice, wpe, ln_f; then one unit
// per block), so data parallelism and ZeRO (parallel/data_parallel.h) wrap it unchanged.
//
// Like Gpt2 it may hold a part of the network (a pipeline stage, Gpt2Stage): blocks
// [first_block, end_block), with or without the embedding and the head. A part's input and
// output are (B·T, C) activations, or this rank's (B·T/P, C) rows under sequence parallelism
// (boundary_shape); a head-only part holds its own slice of the tied wte.
//
// A mixture of experts' blocks split their experts' widths over tp (tensor_parallel_block.h) and,
// under expert parallelism (`experts`), the experts over dp ranks, each block's in a unit of its
// own after the block's, as Gpt2's.
//
// Under sequence parallelism the replicated LayerNorm parameters get gradients from this rank's
// rows only; each micro-batch's contribution is all-reduced over tp right after the LayerNorm's
// backward (into a fresh buffer, then added), so accumulation over micro-batches stays exact.
#pragma once

#include <memory>
#include <vector>

#include "models/gpt2.h"
#include "parallel/tensor_parallel_block.h"
#include "parallel/tensor_parallel_vocab.h"

namespace loom {

class TpGpt2 : public Gpt2Stage {
 public:
  TpGpt2(const Gpt2Config& config, Communicator& tp, bool sequence_parallel,
         const Gpt2Part& part = {}, ExpertExchange* experts = nullptr);
  const Gpt2Config& config() const override { return config_; }
  const Gpt2Part& part() const override { return part_; }
  ParameterStore& params() override { return params_; }
  // As Gpt2::forward / backward (the whole model), on every rank of the tp group.
  double forward(Context& ctx, const Tensor& tokens, const Tensor& targets);
  void backward(Context& ctx, double scale = 1.0);

  // Gpt2Stage, on every rank of the tp group.
  Tensor forward_part(Context& ctx, const Tensor& input, const Tensor& targets,
                      double* loss) override;
  Tensor backward_part(Context& ctx, const Tensor& dy, double scale) override;
  Parameter* head_weight() const override {
    if (head_ != nullptr) return head_->wte();
    return config_.tie_embeddings && vocab_ ? vocab_->wte() : nullptr;  // the first stage's
  }
  double aux_loss() const override;
  void add_expert_tokens(std::vector<double>& counts) const override;
  void set_expert_biases(const std::vector<float>& biases) override;
  // The shape of a part's input and output activations for a (B, T) batch on this rank.
  Shape boundary_shape(int64_t B, int64_t T) const;

 private:
  // Runs `backward` with the gradients of `params` pointed at fresh buffers, all-reduces those
  // over tp and adds them into the real gradients.
  template <typename Fn>
  Tensor reduced_over_tp(Context& ctx, const std::vector<Parameter*>& params, Fn backward);
  std::vector<Tensor*> cache_slots() override;

  Gpt2Config config_;
  Gpt2Part part_;
  Communicator& tp_;
  bool sequence_parallel_;
  ParameterStore params_;
  int root_unit_ = -1;  // -1: this part has neither end, so no root unit
  std::vector<size_t> block_unit_;  // each block's unit (expert units may follow them)
  std::unique_ptr<VocabParallelEmbedding> vocab_;       // the embedding (and the tied head)
  std::unique_ptr<VocabParallelEmbedding> head_vocab_;  // the head's own weight, where it has one
  VocabParallelEmbedding* head_ = nullptr;              // the head: one of the two
  std::unique_ptr<Norm> ln_f_;
  // The blocks' rotary cos/sin tables, one per set of frequencies (nn/causal_self_attention.h).
  std::shared_ptr<RotaryTables> rope_tables_ = std::make_shared<RotaryTables>();
  std::vector<std::unique_ptr<TpGpt2Block>> blocks_;
  std::vector<Parameter*> ln_f_params_;
};

}  // namespace loom
