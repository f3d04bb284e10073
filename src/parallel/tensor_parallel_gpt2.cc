// GPT-2 with tensor parallelism: see tensor_parallel_gpt2.h.
#include "parallel/tensor_parallel_gpt2.h"

#include "base/error.h"
#include "kernels/ops.h"

namespace loom {

TpGpt2::TpGpt2(const Gpt2Config& config, Communicator& tp, bool sequence_parallel,
               const Gpt2Part& part, ExpertExchange* experts)
    : config_(config), part_(part), tp_(tp), sequence_parallel_(sequence_parallel) {
  config_.validate();
  part_ = part.resolved(config_.n_layers);
  // Units as Gpt2's: the root when the part has either end, then one per block.
  if (part_.embedding || part_.head) {
    params_.begin_unit("root");
    root_unit_ = 0;
  }
  if (part_.embedding)
    vocab_ = std::make_unique<VocabParallelEmbedding>(params_, config.vocab_size,
                                                      config_.position_rows(), config.d_model,
                                                      config.init_std, tp, sequence_parallel);
  if (part_.head) {
    // The tied head is the embedding's own slice of wte; a part without the embedding holds a
    // copy of it, and an untied head its own lm_head.weight, both vocabulary-parallel too.
    if (config_.tie_embeddings && vocab_ != nullptr) {
      head_ = vocab_.get();
    } else {
      head_vocab_ = std::make_unique<VocabParallelEmbedding>(
          params_, config.vocab_size, 0, config.d_model, config.init_std, tp, sequence_parallel,
          /*lookup=*/false, config_.tie_embeddings ? "wte.weight" : "lm_head.weight");
      head_ = head_vocab_.get();
    }
    head_->wte()->gemm_operand = true;  // the head's GEMMs read it (nn/rounded_weights.h)
    ln_f_ = make_norm(params_, "ln_f", config.d_model, config_.llama(), config_.norm_eps);
    if (sequence_parallel) ln_f_params_ = ln_f_->parameters();
  }
  for (int64_t l = part_.first_block; l < part_.end_block; ++l) {
    const std::string name = "blocks." + std::to_string(l);
    params_.begin_unit(name);
    block_unit_.push_back(params_.units().size() - 1);
    blocks_.push_back(std::make_unique<TpGpt2Block>(params_, name, config_.block(l), tp,
                                                    sequence_parallel, experts, rope_tables_));
  }
}

double TpGpt2::aux_loss() const {
  return blocks_aux_loss(blocks_);
}

void TpGpt2::set_expert_biases(const std::vector<float>& biases) {
  set_blocks_expert_biases(blocks_, part_.first_block, config_.moe_experts, biases);
}

void TpGpt2::add_expert_tokens(std::vector<double>& counts) const {
  add_blocks_expert_tokens(blocks_, part_.first_block, counts);
}

Shape TpGpt2::boundary_shape(int64_t B, int64_t T) const {
  return {sequence_parallel_ ? B * T / tp_.size() : B * T, config_.d_model};
}

double TpGpt2::forward(Context& ctx, const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK_MSG(part_.embedding && part_.head, "TpGpt2::forward needs the whole model");
  if (targets.shape() != tokens.shape())
    fail("targets ", shape_str(targets.shape()), " must be shaped like tokens ",
         shape_str(tokens.shape()));
  double loss = 0;
  forward_part(ctx, tokens, targets, &loss);
  return loss;
}

void TpGpt2::backward(Context& ctx, double scale) { backward_part(ctx, Tensor(), scale); }

Tensor TpGpt2::forward_part(Context& ctx, const Tensor& input, const Tensor& targets,
                            double* loss) {
  if (targets.ndim() != 2 || targets.dtype() != DType::kI32)
    fail("targets ", shape_str(targets.shape()), " must be (B, T) i32");
  const int64_t B = targets.dim(0), T = targets.dim(1), N = B * T, C = config_.d_model;
  if (sequence_parallel_ && N % tp_.size() != 0)
    fail("sequence parallelism: micro_batch_size × seq_len = ", N, " tokens do not split over ",
         "parallel.tp = ", tp_.size());
  if (root_unit_ >= 0) hook_before_forward(ctx, static_cast<size_t>(root_unit_));
  Tensor x = part_.embedding
                 ? scale_embedding(ctx, vocab_->forward(ctx, input), config_.embedding_multiplier)
                 : input;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    hook_before_forward(ctx, block_unit_[l]);
    x = blocks_[l]->forward(ctx, x, B, T);
    hook_after_forward(ctx, block_unit_[l]);
  }
  Tensor out;
  if (part_.head) {
    Tensor h = ln_f_->forward(ctx, x);
    if (sequence_parallel_) {
      Tensor all = Tensor::empty({N, C}, DType::kF32, ctx.device);
      tp_.all_gather_async(h, all)->wait_on_device();
      h = all;
    }
    head_->head_forward(ctx, h, targets.reshape({N}), loss);
  } else {
    out = x;
  }
  if (root_unit_ >= 0) hook_after_forward(ctx, static_cast<size_t>(root_unit_));
  return out;
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
    tp_.all_reduce_async(p->grad, ReduceOp::kSum)->wait_on_device();
    ops::add_inplace<float>(ctx.exec(), real[i].data<float>(), p->grad.data<float>(), p->numel());
    p->grad = real[i];
  }
  return out;
}

Tensor TpGpt2::backward_part(Context& ctx, const Tensor& dy, double scale) {
  ctx.backward_scale = scale;  // for the blocks' inner losses (a mixture of experts')
  if (root_unit_ >= 0) hook_before_backward(ctx, static_cast<size_t>(root_unit_));
  Tensor dx = dy;
  if (part_.head) {
    Tensor dh = head_->head_backward(ctx, scale);
    dx = reduced_over_tp(ctx, ln_f_params_, [&] { return ln_f_->backward(ctx, dh); });
  } else {
    LOOM_CHECK_MSG(dy.defined(), "a model part without the head needs its output's gradient");
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    hook_before_backward(ctx, block_unit_[l]);
    TpGpt2Block& block = *blocks_[l];
    dx = reduced_over_tp(ctx, block.tp_summed_params(), [&] { return block.backward(ctx, dx); });
    hook_after_backward(ctx, block_unit_[l]);
  }
  Tensor out;
  if (part_.embedding)
    vocab_->backward(ctx, scale_embedding(ctx, dx, config_.embedding_multiplier));
  else out = dx;
  if (root_unit_ >= 0) hook_after_backward(ctx, static_cast<size_t>(root_unit_));
  return out;
}

std::vector<Tensor*> TpGpt2::cache_slots() {
  std::vector<Tensor*> slots;
  if (vocab_) vocab_->collect_cache(slots);
  if (head_vocab_) head_vocab_->collect_cache(slots);
  for (auto& b : blocks_) b->collect_cache(slots);
  if (ln_f_) ln_f_->collect_cache(slots);
  return slots;
}

}  // namespace loom
