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
               const MoeLosses& losses, float init_std, float proj_std)
    : shape_(shape),
      losses_(losses),
      router_(store, name + ".router", shape.channels, shape.experts, false, init_std) {
  if (shape.experts < 1 || shape.top_k < 1 || shape.top_k > shape.experts)
    fail(name, ": top ", shape.top_k, " of ", shape.experts, " experts");
  for (int64_t e = 0; e < shape.experts; ++e)
    experts_.push_back(std::make_unique<SwiGluMlp>(store, name + ".experts." + std::to_string(e),
                                                   shape.channels, shape.hidden, init_std,
                                                   proj_std));
  if (shape.shared > 0)
    shared_ = std::make_unique<SwiGluMlp>(store, name + ".shared", shape.channels,
                                          shape.shared * shape.hidden, init_std, proj_std);
  out_.resize(static_cast<size_t>(shape.experts));
}

Tensor MoeMlp::forward(Context& ctx, const Tensor& x) {
  return run(ctx, x, nullptr);
}

Tensor MoeMlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return run(ctx, x, &residual);
}

Tensor MoeMlp::gather(const Exec& ex, const Tensor& x, int64_t e) const {
  const int64_t C = shape_.channels, n = rows_of(e);
  Tensor out = Tensor::empty({n, C}, x.dtype(), x.device());
  ops::gather_rows(ex, out.raw(), x.raw(), rows_.data<int32_t>() + offset(e), n,
                   C * static_cast<int64_t>(dtype_size(x.dtype())));
  return out;
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
  // The choices on the host (from a GPU: the block's one wait), laid out expert by expert.
  const Tensor choice = ctx.device.is_cpu() ? choice_ : choice_.to(Device::cpu());
  if (!ctx.device.is_cpu()) sums = sums.to(Device::cpu());
  const int32_t* chosen = choice.data<int32_t>();
  offsets_ = Tensor::zeros({E + 1}, DType::kI32);
  counts_ = Tensor::zeros({B, E}, DType::kI32);
  int32_t* off = offsets_.data<int32_t>();
  int32_t* counts = counts_.data<int32_t>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < K; ++j) {
      ++off[chosen[t * K + j] + 1];
      ++counts[(t / T) * E + chosen[t * K + j]];
    }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  Tensor rows = Tensor::empty({N * K}, DType::kI32), slots = Tensor::empty({N * K}, DType::kI32);
  std::vector<int32_t> next(off, off + E);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int32_t place = next[static_cast<size_t>(chosen[t * K + j])]++;
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
  // Each expert on its tokens; their outputs weighed into y, expert by expert (a fixed order).
  Tensor y = residual ? residual->clone() : Tensor::zeros(x.shape(), ctx.dtype, ctx.device);
  for (int64_t e = 0; e < E; ++e) {
    const size_t ei = static_cast<size_t>(e);
    const int64_t n = rows_of(e);
    expert_tokens_[ei] = n;
    out_[ei] = Tensor();
    if (n == 0) continue;  // an idle expert runs nothing; its gradient stays as it is
    out_[ei] = experts_[ei]->forward(ctx, gather(ex, x, e));
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      ops::moe_scatter_add<Real>(ex, y.data<Real>(), out_[ei].data<Real>(),
                                 rows_.data<int32_t>() + offset(e),
                                 slots_.data<int32_t>() + offset(e), weight_.data<Real>(), n, C, K);
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
  Tensor dx = Tensor::zeros({N, C}, ctx.dtype, ctx.device);
  Tensor dweight = Tensor::empty({N, K}, ctx.dtype, ctx.device);  // every slot an expert's
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
    for (int64_t e = 0; e < E; ++e) {
      const size_t ei = static_cast<size_t>(e);
      const int64_t n = rows_of(e);
      if (n == 0) continue;
      const int32_t* rows = rows_.data<int32_t>() + offset(e);
      const int32_t* slots = slots_.data<int32_t>() + offset(e);
      Tensor g = gather(ex, dy, e);
      ops::moe_expert_output_grad<Real>(ex, g.data<Real>(), dweight.data<Real>(),
                                        out_[ei].data<Real>(), rows, slots, weight_.data<Real>(), n,
                                        C, K);
      out_[ei] = Tensor();
      const Tensor dxe = experts_[ei]->backward(ctx, g);
      ops::moe_scatter_add<Real>(ex, dx.data<Real>(), dxe.data<Real>(), rows, slots, nullptr, n, C,
                                 K);
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
  probs_ = choice_ = weight_ = lse_ = rows_ = slots_ = offsets_ = counts_ = Tensor();
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
  for (int64_t e = 0; e < shape_.experts; ++e)
    if (rows_of(e) > 0) experts_[static_cast<size_t>(e)]->restore_input(gather(exec_, x, e));
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
  for (Tensor* t : {&probs_, &choice_, &weight_, &lse_, &rows_, &slots_, &offsets_, &counts_})
    out.push_back(t);
  for (Tensor& t : out_) out.push_back(&t);
}

}  // namespace loom
