// How a mixture of experts' router picks and weighs each token's experts (kernels/cpu/moe.h:
// moe_route), shared by the CPU and CUDA kernels.
#pragma once

#include <cstdint>

namespace loom {

struct MoeRouting {
  // DeepSeek-V3's balancing biases (experts values on the routing's device), added to the scores
  // where the top k are chosen, not to the weights; null: none.
  const float* bias = nullptr;
  // The scores: a softmax over the experts (false), or each logit's sigmoid (DeepSeek-V3's).
  bool sigmoid = false;
  // Group-limited routing (DeepSeek-V3's node-limited routing; Megatron-LM's
  // --moe-router-num-groups / --moe-router-group-topk): the experts in `groups` contiguous groups
  // of experts / groups, each group scored by the sum of its best top_k / group_topk choice
  // scores, and a token's top k chosen among the experts of its best group_topk groups. 1: none.
  int64_t groups = 1;
  int64_t group_topk = 1;
  // The weights' factor (DeepSeek-V3's routed scaling factor; Megatron-LM's
  // --moe-router-topk-scaling-factor): w_j = scale · p_j / Σ_chosen p.
  double scale = 1;
  // false: the chosen scores are not normalised, w_j = scale · p_j (transformers'
  // norm_topk_prob = false: Qwen-MoE's, DeepSeek-V2's, OLMoE's; Megatron-LM's pre-softmax
  // routing with softmax scores).
  bool normalize = true;
};

}  // namespace loom
