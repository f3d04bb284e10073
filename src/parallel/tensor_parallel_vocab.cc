// Vocabulary-parallel embedding, LM head and cross-entropy: see tensor_parallel_vocab.h.
#include "parallel/tensor_parallel_vocab.h"

#include <cmath>
#include <limits>

#include "base/error.h"
#include "kernels/ops.h"

namespace loom {

VocabParallelEmbedding::VocabParallelEmbedding(ParameterStore& store, int64_t vocab,
                                               int64_t max_seq, int64_t channels, float init_std,
                                               Communicator& tp, bool sequence_parallel)
    : vocab_(vocab), channels_(channels), tp_(tp), sequence_parallel_(sequence_parallel) {
  const int64_t P = tp.size();
  local_vocab_ = (vocab + P - 1) / P;
  first_row_ = tp.rank() * local_vocab_;
  real_rows_ = std::max<int64_t>(0, std::min(local_vocab_, vocab - first_row_));
  std::vector<ShardPiece> pieces;
  if (real_rows_ > 0) pieces.push_back({0, real_rows_, Region{{vocab, channels}, {first_row_, 0}}});
  wte_ = store.add_shard("wte.weight", {local_vocab_, channels}, {vocab, channels}, pieces,
                         InitKind::kNormal, init_std);
  if (max_seq > 0) wpe_ = store.add("wpe.weight", {max_seq, channels}, InitKind::kNormal, init_std);
}

Tensor VocabParallelEmbedding::forward(Context& ctx, const Tensor& tokens) {
  LOOM_CHECK_MSG(wpe_ != nullptr, "a head-only vocabulary-parallel embedding has no lookup");
  if (tokens.ndim() != 2 || tokens.dtype() != DType::kI32) fail("embedding: tokens must be (B, T) i32");
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = channels_, N = B * T;
  if (T > wpe_->shape[0]) fail("embedding: sequence length ", T, " exceeds max_seq_len ", wpe_->shape[0]);
  const int32_t* tok = tokens.data<int32_t>();
  for (int64_t i = 0; i < N; ++i)
    if (tok[i] < 0 || tok[i] >= vocab_) fail("embedding: token ", tok[i], " at position ", i, " outside [0, ", vocab_, ")");
  tokens_ = tokens;
  Tensor out = Tensor::zeros({N, C}, DType::kF32, ctx.device);
  const float* wte = wte_->value.data<float>();
  const float* wpe = wpe_->value.data<float>();
  const bool add_positions = tp_.rank() == 0;  // once in the sum over ranks
  ctx.pool->parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* o = out.data<float>() + i * C;
      const int64_t row = tok[i] - first_row_;
      if (row >= 0 && row < real_rows_)
        for (int64_t c = 0; c < C; ++c) o[c] = wte[row * C + c];
      if (add_positions)
        for (int64_t c = 0; c < C; ++c) o[c] += wpe[(i % T) * C + c];
    }
  });
  if (!sequence_parallel_) {
    tp_.all_reduce(out, ReduceOp::kSum);
    return out;
  }
  Tensor mine = Tensor::empty({N / tp_.size(), C}, DType::kF32, ctx.device);
  tp_.reduce_scatter(out, mine, ReduceOp::kSum);
  return mine;
}

void VocabParallelEmbedding::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(tokens_.defined());
  const int64_t T = tokens_.dim(1), C = channels_, N = tokens_.numel();
  Tensor d = dy;
  if (sequence_parallel_) {
    d = Tensor::empty({N, C}, DType::kF32, ctx.device);
    tp_.all_gather(dy, d);
  }
  const int32_t* tok = tokens_.data<int32_t>();
  float* dwte = wte_->grad.data<float>();
  float* dwpe = wpe_->grad.data<float>();
  // Threads own channel slices, rows summed in position order: deterministic.
  ctx.pool->parallel_for(C, 8, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < N; ++i) {
      const float* g = d.data<float>() + i * C;
      const int64_t row = tok[i] - first_row_;
      for (int64_t c = c0; c < c1; ++c) {
        if (row >= 0 && row < real_rows_) dwte[row * C + c] += g[c];
        dwpe[(i % T) * C + c] += g[c];
      }
    }
  });
  tokens_ = Tensor();
}

double VocabParallelEmbedding::head_forward(Context& ctx, const Tensor& final, const Tensor& targets) {
  const int64_t N = final.dim(0), C = channels_, Vl = local_vocab_;
  final_ = final;
  targets_ = targets;
  logits_ = Tensor::empty({N, Vl}, DType::kF32, ctx.device);
  ops::matmul_forward<float>(ctx.exec(), logits_.data<float>(), final.data<float>(),
                             wte_->value.data<float>(), nullptr, N, C, Vl);
  max_ = Tensor::empty({N}, DType::kF32, ctx.device);
  sum_ = Tensor::empty({N}, DType::kF32, ctx.device);
  Tensor target_logit = Tensor::zeros({N}, DType::kF32, ctx.device);
  const int32_t* tgt = targets.data<int32_t>();
  // Padding columns (j >= real_rows_) take no part.
  ctx.pool->parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* l = logits_.data<float>() + i * Vl;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < real_rows_; ++j) m = std::max(m, l[j]);
      max_.data<float>()[i] = m;
      const int64_t t = tgt[i] - first_row_;
      if (t >= 0 && t < real_rows_) target_logit.data<float>()[i] = l[t];
    }
  });
  tp_.all_reduce(max_, ReduceOp::kMax);
  ctx.pool->parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* l = logits_.data<float>() + i * Vl;
      const float m = max_.data<float>()[i];
      double s = 0;
      for (int64_t j = 0; j < real_rows_; ++j) s += std::exp(static_cast<double>(l[j] - m));
      sum_.data<float>()[i] = static_cast<float>(s);
    }
  });
  tp_.all_reduce(sum_, ReduceOp::kSum);
  tp_.all_reduce(target_logit, ReduceOp::kSum);
  double loss = 0;
  for (int64_t i = 0; i < N; ++i)
    loss += std::log(static_cast<double>(sum_.data<float>()[i])) + max_.data<float>()[i] -
            target_logit.data<float>()[i];
  return loss / static_cast<double>(N);
}

Tensor VocabParallelEmbedding::head_backward(Context& ctx, double scale) {
  LOOM_CHECK(logits_.defined());
  const int64_t N = final_.dim(0), C = channels_, Vl = local_vocab_;
  const int32_t* tgt = targets_.data<int32_t>();
  const float k = static_cast<float>(scale / static_cast<double>(N));
  // dlogits = (softmax − onehot) · scale / N, in place; padding columns zero.
  ctx.pool->parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* l = logits_.data<float>() + i * Vl;
      const float m = max_.data<float>()[i], s = sum_.data<float>()[i];
      const int64_t t = tgt[i] - first_row_;
      for (int64_t j = 0; j < Vl; ++j) {
        const float p = j < real_rows_ ? std::exp(l[j] - m) / s : 0.0f;
        l[j] = (p - (j == t ? 1.0f : 0.0f)) * k;
      }
    }
  });
  Tensor dfinal = Tensor::empty({N, C}, DType::kF32, ctx.device);
  ops::matmul_backward<float>(ctx.exec(), dfinal.data<float>(), wte_->grad.data<float>(), nullptr,
                              logits_.data<float>(), final_.data<float>(),
                              wte_->value.data<float>(), N, C, Vl);
  final_ = logits_ = max_ = sum_ = targets_ = Tensor();
  if (!sequence_parallel_) {
    tp_.all_reduce(dfinal, ReduceOp::kSum);
    return dfinal;
  }
  Tensor mine = Tensor::empty({N / tp_.size(), C}, DType::kF32, ctx.device);
  tp_.reduce_scatter(dfinal, mine, ReduceOp::kSum);
  return mine;
}

void VocabParallelEmbedding::collect_cache(std::vector<Tensor*>& out) {
  out.insert(out.end(), {&tokens_, &final_, &logits_, &max_, &sum_, &targets_});
}

void VocabParallelEmbedding::clear_cache() {
  std::vector<Tensor*> slots;
  collect_cache(slots);
  for (Tensor* t : slots) *t = Tensor();
}

}  // namespace loom
