#include "nn/moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

MoeMlp::MoeMlp(ParameterStore& store, const std::string& name, const MoeShape& shape,
               const MoeLosses& losses, float init_std, float proj_std, ExpertExchange* exchange)
    : shape_(shape),
      exchange_(exchange),
      losses_(losses),
      router_(store, name + ".router", shape.channels, shape.experts, false, init_std) {
  if (shape.experts < 1 || shape.top_k < 1 || shape.top_k > shape.experts)
    fail(name, ": top ", shape.top_k, " of ", shape.experts, " experts");
  local_ = shape.experts;
  const auto add_shared = [&] {
    if (shape.shared > 0)
      shared_ = std::make_unique<SwiGluMlp>(store, name + ".shared", shape.channels,
                                            shape.shared * shape.hidden, init_std, proj_std);
  };
  if (exchange_ != nullptr) {
    const int ranks = exchange_->ranks();
    if (shape.experts % ranks != 0)
      fail(name, ": ", shape.experts, " experts do not split evenly over ", ranks,
           " expert-parallel ranks (parallel.ep)");
    local_ = shape.experts / ranks;
    first_ = local_ * exchange_->rank();
    // The shared experts are the block's, like the router; the routed ones a unit of their own
    // (the block's parameters end with this layer's).
    add_shared();
    store.begin_unit(name + ".experts", /*experts=*/true);
    expert_unit_ = static_cast<int>(store.units().size()) - 1;
  }
  for (int64_t e = first_; e < first_ + local_; ++e)
    experts_.push_back(std::make_unique<SwiGluMlp>(store, name + ".experts." + std::to_string(e),
                                                   shape.channels, shape.hidden, init_std,
                                                   proj_std));
  if (exchange_ == nullptr) add_shared();
  out_.resize(static_cast<size_t>(local_));
}

Tensor MoeMlp::forward(Context& ctx, const Tensor& x) {
  return run(ctx, x, nullptr);
}

Tensor MoeMlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return run(ctx, x, &residual);
}

Tensor MoeMlp::gather(const Exec& ex, const Tensor& tokens, int64_t e) const {
  const int64_t C = shape_.channels, n = rows_of(e);
  Tensor out = Tensor::empty({n, C}, tokens.dtype(), tokens.device());
  ops::gather_rows(ex, out.raw(), tokens.raw(), rows_.data<int32_t>() + offset(e), n,
                   C * static_cast<int64_t>(dtype_size(tokens.dtype())));
  return out;
}

Tensor MoeMlp::expert_tokens_of(const Tensor& x) const {
  const Tensor rows = x.reshape({x.numel() / shape_.channels, shape_.channels});
  return exchange_ != nullptr ? exchange_->gather(rows) : rows;
}

Tensor MoeMlp::run(Context& ctx, const Tensor& x, const Tensor* residual) {
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  if (x.dim(-1) != C || x.shape().size() != 3)
    fail(router_.weight()->name, ": input must be (B, T, ", C, ")");
  const int64_t B = x.dim(0), N = x.numel() / C, T = N / B;
  const Exec ex = exec_ = ctx.exec();
  const Tensor logits = router_.forward(ctx, x);  // (B, T, E), ctx.dtype
  probs_ = Tensor::empty({N, E}, ctx.dtype, ctx.device);
  choice_ = Tensor::empty({N, K}, DType::kI32, ctx.device);
  weight_ = Tensor::empty({N, K}, ctx.dtype, ctx.device);
  lse_ = Tensor::empty({N}, ctx.dtype, ctx.device);
  Tensor sums = Tensor::empty({B, E}, DType::kF64, ctx.device);  // each sequence's Σ p_e
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    ops::moe_route<Real>(ex, probs_.data<Real>(), choice_.data<int32_t>(), weight_.data<Real>(),
                         lse_.data<Real>(), logits.data<Real>(), N, E, K);
    ops::moe_prob_sums<Real>(ex, sums.data<double>(), probs_.data<Real>(), B, T, E);
  });
  // Under expert parallelism the local experts serve the group's tokens: their choices and
  // weights gathered (the tokens themselves below).
  const Tensor group_choice = exchange_ != nullptr ? exchange_->gather(choice_) : choice_;
  group_weight_ = exchange_ != nullptr ? exchange_->gather(weight_) : Tensor();
  const int64_t group_n = group_choice.dim(0);
  // The choices on the host (from a GPU: the block's one wait), laid out expert by expert.
  const Tensor choice = ctx.device.is_cpu() ? group_choice : group_choice.to(Device::cpu());
  if (!ctx.device.is_cpu()) sums = sums.to(Device::cpu());
  const int32_t* chosen = choice.data<int32_t>();
  // This rank's tokens' choices (its block of the group's) count for the balance loss.
  const int32_t* own = chosen + (exchange_ != nullptr ? exchange_->rank() * N * K : 0);
  counts_ = Tensor::zeros({B, E}, DType::kI32);
  int32_t* counts = counts_.data<int32_t>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < K; ++j) ++counts[(t / T) * E + own[t * K + j]];
  const auto local = [&](int32_t expert) -> int64_t {  // -1: another rank's
    const int64_t e = expert - first_;
    return e >= 0 && e < local_ ? e : -1;
  };
  offsets_ = Tensor::zeros({local_ + 1}, DType::kI32);
  int32_t* off = offsets_.data<int32_t>();
  for (int64_t i = 0; i < group_n * K; ++i)
    if (const int64_t e = local(chosen[i]); e >= 0) ++off[e + 1];
  for (int64_t e = 0; e < local_; ++e) off[e + 1] += off[e];
  const int64_t placed = off[local_];
  Tensor rows = Tensor::empty({placed}, DType::kI32), slots = Tensor::empty({placed}, DType::kI32);
  std::vector<int32_t> next(off, off + local_);
  for (int64_t t = 0; t < group_n; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = local(chosen[t * K + j]);
      if (e < 0) continue;
      const int32_t place = next[static_cast<size_t>(e)]++;
      rows.data<int32_t>()[place] = static_cast<int32_t>(t);
      slots.data<int32_t>()[place] = static_cast<int32_t>(j);
    }
  rows_ = ctx.device.is_cpu() ? rows : rows.to(ctx.device);
  slots_ = ctx.device.is_cpu() ? slots : slots.to(ctx.device);
  // The balance loss: the mean over sequences of Σ_e f_e · P_e.
  balance_loss_ = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < E; ++e)
      balance_loss_ += static_cast<double>(E) / static_cast<double>(K * T) * counts[b * E + e] *
                       sums.data<double>()[b * E + e] / static_cast<double>(T) /
                       static_cast<double>(B);
  // The router z-loss: the mean over tokens of lse², where it counts.
  router_z_loss_ = 0;
  if (losses_.router_z > 0) {
    const Tensor lse = ctx.device.is_cpu() ? lse_ : lse_.to(Device::cpu());
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      for (int64_t t = 0; t < N; ++t) {
        const double l = static_cast<double>(lse.data<Real>()[t]);
        router_z_loss_ += l * l / static_cast<double>(N);
      }
    });
  }
  expert_tokens_.assign(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < B * E; ++i) expert_tokens_[static_cast<size_t>(i % E)] += counts[i];
  // Each local expert on its tokens; their outputs weighed into y, expert by expert (a fixed
  // order). Under expert parallelism into the group's rows, summed over the group after.
  const Tensor tokens = expert_tokens_of(x);
  const Tensor& weights = exchange_ != nullptr ? group_weight_ : weight_;
  Tensor y = exchange_ != nullptr ? Tensor::zeros({group_n, C}, ctx.dtype, ctx.device)
             : residual           ? residual->clone()
                                  : Tensor::zeros(x.shape(), ctx.dtype, ctx.device);
  if (expert_unit_ >= 0) hook_before_forward(ctx, static_cast<size_t>(expert_unit_));
  for (int64_t e = 0; e < local_; ++e) {
    const size_t ei = static_cast<size_t>(e);
    const int64_t n = rows_of(e);
    out_[ei] = Tensor();
    if (n == 0) continue;  // an idle expert runs nothing; its gradient stays as it is
    out_[ei] = experts_[ei]->forward(ctx, gather(ex, tokens, e));
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      ops::moe_scatter_add<Real>(ex, y.data<Real>(), out_[ei].data<Real>(),
                                 rows_.data<int32_t>() + offset(e),
                                 slots_.data<int32_t>() + offset(e), weights.data<Real>(), n, C, K);
    });
  }
  if (expert_unit_ >= 0) hook_after_forward(ctx, static_cast<size_t>(expert_unit_));
  if (exchange_ != nullptr) {
    y = exchange_->reduce_scatter(y).reshape(x.shape());
    if (residual)
      dispatch_float(ctx.dtype, [&](auto zero) {
        using Real = decltype(zero);
        ops::add_inplace<Real>(ex, y.data<Real>(), residual->data<Real>(), N * C);
      });
  }
  // The shared experts on every token, added last (in the GEMM's epilogue on a GPU).
  if (shared_) return shared_->forward_adding(ctx, x, y);
  return y;
}

Tensor MoeMlp::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(probs_.defined());
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  const int64_t B = dy.dim(0), N = dy.numel() / C, T = N / B;
  const Exec ex = ctx.exec();
  // The gradients of the tokens' rows and their weights: this rank's N tokens, or under expert
  // parallelism the group's (every slot not a local expert's left zero), summed over the group.
  const bool group = exchange_ != nullptr;
  const Tensor dtokens = group ? exchange_->gather(dy.reshape({N, C})) : dy;
  const Tensor& weights = group ? group_weight_ : weight_;
  const int64_t rows_n = dtokens.numel() / C;
  Tensor dx = Tensor::zeros({rows_n, C}, ctx.dtype, ctx.device);
  Tensor dweight = group ? Tensor::zeros({rows_n, K}, ctx.dtype, ctx.device)
                         : Tensor::empty({N, K}, ctx.dtype, ctx.device);  // every slot an expert's
  Tensor dlogits = Tensor::empty({B, T, E}, ctx.dtype, ctx.device);
  // The balance loss's gradient at each sequence's probabilities: the coefficient × the loss's
  // scale / (B·T) × f_e.
  Tensor balance = Tensor::empty({B, E}, DType::kF64);
  const double aux = static_cast<double>(losses_.balance) * ctx.backward_scale /
                     static_cast<double>(B * T) * static_cast<double>(E) /
                     static_cast<double>(K * T);
  for (int64_t i = 0; i < B * E; ++i) balance.data<double>()[i] = aux * counts_.data<int32_t>()[i];
  if (!ctx.device.is_cpu()) balance = balance.to(ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    if (expert_unit_ >= 0) hook_before_backward(ctx, static_cast<size_t>(expert_unit_));
    for (int64_t e = 0; e < local_; ++e) {
      const size_t ei = static_cast<size_t>(e);
      const int64_t n = rows_of(e);
      if (n == 0) continue;
      const int32_t* rows = rows_.data<int32_t>() + offset(e);
      const int32_t* slots = slots_.data<int32_t>() + offset(e);
      Tensor g = gather(ex, dtokens, e);
      ops::moe_expert_output_grad<Real>(ex, g.data<Real>(), dweight.data<Real>(),
                                        out_[ei].data<Real>(), rows, slots, weights.data<Real>(), n,
                                        C, K);
      out_[ei] = Tensor();
      const Tensor dxe = experts_[ei]->backward(ctx, g);
      ops::moe_scatter_add<Real>(ex, dx.data<Real>(), dxe.data<Real>(), rows, slots, nullptr, n, C,
                                 K);
    }
    if (expert_unit_ >= 0) hook_after_backward(ctx, static_cast<size_t>(expert_unit_));
    if (group) {
      dx = exchange_->reduce_scatter(dx);
      dweight = exchange_->reduce_scatter(dweight);
    }
    ops::moe_router_backward<Real>(
        ex, dlogits.data<Real>(), probs_.data<Real>(), choice_.data<int32_t>(),
        weight_.data<Real>(), dweight.data<Real>(), balance.data<double>(), lse_.data<Real>(),
        static_cast<double>(losses_.router_z) * ctx.backward_scale / static_cast<double>(N), B, T,
        E, K);
    const Tensor drouter = router_.backward(ctx, dlogits);
    ops::add_inplace<Real>(ex, dx.data<Real>(), drouter.data<Real>(), N * C);
    if (shared_) {
      const Tensor dshared = shared_->backward(ctx, dy);
      ops::add_inplace<Real>(ex, dx.data<Real>(), dshared.data<Real>(), N * C);
    }
  });
  clear_routing();
  return dx.reshape(dy.shape());
}

void MoeMlp::clear_routing() {
  probs_ = choice_ = weight_ = lse_ = group_weight_ = rows_ = slots_ = offsets_ = counts_ =
      Tensor();
  for (Tensor& out : out_) out = Tensor();
}

void MoeMlp::drop_recomputable() {
  router_.drop_input();
  for (auto& expert : experts_) expert->drop_recomputable();
  if (shared_) shared_->drop_recomputable();
}

void MoeMlp::restore_input(const Tensor& x) {
  LOOM_CHECK(offsets_.defined());
  router_.restore_input(x);
  const Tensor tokens = expert_tokens_of(x);  // under expert parallelism a gather again
  for (int64_t e = 0; e < local_; ++e)
    if (rows_of(e) > 0) experts_[static_cast<size_t>(e)]->restore_input(gather(exec_, tokens, e));
  if (shared_) shared_->restore_input(x);
}

void MoeMlp::clear_cache() {
  router_.clear_cache();
  for (auto& expert : experts_) expert->clear_cache();
  if (shared_) shared_->clear_cache();
  clear_routing();
}

void MoeMlp::collect_cache(std::vector<Tensor*>& out) {
  router_.collect_cache(out);
  for (auto& expert : experts_) expert->collect_cache(out);
  if (shared_) shared_->collect_cache(out);
  for (Tensor* t :
       {&probs_, &choice_, &weight_, &lse_, &group_weight_, &rows_, &slots_, &offsets_, &counts_})
    out.push_back(t);
  for (Tensor& t : out_) out.push_back(&t);
}

}  // namespace loom
