// A transformer block's MLP: GPT-2's GELU MLP (nn/mlp.h) or Llama's SwiGLU (nn/swiglu_mlp.h)
// behind one interface, so a block is written once for both.
#pragma once

#include <vector>

#include "nn/context.h"
#include "tensor/tensor.h"

namespace loom {

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual Tensor forward(Context& ctx, const Tensor& x) = 0;
  // forward + residual, the block's skip connection added by the output projection.
  virtual Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) = 0;
  virtual Tensor backward(Context& ctx, const Tensor& dy) = 0;
  virtual void clear_cache() = 0;
  // Selective recomputation (models/gpt2.h), for the owner right after forward: drops the
  // cached input (the owner's norm output, handed back by restore_input before backward) and
  // the activation's output, which backward rebuilds from the kept projection output.
  virtual void drop_recomputable() = 0;
  virtual void restore_input(const Tensor& x) = 0;
  // Selective recomputation where the owner has no norm to rebuild the input from (OLMo 2's
  // post-norm blocks read the residual stream itself): drops the activation's output alone and
  // keeps the input as forward kept it (16-bit on a GPU at bf16 / fp16: less than the fp32
  // stream the owner would keep to restore it). False where that is not the better trade (a
  // mixture: its experts' gathered rows are k times the input), nothing dropped: the owner then
  // calls drop_recomputable and keeps the input to restore.
  virtual bool drop_activation_only() { return false; }
  virtual void collect_cache(std::vector<Tensor*>& out) = 0;
  // The loss this MLP added to the training loss in its last forward, with its coefficient
  // (a mixture of experts' balance loss, nn/moe_mlp.h); its backward adds its gradient.
  virtual double aux_loss() const { return 0; }
  // Tokens its last forward sent to each expert (a mixture's; nn/moe_mlp.h); none for a dense one.
  virtual const std::vector<int64_t>* expert_tokens() const { return nullptr; }
  // Of those, the (token, expert) pairs its experts' capacity dropped (nn/moe_capacity.h).
  virtual int64_t dropped_pairs() const { return 0; }
  // A mixture's balancing biases (nn/moe_mlp.h: set_expert_bias): one per expert; nothing for a
  // dense one.
  virtual void set_expert_bias(const float* bias) { (void)bias; }
};

}  // namespace loom
