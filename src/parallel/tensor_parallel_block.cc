// A tensor-parallel GPT-2 block: see tensor_parallel_block.h.
#include "parallel/tensor_parallel_block.h"

#include <cmath>

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/sequence_shard.h"
#include "nn/sliding_window.h"

namespace loom {
namespace {
float residual_std(const Gpt2Config& c) {
  // As Gpt2Block: residual projections scaled by 1/sqrt(2·n_layers).
  return c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
}
int64_t checked_local_heads(const Gpt2Config& c, int64_t P, const std::string& name) {
  if (c.n_heads % P != 0)
    fail(name, ": parallel.tp = ", P, " does not divide model.n_heads = ", c.n_heads);
  return c.n_heads / P;
}

// A mixture's partial sums (nn/tensor_split.h) over the block's tp group.
class TpSums : public TensorSplit {
 public:
  explicit TpSums(Communicator& tp) : tp_(tp) {}
  int ranks() const override { return tp_.size(); }
  int rank() const override { return tp_.rank(); }
  void all_reduce(Tensor& partial) override {
    tp_.all_reduce_async(partial, ReduceOp::kSum)->wait_on_device();
  }

 private:
  Communicator& tp_;
};
}  // namespace

TpGpt2Block::TpGpt2Block(ParameterStore& store, const std::string& name, const Gpt2Config& config,
                         Communicator& tp, bool sequence_parallel, ExpertExchange* experts,
                         std::shared_ptr<RotaryTables> rope_tables)
    : recompute_(config.recompute),
      llama_(config.llama()),
      post_norm_(config.post_norm),
      ffn_activation_(config.ffn_activation),
      local_heads_(checked_local_heads(config, tp.size(), name)),
      local_kv_heads_(config.kv_heads() / tp.size()),
      local_hidden_(config.hidden() / tp.size()),
      head_dim_(config.head_dim()),
      local_width_(local_heads_ * head_dim_),
      sliding_window_(config.sliding_window),
      rope_frequencies_(config.rope_frequencies()),
      rope_tables_(rope_tables ? std::move(rope_tables) : std::make_shared<RotaryTables>()),
      tp_(tp),
      sequence_parallel_(sequence_parallel),
      ln_1_(make_norm(store, name + ".ln_1", config.d_model, config.llama(), config.norm_eps)),
      qkv_(store, name + ".attn.qkv", config.d_model, config.qkv_width(), tp, config.has_qkv_bias(),
           config.init_std, sequence_parallel,
           {config.attention_width(), config.kv_heads() * config.head_dim(),
            config.kv_heads() * config.head_dim()}),
      attn_proj_(store, name + ".attn.proj", config.attention_width(), config.d_model, tp,
                 !config.llama(), residual_std(config), sequence_parallel),
      ln_2_(make_norm(store, name + ".ln_2", config.d_model, config.llama(), config.norm_eps)) {
  split_ = std::make_unique<TpSums>(tp);
  // Qwen 3's per-head norms, registered after proj as Gpt2Block's attention registers them;
  // OLMo 2's over all the heads split over tp with them (nn/split_rms_norm.h).
  if (config.qk_norm)
    qk_norm_.emplace(store, name + ".attn", head_dim_, config.norm_eps, config.qk_norm_full,
                     local_heads_, local_kv_heads_, split_.get(), config.query_scale());
  if (config.moe()) {
    moe_ = std::make_unique<MoeMlp>(store, name + ".mlp", config.moe_shape(), config.moe_losses(),
                                    config.init_std, residual_std(config), experts, split_.get());
  } else {
    if (experts != nullptr) fail(name, ": expert parallelism needs a mixture of experts");
    // Llama: gate and up, two blocks of rows each split over tp.
    fc_.emplace(store, name + ".mlp.fc", config.d_model,
                config.llama() ? 2 * config.hidden() : config.hidden(), tp, !config.llama(),
                config.init_std, sequence_parallel,
                config.llama() ? std::vector<int64_t>{config.hidden(), config.hidden()}
                               : std::vector<int64_t>{});
    mlp_proj_.emplace(store, name + ".mlp.proj", config.hidden(), config.d_model, tp,
                      !config.llama(), residual_std(config), sequence_parallel);
  }
  if (config.kv_heads() % tp.size() != 0)
    fail(name, ": parallel.tp = ", tp.size(), " does not divide model.n_kv_heads = ",
         config.kv_heads());
  if (config.sandwich_norm) {  // registered last, as Gpt2Block registers them
    attn_out_norm_ =
        make_norm(store, name + ".attn_out_norm", config.d_model, true, config.norm_eps);
    mlp_out_norm_ = make_norm(store, name + ".mlp_out_norm", config.d_model, true, config.norm_eps);
  }
  if (sequence_parallel) {
    sp_params_ = ln_1_->parameters();
    for (Parameter* p : ln_2_->parameters()) sp_params_.push_back(p);
    if (attn_out_norm_)
      for (const auto* norm : {attn_out_norm_.get(), mlp_out_norm_.get()})
        for (Parameter* p : norm->parameters()) sp_params_.push_back(p);
  }
  // Each rank normalises its own heads with the shared weights: their gradients are partial
  // (the full form's weights are shards instead: each rank's gradient is its own slice).
  if (qk_norm_ && !qk_norm_->split())
    for (Parameter* p : qk_norm_->parameters()) sp_params_.push_back(p);
}

Tensor TpGpt2Block::forward(Context& ctx, const Tensor& x, int64_t B, int64_t T) {
  LOOM_CHECK(ctx.dtype == DType::kF32);
  B_ = B;
  T_ = T;
  Tensor y = run_forward(ctx, x);
  switch (recompute_) {
    case Recompute::kNone:
      break;
    case Recompute::kFull:  // keep the input only; backward re-runs the block
      clear_cache();
      input_ = x;
      break;
    case Recompute::kSelective:
      // Drop the LayerNorm outputs (the qkv and fc inputs) and the GELU output (mlp proj's
      // input); LayerNorm inputs, mean and rstd and the fc output h stay, to rebuild them.
      // Post-norm: the Linears keep the stream as they read it (no norm output to rebuild it
      // from); only the GELU's (SwiGLU's) output goes, or a mixture's rows, restored from x1.
      if (!post_norm_) qkv_.drop_input();
      if (moe_) {
        moe_->drop_recomputable();
      } else {
        if (!post_norm_) fc_->drop_input();
        mlp_proj_->drop_input();
      }
      break;
  }
  return y;
}

Tensor TpGpt2Block::activation(Context& ctx) const {
  const Exec ex = ctx.exec();
  const bool sixteen_bit = h_.dtype() != DType::kF32;  // fc wrote h_ so (mlp_up)
  if (llama_) {
    const int64_t rows = h_.dim(0);
    Tensor a = Tensor::empty({rows, local_hidden_}, h_.dtype(), ctx.device);
    if (sixteen_bit)
      ops::swiglu_forward_rounded(ex, a.raw(), h_.raw(), h_.dtype(), rows, local_hidden_,
                                  ffn_activation_);
    else
      ops::swiglu_forward<float>(ex, a.data<float>(), h_.data<float>(), rows, local_hidden_,
                                 ffn_activation_);
    return a;
  }
  Tensor g = Tensor::empty(h_.shape(), h_.dtype(), ctx.device);
  if (sixteen_bit)  // to an ulp of the forward's, whose epilogue took the GELU before rounding
    ops::gelu_forward_of_rounded(ex, g.raw(), h_.raw(), h_.dtype(), h_.numel());
  else
    ops::gelu_forward<float>(ex, g.data<float>(), h_.data<float>(), h_.numel());
  return g;
}

Tensor TpGpt2Block::mlp_up(Context& ctx, const Tensor& normed) {
  if (ops::matmul_input_dtype(ctx.exec(), DType::kF32) == DType::kF32) {
    h_ = fc_->forward(ctx, normed);
    return activation(ctx);
  }
  // On a GPU at bf16 / fp16 the MLP runs as one GPU's (nn/mlp.cc, nn/swiglu_mlp.cc): fc writes
  // its output in 16 bits — GPT-2's with the GELU in the GEMM's epilogue —, and the activation's
  // output is proj's rounded input.
  if (llama_) {
    h_ = fc_->forward_rounded_output(ctx, normed);
    return activation(ctx);
  }
  Tensor g;
  h_ = fc_->forward_gelu(ctx, normed, g);
  return g;
}

Tensor TpGpt2Block::mlp_down_backward(Context& ctx, const Tensor& dy, bool selective) {
  const auto restore_fc_input = [&] {
    if (selective && !post_norm_) fc_->restore_input(ln_2_->recompute_output(ctx));
  };
  if (h_.dtype() != DType::kF32) {  // mlp_up's 16-bit path: the gradient at fc's output so too
    Tensor dh;
    if (llama_) {
      const Tensor da = mlp_proj_->backward_rounded_dinp(ctx, dy);
      dh = Tensor::empty(h_.shape(), h_.dtype(), ctx.device);
      ops::swiglu_backward_rounded(ctx.exec(), dh.raw(), da.raw(), h_.raw(), h_.dtype(), h_.dim(0),
                                   local_hidden_, ffn_activation_);
    } else {
      dh = mlp_proj_->backward_into_gelu(ctx, dy, h_);  // the GELU's backward in the epilogue
    }
    restore_fc_input();
    return fc_->backward(ctx, dh);
  }
  Tensor dg = mlp_proj_->backward(ctx, dy);
  restore_fc_input();
  if (!llama_) return fc_->backward_before_gelu(ctx, dg, h_);
  const int64_t rows = h_.dim(0);
  Tensor dh = Tensor::empty(h_.shape(), DType::kF32, ctx.device);
  ops::swiglu_backward<float>(ctx.exec(), dh.data<float>(), dg.data<float>(), h_.data<float>(),
                              rows, local_hidden_, ffn_activation_);
  return fc_->backward(ctx, dh);
}

Norm* TpGpt2Block::output_norm(int branch) const {
  if (post_norm_) return branch == 1 ? ln_1_.get() : ln_2_.get();
  return branch == 1 ? attn_out_norm_.get() : mlp_out_norm_.get();  // null but sandwiched
}

Tensor TpGpt2Block::whole_rows(const Tensor& rows) const {
  const int64_t C = rows.dim(-1);
  if (!sequence_parallel_) return rows.reshape({B_, T_, C});
  Tensor all = Tensor::empty({B_, T_, C}, rows.dtype(), rows.device());
  tp_.all_gather_async(rows, all)->wait_on_device();
  return all;
}

Tensor TpGpt2Block::sum_over_tp(const Tensor& partial) const {
  const int64_t N = B_ * T_, C = partial.numel() / N;
  Tensor sum = partial.reshape({N, C});
  if (!sequence_parallel_) {
    tp_.all_reduce_async(sum, ReduceOp::kSum)->wait_on_device();
    return sum;
  }
  Tensor mine = Tensor::empty({N / tp_.size(), C}, partial.dtype(), partial.device());
  tp_.reduce_scatter_async(sum, mine, ReduceOp::kSum)->wait_on_device();
  return mine;
}

Tensor TpGpt2Block::project_qkv(Context& ctx, const Tensor& normed, bool rounded) {
  // (rows, (NH + 2·KV)·hd / P): this rank's heads — in 16 bits where `rounded`.
  Tensor qkv = rounded ? qkv_.forward_rounded_output(ctx, normed) : qkv_.forward(ctx, normed);
  if (!llama_) return qkv;
  if (qk_norm_) {  // Qwen 3: this rank's query and key heads normalised (fp32: never `rounded`)
    LOOM_CHECK(!rounded);
    qk_norm_->forward(ctx, qkv, local_heads_, local_kv_heads_);
  }
  // Llama: this rank's q and k turned in place, in the type they were written in.
  const Tensor& rope = rope_tables_->get(ctx, T_, head_dim_, rope_frequencies_);
  if (rounded)
    ops::rope_forward_rounded(ctx.exec(), qkv.raw(), qkv.dtype(), rope.data<float>(), B_, T_,
                              local_heads_, local_kv_heads_, head_dim_);
  else
    ops::rope_forward<float>(ctx.exec(), qkv.data<float>(), rope.data<float>(), B_, T_,
                             local_heads_, local_kv_heads_, head_dim_);
  return qkv;
}

Tensor TpGpt2Block::run_forward(Context& ctx, const Tensor& x) {
  const int64_t B = B_, T = T_;
  const Exec ex = ctx.exec();
  // The norms' outputs feed only the column-parallel qkv and fc: forward_for_matmul writes them
  // as those keep them (16-bit on a GPU at bf16 / fp16, gathered so with sequence parallelism).
  // Post-norm (OLMo 2): the column-parallel qkv reads the residual stream itself.
  const Tensor normed = post_norm_ ? x : ln_1_->forward_for_matmul(ctx, x);
  documents_ = attention_starts(ctx, window_, B, T, sliding_window_);  // nn/sliding_window.h
  const cpu::DocumentStarts docs = document_starts_of(documents_);
  if (ctx.sequence != nullptr) {
    // Context parallelism: this rank's key/value heads of the whole sequence gathered over cp
    // (or passed round the ring), the attention of its positions' rows (nn/sequence_shard.h).
    // Where the flash kernels take the rows (a GPU at bf16) as an unsharded model's attention
    // under cp (nn/causal_self_attention.cc, attend_shard): qkv written in bf16, the output kept
    // as proj's rounded input. Kept: the queries alone (qkv_out_) and the keys and values.
    const bool rounded =
        !qk_norm_ && shard_attention_takes_bf16(ctx, *ctx.sequence, B, local_heads_, head_dim_);
    const Tensor local = project_qkv(ctx, normed, rounded);
    shard_attention_forward(ctx, *ctx.sequence, local, B, local_heads_, local_kv_heads_, head_dim_,
                            qkv_out_, kv_full_, att_, lse_, /*rounded_output=*/rounded, docs);
    return after_attention(ctx, x);
  }
  lse_ = Tensor::empty({B, local_heads_, T}, DType::kF32, ctx.device);
  // On a GPU at bf16 / fp16 the attention of this rank's heads runs as one GPU's does
  // (nn/causal_self_attention.cc, attend_rotary): qkv in 16 bits where the flash kernels read it
  // so, the output written as proj's rounded input.
  // With qk_norm qkv in fp32 at bf16, the fp32 path at fp16, as one GPU's attention takes it.
  const DType out_dtype = ops::matmul_input_dtype(ex, DType::kF32);
  if (out_dtype != DType::kF32 && (!qk_norm_ || out_dtype == DType::kBF16)) {
    qkv_out_ = project_qkv(
        ctx, normed,
        !qk_norm_ && ops::attention_takes_rounded_qkv(ex, local_width_, local_heads_, B));
    att_ = Tensor::empty({B * T, local_width_}, out_dtype, ctx.device);
    ops::attention_gqa_forward_rounded(ex, att_.raw(), out_dtype, lse_.data<float>(),
                                       qkv_out_.raw(), qkv_out_.dtype(), B, T, local_heads_,
                                       local_kv_heads_, head_dim_, docs);
    return after_attention(ctx, x);
  }
  qkv_out_ = project_qkv(ctx, normed, false);
  att_ = Tensor::empty({B * T, local_width_}, DType::kF32, ctx.device);
  // GPT-2: as many key/value heads as query heads, the 3C/P layout.
  ops::attention_gqa_forward<float>(ex, att_.data<float>(), lse_.data<float>(),
                                    qkv_out_.data<float>(), B, T, local_heads_, local_kv_heads_,
                                    head_dim_, docs);
  return after_attention(ctx, x);
}

Tensor TpGpt2Block::after_attention(Context& ctx, const Tensor& x) {
  const Exec ex = ctx.exec();
  // Post-norm: the row-parallel proj's summed output (this rank's rows with sequence
  // parallelism) normalised before the skip connection, then the MLP's likewise.
  Tensor x1 = attn_proj_.forward(ctx, att_);
  if (Norm* out = output_norm(1)) x1 = out->forward(ctx, x1);
  ops::add_inplace<float>(ex, x1.data<float>(), x.data<float>(), x1.numel());
  if (post_norm_ && moe_ && recompute_ == Recompute::kSelective) middle_ = x1;
  const Tensor mlp_in = post_norm_ ? x1 : ln_2_->forward_for_matmul(ctx, x1);
  // A mixture: its part of every token's output, summed over tp, then the skip connection.
  Tensor y = moe_ ? sum_over_tp(moe_->forward(ctx, whole_rows(mlp_in)))
                  : mlp_proj_->forward(ctx, mlp_up(ctx, mlp_in));
  if (Norm* out = output_norm(2)) y = out->forward(ctx, y);
  ops::add_inplace<float>(ex, y.data<float>(), x1.data<float>(), y.numel());
  return y;
}

Tensor TpGpt2Block::backward(Context& ctx, const Tensor& dy) {
  const Exec ex = ctx.exec();
  const bool selective = recompute_ == Recompute::kSelective;
  if (recompute_ == Recompute::kFull) {
    LOOM_CHECK(input_.defined());
    run_forward(ctx, input_);  // same inputs, kernels and collectives: bitwise the same
    input_ = Tensor();
  }
  // y = x1 + proj(gelu(fc(ln_2(x1)))). Selective: each dropped activation is rebuilt right
  // before the backward that reads it (the GELU output from h, the LayerNorm outputs from their
  // kept inputs, mean and rstd — with sequence parallelism all-gathered again).
  // Post-norm: y = x1 + ln_2(mlp(x1)), the MLP's backward from ln_2's.
  const Tensor dmlp_out = output_norm(2) ? output_norm(2)->backward(ctx, dy) : dy;
  Tensor dmlp;
  if (moe_) {  // its part of the input gradient of every token, summed over tp
    if (selective)
      moe_->restore_input(whole_rows(post_norm_ ? middle_ : ln_2_->recompute_output(ctx)));
    dmlp = sum_over_tp(moe_->backward(ctx, whole_rows(dmlp_out)));
  } else {
    if (selective) mlp_proj_->restore_input(activation(ctx));
    dmlp = mlp_down_backward(ctx, dmlp_out, selective);
  }
  Tensor dx1;
  if (post_norm_) {
    dx1 = dmlp;
    ops::add_inplace<float>(ex, dx1.data<float>(), dy.data<float>(), dx1.numel());
  } else {
    dx1 = ln_2_->backward_adding(ctx, dmlp, dy);
  }
  // Post-norm: x1 = x + ln_1(proj(attention(qkv(x)))), proj's backward from ln_1's.
  const Tensor dproj = output_norm(1) ? output_norm(1)->backward(ctx, dx1) : dx1;
  // x1 = x + proj(attention(qkv(ln_1(x))))
  const cpu::DocumentStarts docs = document_starts_of(documents_);
  Tensor dqkv;
  bool normed_back = false;  // the bf16 path's qk_norm: dqkv turned back and normed back already
  if (ctx.sequence != nullptr) {  // proj's input gradient in fp32 whatever att_'s type
    Tensor datt = attn_proj_.backward(ctx, dproj);
    dqkv = shard_attention_backward(ctx, *ctx.sequence, qkv_out_, kv_full_, att_, lse_, datt,
                                    local_heads_, local_kv_heads_, head_dim_, docs)
               .reshape({B_ * T_, (local_heads_ + 2 * local_kv_heads_) * head_dim_});
  } else if (att_.dtype() != DType::kF32) {  // the 16-bit forward: dqkv as qkv's rounded dout
    // Where the flash kernels read qkv in 16 bits they read dO (proj's dinp) so too.
    const Tensor datt = qkv_out_.dtype() != DType::kF32
                            ? attn_proj_.backward_rounded_dinp(ctx, dproj)
                            : attn_proj_.backward(ctx, dproj);
    dqkv = Tensor::empty(qkv_out_.shape(), att_.dtype(), ctx.device);
    ops::attention_gqa_backward_rounded(
        ex, dqkv.raw(), datt.raw(), datt.dtype(), qkv_out_.raw(), qkv_out_.dtype(), att_.raw(),
        att_.dtype(), lse_.data<float>(), B_, T_, local_heads_, local_kv_heads_, head_dim_, docs);
    if (llama_)
      ops::rope_backward_rounded(
          ex, dqkv.raw(), dqkv.dtype(),
          rope_tables_->get(ctx, T_, head_dim_, rope_frequencies_).data<float>(), B_, T_,
          local_heads_, local_kv_heads_, head_dim_);
    // Qwen 3 at bf16: its norms' backward in fp32 (turned back already), qkv's dout so too.
    if (qk_norm_) {
      dqkv = qk_norm_->backward_widening(ctx, dqkv, local_heads_, local_kv_heads_);
      normed_back = true;
    }
  } else {
    Tensor datt = attn_proj_.backward(ctx, dproj);
    dqkv = Tensor::empty(qkv_out_.shape(), DType::kF32, ctx.device);
    ops::attention_gqa_backward<float>(
        ex, dqkv.data<float>(), datt.data<float>(), qkv_out_.data<float>(), att_.data<float>(),
        lse_.data<float>(), B_, T_, local_heads_, local_kv_heads_, head_dim_, docs);
  }
  if (llama_ && dqkv.dtype() == DType::kF32 && !normed_back) {
    // q and k turned back (shared heads' sums in)
    ops::rope_backward<float>(
        ex, dqkv.data<float>(),
        rope_tables_->get(ctx, T_, head_dim_, rope_frequencies_).data<float>(), B_, T_,
        local_heads_, local_kv_heads_, head_dim_);
    if (qk_norm_) qk_norm_->backward(ctx, dqkv, local_heads_, local_kv_heads_);
  }
  if (selective && !post_norm_) qkv_.restore_input(ln_1_->recompute_output(ctx));
  Tensor dx;
  if (post_norm_) {
    dx = qkv_.backward(ctx, dqkv);
    ops::add_inplace<float>(ex, dx.data<float>(), dx1.data<float>(), dx.numel());
  } else {
    dx = ln_1_->backward_adding(ctx, qkv_.backward(ctx, dqkv), dx1);
  }
  clear_cache();
  return dx;
}

void TpGpt2Block::collect_cache(std::vector<Tensor*>& out) {
  ln_1_->collect_cache(out);
  qkv_.collect_cache(out);
  attn_proj_.collect_cache(out);
  if (qk_norm_) qk_norm_->collect_cache(out);
  ln_2_->collect_cache(out);
  if (attn_out_norm_) {
    attn_out_norm_->collect_cache(out);
    mlp_out_norm_->collect_cache(out);
  }
  if (moe_) {
    moe_->collect_cache(out);
  } else {
    fc_->collect_cache(out);
    mlp_proj_->collect_cache(out);
  }
  out.insert(out.end(), {&qkv_out_, &kv_full_, &att_, &lse_, &h_, &input_, &middle_, &documents_});
}

void TpGpt2Block::clear_cache() {
  std::vector<Tensor*> slots;
  collect_cache(slots);
  for (Tensor* t : slots) *t = Tensor();
}

}  // namespace loom
