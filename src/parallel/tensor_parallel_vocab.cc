// Vocabulary-parallel embedding, LM head and cross-entropy: see tensor_parallel_vocab.h.
#include "parallel/tensor_parallel_vocab.h"

#include <cmath>
#include <limits>

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/deferred_weight_grads.h"
#include "nn/embedding.h"
#include "nn/rounded_weights.h"
#include "nn/sequence_shard.h"
#include "nn/step_losses.h"
#include "parallel/tp_backward_overlap.h"

namespace loom {

VocabParallelEmbedding::VocabParallelEmbedding(ParameterStore& store, int64_t vocab,
                                               int64_t max_seq, int64_t channels, float init_std,
                                               Communicator& tp, bool sequence_parallel,
                                               bool lookup, const std::string& weight_name)
    : vocab_(vocab),
      channels_(channels),
      tp_(tp),
      sequence_parallel_(sequence_parallel),
      lookup_(lookup) {
  const int64_t P = tp.size();
  local_vocab_ = (vocab + P - 1) / P;
  first_row_ = tp.rank() * local_vocab_;
  real_rows_ = std::max<int64_t>(0, std::min(local_vocab_, vocab - first_row_));
  std::vector<ShardPiece> pieces;
  if (real_rows_ > 0) pieces.push_back({0, real_rows_, Region{{vocab, channels}, {first_row_, 0}}});
  wte_ = store.add_shard(weight_name, {local_vocab_, channels}, {vocab, channels}, pieces,
                         InitKind::kNormal, init_std);
  if (lookup && max_seq > 0)
    wpe_ = store.add("wpe.weight", {max_seq, channels}, InitKind::kNormal, init_std);
}

Tensor VocabParallelEmbedding::forward(Context& ctx, const Tensor& tokens) {
  LOOM_CHECK_MSG(lookup_, "a head-only vocabulary-parallel embedding has no lookup");
  if (tokens.ndim() != 2 || tokens.dtype() != DType::kI32) fail("embedding: tokens must be (B, T) i32");
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = channels_, N = B * T;
  if (wpe_ != nullptr && T > wpe_->shape[0]) fail("embedding: sequence length ", T, " exceeds max_seq_len ", wpe_->shape[0]);
  Tensor out = Tensor::empty({N, C}, DType::kF32, ctx.device);
  const bool add_positions = tp_.rank() == 0;  // once in the sum over ranks
  // Positions reset at each document: each token's row of wpe by its place in its document.
  position_ids_ = wpe_ ? document_position_ids(ctx, B, T, wpe_->shape[0]) : Tensor();
  const bool by_id = position_ids_.defined();
  // A context-parallel shard reads its positions' rows of wpe (nn/sequence_shard.h).
  const Tensor positions =
      wpe_ && ctx.sequence && !by_id ? rows_of(wpe_->value, ctx.sequence->positions()) : Tensor();
  ops::vocab_shard_embedding_forward<float>(
      ctx.exec(), out.data<float>(), tokens.data<int32_t>(), wte_->value.data<float>(),
      wpe_ && !by_id ? (ctx.sequence ? positions : wpe_->value).data<float>() : nullptr, N, T, C,
      shard(), add_positions);
  if (by_id && add_positions)
    ops::add_rows_by_id<float>(ctx.exec(), out.data<float>(), wpe_->value.data<float>(),
                               position_ids_.data<int32_t>(), N, C);
  tokens_ = tokens;
  if (!sequence_parallel_) {
    tp_.all_reduce_async(out, ReduceOp::kSum)->wait_on_device();
    return out;
  }
  Tensor mine = Tensor::empty({N / tp_.size(), C}, DType::kF32, ctx.device);
  tp_.reduce_scatter_async(out, mine, ReduceOp::kSum)->wait_on_device();
  return mine;
}

void VocabParallelEmbedding::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(tokens_.defined());
  const int64_t T = tokens_.dim(1), C = channels_, N = tokens_.numel();
  Tensor d = dy;
  if (sequence_parallel_) {
    d = Tensor::empty({N, C}, DType::kF32, ctx.device);
    tp_.all_gather_async(dy, d)->wait_on_device();
  }
  const bool by_id = position_ids_.defined();  // positions reset at each document
  const bool positions_apart = wpe_ != nullptr && ctx.sequence != nullptr && !by_id;
  Tensor dpositions = positions_apart ? Tensor::zeros({T, C}, DType::kF32, ctx.device) : Tensor();
  ops::vocab_shard_embedding_backward<float>(ctx.exec(), wte_->grad.data<float>(),
                                             positions_apart  ? dpositions.data<float>()
                                             : wpe_ && !by_id ? wpe_->grad.data<float>()
                                                              : nullptr,
                                             d.data<float>(), tokens_.data<int32_t>(), N, T, C,
                                             shard());
  if (positions_apart) add_rows_into(ctx.exec(), wpe_->grad, dpositions, ctx.sequence->positions());
  if (by_id)  // every rank's whole table, as above: the rows the tokens read (ids as tokens)
    ops::embedding_backward<float>(ctx.exec(), wpe_->grad.data<float>(), nullptr, d.data<float>(),
                                   position_ids_.data<int32_t>(), 1, N, C);
  tokens_ = Tensor();
  position_ids_ = Tensor();
}

void VocabParallelEmbedding::head_forward(Context& ctx, const Tensor& final, const Tensor& targets,
                                          double* loss) {
  const int64_t N = final.dim(0), C = channels_, Vl = local_vocab_;
  targets_ = targets;
  max_ = Tensor::empty({N}, DType::kF32, ctx.device);
  sum_ = Tensor::empty({N}, DType::kF32, ctx.device);
  Tensor target_logit = Tensor::zeros({N}, DType::kF32, ctx.device);
  if (const DType kept = ops::matmul_input_dtype(ctx.exec(), DType::kF32); kept != DType::kF32) {
    // A GPU at bf16 / fp16: the shard's logits written in that 16-bit type by the GEMM, as the
    // unsharded head keeps them (models/gpt2.cc) — half the bytes of the largest activation —,
    // and turned into their gradient in place; final kept as both GEMMs read it, rounded once;
    // the weight's 16-bit copy where the step keeps one (nn/rounded_weights.h).
    final_ = Tensor::empty(final.shape(), kept, ctx.device);
    logits_ = Tensor::empty({N, Vl}, kept, ctx.device);
    ops::matmul_forward_rounded_output(ctx.exec(), logits_.raw(), kept, final.raw(), DType::kF32,
                                       final_.raw(), gemm_weight(ctx, *wte_), nullptr, N, C, Vl);
    ops::vocab_shard_logit_max_rounded(ctx.exec(), max_.data<float>(), target_logit.data<float>(),
                                       logits_.raw(), kept, targets.data<int32_t>(), N, shard());
    tp_.all_reduce_async(max_, ReduceOp::kMax)->wait_on_device();
    ops::vocab_shard_sum_exp_rounded(ctx.exec(), sum_.data<float>(), logits_.raw(), kept,
                                     max_.data<float>(), N, shard());
  } else {
    final_ = final;
    logits_ = Tensor::empty({N, Vl}, DType::kF32, ctx.device);
    ops::matmul_forward<float>(ctx.exec(), logits_.data<float>(), final.data<float>(),
                               wte_->value.data<float>(), nullptr, N, C, Vl);
    ops::vocab_shard_logit_max<float>(ctx.exec(), max_.data<float>(), target_logit.data<float>(),
                                      logits_.data<float>(), targets.data<int32_t>(), N, shard());
    tp_.all_reduce_async(max_, ReduceOp::kMax)->wait_on_device();
    ops::vocab_shard_sum_exp<float>(ctx.exec(), sum_.data<float>(), logits_.data<float>(),
                                    max_.data<float>(), N, shard());
  }
  tp_.all_reduce_async(sum_, ReduceOp::kSum)->wait_on_device();
  tp_.all_reduce_async(target_logit, ReduceOp::kSum)->wait_on_device();
  // The z-loss's Σ lse² for the step's report, lse = the group's max + log(sum) (the same on
  // every rank).
  if (ctx.z_loss > 0 && ctx.losses != nullptr)
    ops::lse_square_sum<float>(ctx.exec(), ctx.losses->add_lse_square_sum_of(N), max_.data<float>(),
                               sum_.data<float>(), targets.data<int32_t>(), N);
  // The rows' losses summed where they are: into a slot of the step's (nn/step_losses.h), or
  // read now.
  if (ctx.losses != nullptr) {
    ops::vocab_shard_loss_sum<float>(ctx.exec(), ctx.losses->add_sum_of(N), sum_.data<float>(),
                                     max_.data<float>(), target_logit.data<float>(),
                                     targets.data<int32_t>(), N);
    return;
  }
  LOOM_CHECK(loss != nullptr);
  Tensor total = Tensor::empty({1}, DType::kF64, ctx.device);
  ops::vocab_shard_loss_sum<float>(ctx.exec(), total.data<double>(), sum_.data<float>(),
                                   max_.data<float>(), target_logit.data<float>(),
                                   targets.data<int32_t>(), N);
  *loss = total.to(Device::cpu()).data<double>()[0] / static_cast<double>(N);
}

Tensor VocabParallelEmbedding::head_backward(Context& ctx, double scale) {
  LOOM_CHECK(logits_.defined());
  const int64_t N = final_.dim(0), C = channels_, Vl = local_vocab_;
  const float k = static_cast<float>(scale / static_cast<double>(N));
  // dlogits = (softmax − onehot) · scale / N, in place (in the logits' type); padding columns
  // zero.
  if (logits_.dtype() != DType::kF32)
    ops::vocab_shard_cross_entropy_backward_rounded(
        ctx.exec(), logits_.raw(), logits_.dtype(), max_.data<float>(), sum_.data<float>(),
        targets_.data<int32_t>(), k, N, shard(), ctx.z_loss);
  else
    ops::vocab_shard_cross_entropy_backward<float>(
        ctx.exec(), logits_.data<float>(), max_.data<float>(), sum_.data<float>(),
        targets_.data<int32_t>(), k, N, shard(), ctx.z_loss);
  Tensor dfinal = Tensor::empty({N, C}, DType::kF32, ctx.device);
  // The shard's weight gradient (the stage's largest GEMM) left for a zero-bubble schedule's W,
  // which keeps the logits' gradient and final_ until then, or run behind dfinal's collective.
  WeightGradsBehindComm weight_grads(ctx);
  DeferredWeightGrads* later = weight_grads.later();
  // The logits' gradient and final_ as head_forward kept them: f32, or both rounded to 16 bits
  // for the GEMMs.
  const auto gemms = [N, C, Vl](const Exec& ex, float* dinp, float* dweight, const Tensor& dlogits,
                                const Tensor& final, ops::GemmWeight weight) {
    if (dlogits.dtype() == DType::kF32)
      ops::matmul_backward<float>(ex, dinp, dweight, nullptr, dlogits.data<float>(),
                                  final.data<float>(), weight.values, N, C, Vl);
    else
      ops::matmul_backward_from_rounded(ex, dinp, dweight, nullptr, dlogits.raw(), dlogits.dtype(),
                                        final.raw(), final.dtype(), weight, N, C, Vl);
  };
  gemms(ctx.exec(), dfinal.data<float>(), later ? nullptr : wte_->grad.data<float>(), logits_,
        final_, gemm_weight(ctx, *wte_));
  if (later != nullptr)
    later->add(
        [gemms, wte = wte_, dlogits = logits_, final = final_](const Exec& ex) {
          gemms(ex, nullptr, wte->grad.data<float>(), dlogits, final, nullptr);
        },
        static_cast<int64_t>(logits_.nbytes() + final_.nbytes()));
  final_ = logits_ = max_ = sum_ = targets_ = Tensor();
  if (!sequence_parallel_) {
    weight_grads.finish(tp_.all_reduce_async(dfinal, ReduceOp::kSum));
    return dfinal;
  }
  Tensor mine = Tensor::empty({N / tp_.size(), C}, DType::kF32, ctx.device);
  weight_grads.finish(tp_.reduce_scatter_async(dfinal, mine, ReduceOp::kSum));
  return mine;
}

void VocabParallelEmbedding::collect_cache(std::vector<Tensor*>& out) {
  out.insert(out.end(), {&tokens_, &position_ids_, &final_, &logits_, &max_, &sum_, &targets_});
}

void VocabParallelEmbedding::clear_cache() {
  std::vector<Tensor*> slots;
  collect_cache(slots);
  for (Tensor* t : slots) *t = Tensor();
}

}  // namespace loom
