// A mixture of experts in place of a block's MLP (Shazeer et al. 2017; Mixtral, Jiang et al.
// 2024): `experts` SwiGLU MLPs, each `hidden` wide, and a router — a Linear C -> experts, no
// bias — whose softmax picks each token's top_k experts. The token's output is the sum of its
// experts' outputs weighed by their router probabilities renormalised over the k chosen
// (Mixtral's: a softmax over the chosen logits). By default every token reaches its experts: no
// capacity, nothing dropped ("dropless", as Megatron-LM's and torchtitan's grouped GEMMs); with
// an expert capacity (MoeShape::capacity, nn/moe_capacity.h) each expert takes at most its
// capacity of each sequence's choices, and the rest are dropped.
//
// Load balance: the router is trained towards spreading tokens by the sequence-wise balance loss
// of DeepSeek-V3 (and Megatron-LM's "seq_aux_loss"): per sequence of T tokens
//   L = Σ_e f_e · P_e,  f_e = experts / (top_k · T) · (tokens of the sequence sent to e),
//                       P_e = mean over the sequence's tokens of the router probability of e,
// 1 when perfectly balanced; the training loss gains aux_loss_coef times its mean over the
// batch's sequences, in every block. Per sequence, not per micro-batch: so it is the same
// whatever the data-parallel degree, the micro-batch size or the pipeline splits the batch
// into — every layout's gradients are one device's. f_e counts choices and has no gradient
// (Switch Transformer's), P_e carries it to the router.
//
// Names: <name>.router.weight (experts × C), <name>.experts.<e>.fc.weight (2H × C: gate then up)
// and <name>.experts.<e>.proj.weight (C × H); with shared experts <name>.shared.fc.weight
// (2·S·H × C) and <name>.shared.proj.weight. Ties in the top-k go to the lower expert index, so
// routing is deterministic. The work is kernels/ops.h's (kernels/cpu/moe.h, kernels/cuda/moe.cu):
// on a GPU the routing runs there and its choices come back to the host (one wait a block's
// forward), which sizes each expert's GEMMs and lays out its rows; at bf16 / fp16 matmul
// precision the experts' gathered inputs stay in the 16 bits the norm wrote.
//
// Expert parallelism: given an ExpertExchange (nn/expert_exchange.h) over R ranks, the layer
// holds only experts [r·E/R, (r+1)·E/R) — in a parameter unit of their own, ParamUnit::experts,
// whose hooks it calls around them — and runs them on the tokens of the whole group that chose
// them, gathered; the router (and shared experts) stay whole on every rank, each routing its own
// tokens, so the balance loss and the counts per expert are those of one device.
//
// Context parallelism (ctx.sequence, nn/sequence_shard.h): a rank holds some positions of each
// sequence; the sequences' choices and probability sums per expert are summed over the group
// before the balance loss, so it is the whole sequences' on every rank.
//
// Tensor parallelism: given a TensorSplit (nn/tensor_split.h) over P ranks, rank r holds slice r
// of every expert's hidden width (and of the shared experts'; nn/swiglu_mlp.h: HiddenSlice), as
// Megatron-LM's expert tensor parallelism splits them. Every rank reads every token and routes
// it alike (the router is whole on each); forward returns this rank's part of the output, which
// the caller sums over the group (parallel/tensor_parallel_block.h) before adding the residual,
// and backward this rank's part of the input gradient — the router's own on the group's rank 0
// only, so that the sum counts it once. The routing weights' gradients are summed over the
// group inside backward: the router's backward needs them whole.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "nn/expert_exchange.h"
#include "nn/feed_forward.h"
#include "nn/linear.h"
#include "nn/moe_capacity.h"
#include "nn/swiglu_mlp.h"
#include "nn/tensor_split.h"

namespace loom {

// The router's scores: Mixtral's softmax over the experts, or DeepSeek-V3's sigmoid of each
// logit on its own (its "affinities"; Megatron-LM's --moe-router-score-function). Either way a
// token's top k are chosen by score (plus a balancing bias) and weighed by their scores over
// their sum; with sigmoid scores the balance loss's P_e averages each token's scores over their
// sum (DeepSeek-V3's normalised affinities).
enum class RouterScore { kSoftmax, kSigmoid };
// "softmax" | "sigmoid"; throws naming `key` otherwise.
RouterScore parse_router_score(const std::string& name, const std::string& key);
const char* router_score_name(RouterScore score);

struct MoeShape {
  int64_t channels = 0;
  int64_t hidden = 0;  // each expert's SwiGLU width
  int64_t experts = 0;
  int64_t top_k = 0;
  // Shared experts every token goes through besides its routed ones (DeepSeekMoE, Qwen-MoE):
  // one SwiGLU shared × hidden wide, its output added unweighed; 0: none.
  int64_t shared = 0;
  MoeCapacity capacity = {};  // dropless by default
  RouterScore score = RouterScore::kSoftmax;
  // Group-limited routing and the weights' factor (kernels/moe_routing.h): the experts in
  // router_groups contiguous groups, a token's top k from its best router_group_topk of them
  // (1, 1: none); w_j = router_scale · p_j / Σ_chosen p.
  int64_t router_groups = 1;
  int64_t router_group_topk = 1;
  double router_scale = 1;
  // false: w_j = router_scale · p_j, the chosen scores not normalised (kernels/moe_routing.h).
  bool router_normalize = true;
  // Whether the groups can serve a top k: they divide the experts, router_group_topk of them
  // divides top_k, and each holds top_k / router_group_topk experts.
  bool groups_route() const {
    return router_groups >= 1 && experts % router_groups == 0 && router_group_topk >= 1 &&
           router_group_topk <= router_groups && top_k % router_group_topk == 0 &&
           top_k / router_group_topk <= experts / router_groups;
  }
};

// The coefficients of the losses a mixture adds to the training loss: the sequence-wise balance
// loss (above), and ST-MoE's router z-loss (Zoph et al. 2022), the mean over tokens of
// (log Σ_e exp logit_e)², which keeps the router's logits small (0: none).
struct MoeLosses {
  float balance = 0;
  float router_z = 0;
};

// The auxiliary-loss-free balancing step (DeepSeek-V3): for each block's `experts` biases (of
// `biases`, blocks × experts) and its experts' tokens in the step (`tokens`, the same layout),
// b_e += rate · sign(mean − tokens_e), the mean over the block's experts: a busy expert's bias
// falls, an idle one's rises. In float, the same on every rank.
void update_expert_biases(std::vector<float>& biases, const std::vector<double>& tokens,
                          int64_t experts, double rate);

class MoeMlp : public FeedForward {
 public:
  // proj_std: the experts' output projections' init std (scaled by depth, as the dense MLP's).
  // `exchange` (kept): the expert-parallel group this rank's experts are a block of; null: all
  // experts here. `split` (kept): the tensor-parallel group the experts' widths split over; null:
  // whole experts (forward_adding needs whole ones: a split's output is a partial sum).
  MoeMlp(ParameterStore& store, const std::string& name, const MoeShape& shape,
         const MoeLosses& losses, float init_std, float proj_std,
         ExpertExchange* exchange = nullptr, TensorSplit* split = nullptr);
  // x: (B, T, C), each of the B rows a sequence (its balance loss's unit).
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) override;
  // Also adds the balance loss's gradient, at ctx.backward_scale.
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void clear_cache() override;
  // Drops the router's input and the experts' gathered inputs and SwiGLU outputs; restore_input
  // gathers the experts' rows again from the rebuilt input (the same routing, kept).
  void drop_recomputable() override;
  void restore_input(const Tensor& x) override;
  void collect_cache(std::vector<Tensor*>& out) override;
  double aux_loss() const override {
    return losses_.balance * balance_loss_ + losses_.router_z * router_z_loss_;
  }

  // Of the last forward: tokens sent to each expert (each token counted top_k times), and the
  // balance loss's mean over its sequences (before aux_loss_coef).
  const std::vector<int64_t>* expert_tokens() const override { return &expert_tokens_; }
  // Balancing without a loss (DeepSeek-V3's auxiliary-loss-free balancing): `bias` (experts
  // values) added to each token's probabilities where its top k are chosen, not to the weights
  // (kernels/cpu/moe.h: moe_route). The trainer moves them between steps (model.
  // moe_bias_update_rate); all zeros (the start): the plain top k, bit for bit.
  void set_expert_bias(const float* bias) override;
  double balance_loss() const { return balance_loss_; }
  // This rank's (token, expert) pairs the last forward dropped over the experts' capacity.
  int64_t dropped_pairs() const override { return dropped_; }
  // The router z-loss's mean lse² over the last forward's tokens (before its coefficient; 0
  // without one).
  double router_z_loss() const { return router_z_loss_; }

 private:
  Tensor run(Context& ctx, const Tensor& x, const Tensor* residual);
  void clear_routing();
  // Local expert e's rows in rows_ / slots_: [offsets_[e], offsets_[e + 1]).
  int64_t offset(int64_t e) const { return offsets_.data<int32_t>()[e]; }
  int64_t rows_of(int64_t e) const { return offset(e + 1) - offset(e); }
  // The rows of `tokens` (x, or the group's gathered tokens) routed to local expert e, (n_e, C)
  // in their type, on `ex`.
  Tensor gather(const Exec& ex, const Tensor& tokens, int64_t e) const;
  // The tokens the local experts read: x as (N, C), or the group's, gathered.
  Tensor expert_tokens_of(const Tensor& x) const;
  // The all-to-all dispatcher (ExpertExchange::all_to_all_dispatch): this rank's pairs sent to
  // their experts' ranks, the local experts run on what arrives, their outputs sent back and
  // weighed into y (plus *residual). `chosen`: this rank's choices, on the host.
  Tensor run_all_to_all(Context& ctx, const Tensor& x, const Tensor* residual,
                        const int32_t* chosen, const std::vector<uint8_t>& keep);
  // Which of the choices chosen[0, n·top_k) — n tokens in sequences of T, weighed by `weights`
  // (n, top_k) — their experts take within capacity (nn/moe_capacity.h): under context
  // parallelism decided on the whole sequences. Sets dropped_ to the zeros among this rank's
  // own pairs, [own_first, own_first + own_pairs).
  std::vector<uint8_t> capacity_keep(Context& ctx, const int32_t* chosen, int64_t n, int64_t T,
                                     const Tensor& weights, int64_t own_first, int64_t own_pairs);
  // x's rows as send_index_ lays them out, all-to-all'd: the rows this rank's experts receive.
  Tensor send_tokens(const Exec& ex, const Tensor& x) const;
  // Rows to the experts' ranks in the blocks of exchange_rows_ (the send layout's), or with
  // `back` from the received layout to where they came from.
  Tensor exchange_rows(const Tensor& rows, bool back) const;
  MoeShape shape_;
  ExpertExchange* exchange_ = nullptr;
  TensorSplit* split_ = nullptr;
  int64_t first_ = 0;  // this rank's experts: global indices [first_, first_ + local_)
  int64_t local_ = 0;
  int expert_unit_ = -1;  // their parameter unit under expert parallelism; -1: the block's
  MoeLosses losses_;
  Tensor expert_bias_;         // (experts) f32 on the host; undefined while every value is 0
  Tensor device_expert_bias_;  // its copy on the device the last forward ran on
  Linear router_;
  std::vector<std::unique_ptr<SwiGluMlp>> experts_;  // the local ones
  std::unique_ptr<SwiGluMlp> shared_;  // MoeShape::shared > 0: <name>.shared
  // Where the last forward ran (restore_input gathers there again).
  Exec exec_;
  // Kept from forward for backward (and for pipeline stashes: collect_cache); on the forward's
  // device unless said:
  Tensor probs_;    // (N, experts) router softmax, ctx.dtype
  Tensor choice_;   // (N, top_k) i32: each token's experts, best first
  Tensor weight_;   // (N, top_k) ctx.dtype: their renormalised probabilities
  Tensor lse_;      // (N) ctx.dtype: log Σ exp of each token's router logits
  // Under expert parallelism: the group's tokens' weights, gathered ((R·N, top_k)); the local
  // experts' rows and slots index the group's tokens.
  Tensor group_weight_;
  Tensor rows_;     // (≤ N·top_k) i32: local expert by expert, its tokens in token order
  Tensor slots_;    // (≤ N·top_k) i32: where in each of those tokens' choice the expert stands
  Tensor offsets_;  // (local experts + 1) i32, on the host: each one's first place in rows_
  // The all-to-all dispatcher's layout (rows_ / slots_ / offsets_ then index the rows received,
  // block by source rank, slots_ unused): this rank's pairs p = j·N + t (slot-major: a slot's
  // tokens are distinct) and, for each of the rows it sends (block by destination rank), the
  // token and the pair it carries; each pair's place among them; and the pairs' expert outputs,
  // come back (P, C). On the forward's device.
  // With expert capacity the dropped pairs are not sent: the pairs are slot by slot, slot j's
  // [slot_pairs_[j], slot_pairs_[j + 1]) (K + 1 i64, on the host).
  Tensor send_index_, send_pair_, pair_rows_, pair_tok_, pair_slot_, slot_pairs_, pair_out_;
  // The blocks' rows (2 · ranks i64, on the host): sent to each rank, then received from each.
  Tensor exchange_rows_;
  Tensor counts_;   // (B, experts) i32, on the host: each sequence's choices of each expert
  std::vector<Tensor> out_;  // per local expert: (n_e, C) its outputs, unweighed
  std::vector<int64_t> expert_tokens_;
  int64_t dropped_ = 0;  // of this rank's pairs in the last forward, over capacity
  double balance_loss_ = 0;
  double router_z_loss_ = 0;
  int64_t sequence_length_ = 0;  // of the last forward: the whole sequences' (under cp too)
};

}  // namespace loom
