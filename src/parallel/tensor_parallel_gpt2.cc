// GPT-2 with tensor parallelism: see tensor_parallel_gpt2.h.
#include "parallel/tensor_parallel_gpt2.h"

#include "base/error.h"
#include "kernels/cpu/elementwise.h"

namespace loom {

TpGpt2::TpGpt2(const Gpt2Config& config, Communicator& tp, bool sequence_parallel)
    : config_(config), tp_(tp), sequence_parallel_(sequence_parallel) {
  config_.validate();
  params_.begin_unit("root");
  vocab_ = std::make_unique<VocabParallelEmbedding>(params_, config.vocab_size, config.max_seq_len,
                                                    config.d_model, config.init_std, tp,
                                                    sequence_parallel);
  ln_f_ = std::make_unique<LayerNorm>(params_, "ln_f", config.d_model);
  if (sequence_parallel) ln_f_params_ = {&params_.get("ln_f.weight"), &params_.get("ln_f.bias")};
  for (int64_t l = 0; l < config.n_layers; ++l) {
    const std::string name = "blocks." + std::to_string(l);
    params_.begin_unit(name);
    blocks_.push_back(std::make_unique<TpGpt2Block>(params_, name, config_, tp, sequence_parallel));
  }
}

double TpGpt2::forward(Context& ctx, const Tensor& tokens, const Tensor& targets) {
  if (targets.shape() != tokens.shape() || targets.dtype() != DType::kI32)
    fail("targets ", shape_str(targets.shape()), " must be i32 and shaped like tokens ",
         shape_str(tokens.shape()));
  B_ = tokens.dim(0);
  T_ = tokens.dim(1);
  const int64_t N = B_ * T_, C = config_.d_model;
  if (sequence_parallel_ && N % tp_.size() != 0)
    fail("sequence parallelism: micro_batch_size × seq_len = ", N, " tokens do not split over ",
         "parallel.tp = ", tp_.size());
  hook_before_forward(ctx, 0);
  Tensor x = vocab_->forward(ctx, tokens);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    hook_before_forward(ctx, 1 + l);
    x = blocks_[l]->forward(ctx, x, B_, T_);
    hook_after_forward(ctx, 1 + l);
  }
  Tensor h = ln_f_->forward(ctx, x);
  if (sequence_parallel_) {
    Tensor all = Tensor::empty({N, C}, DType::kF32, ctx.device);
    tp_.all_gather(h, all);
    h = all;
  }
  const double loss = vocab_->head_forward(ctx, h, targets.reshape({N}));
  hook_after_forward(ctx, 0);
  return loss;
}

template <typename Fn>
Tensor TpGpt2::reduced_over_tp(Context& ctx, const std::vector<Parameter*>& params, Fn backward) {
  std::vector<Tensor> real;
  for (Parameter* p : params) {
    real.push_back(p->grad);
    p->grad = Tensor::zeros(p->shape, DType::kF32, ctx.device);
  }
  Tensor out = backward();
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter* p = params[i];
    tp_.all_reduce(p->grad, ReduceOp::kSum);
    cpu::add_inplace<float>(*ctx.pool, real[i].data<float>(), p->grad.data<float>(), p->numel());
    p->grad = real[i];
  }
  return out;
}

void TpGpt2::backward(Context& ctx, double scale) {
  hook_before_backward(ctx, 0);
  Tensor dh = vocab_->head_backward(ctx, scale);
  Tensor dx = reduced_over_tp(ctx, ln_f_params_, [&] { return ln_f_->backward(ctx, dh); });
  for (size_t l = blocks_.size(); l-- > 0;) {
    hook_before_backward(ctx, 1 + l);
    TpGpt2Block& block = *blocks_[l];
    dx = reduced_over_tp(ctx, block.sequence_parallel_params(), [&] { return block.backward(ctx, dx); });
    hook_after_backward(ctx, 1 + l);
  }
  vocab_->backward(ctx, dx);
  hook_after_backward(ctx, 0);
}

void TpGpt2::clear_cache() {
  vocab_->clear_cache();
  ln_f_->clear_cache();
  for (auto& b : blocks_) b->clear_cache();
}

}  // namespace loom
