// GPT-2 with Megatron-style tensor parallelism (issue 5): the vocabulary-parallel embedding and
// tied head (tensor_parallel_vocab.h), tensor-parallel blocks (tensor_parallel_block.h) and a
// replicated final LayerNorm, over the tp group; optionally sequence parallel. The same
// parameter names, units and hooks as Gpt2 (unit 0 = root: wte slice, wpe, ln_f; then one unit
// per block), so data parallelism and ZeRO (parallel/data_parallel.h) wrap it unchanged.
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

class TpGpt2 {
 public:
  TpGpt2(const Gpt2Config& config, Communicator& tp, bool sequence_parallel);
  const Gpt2Config& config() const { return config_; }
  ParameterStore& params() { return params_; }
  // As Gpt2::forward / backward, on every rank of the tp group.
  double forward(Context& ctx, const Tensor& tokens, const Tensor& targets);
  void backward(Context& ctx, double scale = 1.0);
  void clear_cache();

 private:
  // Runs `backward` with the gradients of `params` pointed at fresh buffers, all-reduces those
  // over tp and adds them into the real gradients.
  template <typename Fn>
  Tensor reduced_over_tp(Context& ctx, const std::vector<Parameter*>& params, Fn backward);

  Gpt2Config config_;
  Communicator& tp_;
  bool sequence_parallel_;
  ParameterStore params_;
  std::unique_ptr<VocabParallelEmbedding> vocab_;
  std::unique_ptr<LayerNorm> ln_f_;
  std::vector<std::unique_ptr<TpGpt2Block>> blocks_;
  std::vector<Parameter*> ln_f_params_;
  int64_t B_ = 0, T_ = 0;
};

}  // namespace loom
