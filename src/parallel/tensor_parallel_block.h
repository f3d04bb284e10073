// A GPT-2 block split Megatron-style over a tensor-parallel group (issue 5): attention heads
// are split across ranks (QKV column-parallel, fused blocks split per block; the output
// projection row-parallel), and so is the MLP's hidden layer (fc column-parallel, proj
// row-parallel). One all-reduce forward and one backward per attention and per MLP — or, with
// sequence parallelism, an all-gather and a reduce-scatter each way, with the LayerNorms and
// residual adds working on this rank's rows (tokens) only.
//
// Parameter names are the single-device block's ("blocks.3.attn.qkv.weight"...), and shards
// initialise to their blocks of the full parameters, so the block equals Gpt2Block split up.
// With sequence parallelism the LayerNorm parameters (replicated) get gradients from this
// rank's rows only, and Qwen 3's query/key norms (nn/qk_norm.h) from this rank's heads only:
// tp_summed_params() lists them for the model to all-reduce over tp after backward. OLMo 2's
// query/key norms over all the heads (model.qk_norm_scope = "full") span heads of every rank:
// each rank holds its heads' shard of their weights, and the rows' sums of squares (forward)
// and of weight·dout·x (backward) are all-reduced over tp, one float a row (nn/split_rms_norm.h).
//
// Post-norms (OLMo 2's) and sandwich norms (Gemma's, models/gpt2.h): the norms on the branches'
// outputs take the row-parallel layers' summed outputs (this rank's rows with sequence
// parallelism, their gains then among tp_summed_params()).
//
// Activation recomputation (config.recompute, models/gpt2.h) as in Gpt2Block: full keeps only
// the block input (this rank's rows with sequence parallelism) and re-runs forward — its
// collectives included, the same on every rank — before backward; selective drops the LayerNorm
// outputs (the gathered ones with sequence parallelism, all-gathered again in backward) and the
// GELU output and rebuilds them right before backward needs them.
//
// Llama's block (Gpt2Config::llama()): RMSNorms; the qkv projection's three blocks of rows
// (queries, keys, values: n_heads, n_kv_heads, n_kv_heads heads) split block by block, so a
// rank holds whole key/value heads with the query heads they serve, the rotary embedding
// turns them on the rank and the attention reads the shared heads in place; the SwiGLU's fused
// gate/up projection split as two blocks too, so each rank holds matching slices of both.
// n_kv_heads and the hidden width must divide over tp. With qk_norm each rank normalises its
// query and key heads (in fp32, as one GPU's attention: nn/causal_self_attention.h) before
// turning them.
//
// A mixture of experts (Gpt2Config::moe(), nn/moe_mlp.h) in place of the MLP: every expert's
// hidden width split over tp as the SwiGLU's (Megatron-LM's expert tensor parallelism, its
// expert_tensor_parallel_size equal to tp), the router whole on every rank. The mixture reads the
// whole batch's tokens — with sequence parallelism the norm's rows all-gathered first — and
// routes them alike on every rank; its partial outputs are summed over tp as the row-parallel
// proj's are (all-reduced, or reduce-scattered to this rank's rows), and so are its input
// gradients. The router's gradient is whole and the same on every rank (a replicated
// parameter), its input gradient counted once. Expert parallelism (`experts`) splits the experts
// over data-parallel ranks of the same tp rank besides.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/gpt2.h"
#include "nn/moe_mlp.h"
#include "nn/norm.h"
#include "nn/qk_norm.h"
#include "parallel/tensor_parallel_linear.h"

namespace loom {

class TpGpt2Block {
 public:
  // config.n_heads, its key/value heads and the MLP's width must divide over tp.size() (an error
  // naming them otherwise).
  // `experts`: a mixture's expert-parallel group (parallel/expert_parallel.h); null: every
  // expert here. `rope_tables`: the model's rotary tables (null: the block's own).
  TpGpt2Block(ParameterStore& store, const std::string& name, const Gpt2Config& config,
              Communicator& tp, bool sequence_parallel, ExpertExchange* experts = nullptr,
              std::shared_ptr<RotaryTables> rope_tables = nullptr);
  // x: (rows, C) — all B·T rows, or with sequence parallelism this rank's B·T/P rows, in order.
  // B, T: the whole batch's shape (attention needs the sequences).
  Tensor forward(Context& ctx, const Tensor& x, int64_t B, int64_t T);
  Tensor backward(Context& ctx, const Tensor& dy);
  void clear_cache();
  void collect_cache(std::vector<Tensor*>& out);
  // The replicated parameters whose gradients here are this rank's part (above).
  const std::vector<Parameter*>& tp_summed_params() const { return sp_params_; }
  // A mixture's, as Gpt2Block's: its balance losses (the same on every rank of the group) and
  // tokens per expert in the last forward; 0 and null for a dense block.
  double aux_loss() const { return moe_ ? moe_->aux_loss() : 0; }
  const std::vector<int64_t>* expert_tokens() const {
    return moe_ ? moe_->expert_tokens() : nullptr;
  }
  int64_t dropped_pairs() const { return moe_ ? moe_->dropped_pairs() : 0; }
  void set_expert_bias(const float* bias) {
    if (moe_) moe_->set_expert_bias(bias);
  }

 private:
  Tensor run_forward(Context& ctx, const Tensor& x);
  // The qkv projection of the first norm's output (Llama's q and k turned), in 16 bits where
  // `rounded` (the flash kernels read it so), else fp32.
  Tensor project_qkv(Context& ctx, const Tensor& normed, bool rounded);
  // The rest of run_forward once att_ holds the attention's output: proj, the skip connection
  // and the MLP.
  Tensor after_attention(Context& ctx, const Tensor& x);
  // GELU(h_), or Llama's SwiGLU of h_, in h_'s type (16-bit where mlp_up wrote it so).
  Tensor activation(Context& ctx) const;
  // fc and the activation from the second norm's output: the activation's output, proj's input
  // (h_ kept).
  Tensor mlp_up(Context& ctx, const Tensor& normed);
  // proj's, the activation's and fc's backward from the block output's gradient dy: the MLP's
  // input gradient. `selective`: fc's dropped input is rebuilt right before fc's backward.
  Tensor mlp_down_backward(Context& ctx, const Tensor& dy, bool selective);
  // A mixture's: its rows of the batch (the norm's output, or with sequence parallelism all of
  // them gathered) as (B, T, C).
  Tensor whole_rows(const Tensor& rows) const;
  // The norm on branch 1's (the attention's) or 2's (the MLP's) summed output before the skip
  // connection: post_norm's ln_1 / ln_2, sandwich's own; null for pre-norms alone.
  Norm* output_norm(int branch) const;
  // The sum over tp of a mixture's partial result (N, C): all-reduced, or with sequence
  // parallelism reduce-scattered to this rank's rows.
  Tensor sum_over_tp(const Tensor& partial) const;
  Recompute recompute_;
  bool llama_;
  bool post_norm_;  // OLMo 2's order: the norms on the branches' outputs (models/gpt2.h)
  GatedActivation ffn_activation_;  // Llama's SwiGLU or Gemma's GeGLU (kernels/cpu/swiglu.h)
  int64_t local_heads_, local_kv_heads_, local_hidden_, head_dim_;
  int64_t local_width_;  // local_heads_·head_dim_: this rank's attention output, proj's input
  int64_t sliding_window_;  // nn/sliding_window.h; 0: none
  cpu::RopeFrequencies rope_frequencies_;
  std::shared_ptr<RotaryTables> rope_tables_;  // Llama: the model's, shared by its blocks
  int64_t B_ = 0, T_ = 0;
  Communicator& tp_;
  bool sequence_parallel_;
  std::unique_ptr<Norm> ln_1_;
  ColumnParallelLinear qkv_;
  RowParallelLinear attn_proj_;
  // The tp group as nn's TensorSplit: what OLMo 2's full-width query/key norms and a mixture of
  // experts sum their partial results over.
  std::unique_ptr<TensorSplit> split_;
  std::optional<QkNorm> qk_norm_;  // Qwen 3's and OLMo 2's (nn/qk_norm.h)
  std::unique_ptr<Norm> ln_2_;
  // Sandwich norms (Gemma's): the row-parallel outputs normalised once summed, as post_norm's
  // ln_1 / ln_2 normalise them; with the pre-norms as ever.
  std::unique_ptr<Norm> attn_out_norm_, mlp_out_norm_;
  // The MLP: fc and proj, or a mixture of experts.
  std::optional<ColumnParallelLinear> fc_;
  std::optional<RowParallelLinear> mlp_proj_;
  std::unique_ptr<MoeMlp> moe_;
  std::vector<Parameter*> sp_params_;
  // attention inputs (Llama: the compact qkv, q and k turned) and outputs, and the activation's
  // input; on a GPU at bf16 / fp16 h_ in 16 bits, and att_, proj's rounded input, and qkv_out_
  // too where the flash kernels read it so (under cp: where they take the rows, qkv_out_ then
  // the bf16 queries)
  Tensor qkv_out_, att_, lse_, h_;
  Tensor kv_full_;  // context parallelism: the whole sequence's keys and values of its heads
  Tensor documents_;  // document masking: the forward's ctx.documents, for the backward (or the
                      // sliding window's table)
  Tensor window_;     // a sliding window's own table (nn/sliding_window.h), kept
  Tensor input_;   // Recompute::kFull: the block input, all that forward keeps
  Tensor middle_;  // post_norm, selective, a mixture: its input x1, restored
};

}  // namespace loom
