#include "nn/moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "base/error.h"
#include "tensor/dispatch.h"

namespace loom {

namespace {

// Rows `rows` of x (N, C) into a new (n, C) tensor.
template <typename T>
Tensor gather_rows(const Tensor& x, const Tensor& rows, int64_t C) {
  const int64_t n = rows.numel();
  Tensor out = Tensor::empty({n, C}, x.dtype(), x.device());
  const int32_t* r = rows.data<int32_t>();
  const T* src = x.data<T>();
  T* dst = out.data<T>();
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * C, src + static_cast<int64_t>(r[i]) * C, sizeof(T) * C);
  return out;
}

}  // namespace

MoeMlp::MoeMlp(ParameterStore& store, const std::string& name, const MoeShape& shape,
               float aux_loss_coef, float init_std, float proj_std)
    : shape_(shape),
      aux_loss_coef_(aux_loss_coef),
      router_(store, name + ".router", shape.channels, shape.experts, false, init_std) {
  if (shape.experts < 1 || shape.top_k < 1 || shape.top_k > shape.experts)
    fail(name, ": top ", shape.top_k, " of ", shape.experts, " experts");
  for (int64_t e = 0; e < shape.experts; ++e)
    experts_.push_back(std::make_unique<SwiGluMlp>(store, name + ".experts." + std::to_string(e),
                                                   shape.channels, shape.hidden, init_std,
                                                   proj_std));
  rows_.resize(static_cast<size_t>(shape.experts));
  slots_.resize(rows_.size());
  out_.resize(rows_.size());
}

Tensor MoeMlp::forward(Context& ctx, const Tensor& x) {
  return run(ctx, x, nullptr);
}

Tensor MoeMlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return run(ctx, x, &residual);
}

Tensor MoeMlp::run(Context& ctx, const Tensor& x, const Tensor* residual) {
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  if (!ctx.device.is_cpu())
    fail(router_.weight()->name, ": a mixture of experts runs on CPU ranks only, not yet on ",
         "a GPU");
  if (x.dtype() != ctx.dtype || x.dim(-1) != C || x.shape().size() != 3)
    fail(router_.weight()->name, ": input must be (B, T, ", C, ") in ", dtype_name(ctx.dtype));
  const int64_t B = x.dim(0), N = x.numel() / C, T = N / B;
  const Tensor logits = router_.forward(ctx, x);  // (B, T, E)
  probs_ = Tensor::empty({N, E}, ctx.dtype, ctx.device);
  choice_ = Tensor::empty({N, K}, DType::kI32, ctx.device);
  weight_ = Tensor::empty({N, K}, ctx.dtype, ctx.device);
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(E)), slots(rows.size());
  std::vector<double> chosen_share(static_cast<size_t>(E)), prob_share(static_cast<size_t>(E));
  balance_loss_ = 0;
  Tensor y = residual ? residual->clone() : Tensor::zeros(x.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    const Real* l = logits.data<Real>();
    Real* p = probs_.data<Real>();
    int32_t* choice = choice_.data<int32_t>();
    Real* w = weight_.data<Real>();
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t b = 0; b < B; ++b) {
      std::fill(chosen_share.begin(), chosen_share.end(), 0.0);
      std::fill(prob_share.begin(), prob_share.end(), 0.0);
      for (int64_t t = b * T; t < (b + 1) * T; ++t) {
        // Softmax in double, stored in the compute type.
        const Real* lt = l + t * E;
        Real* pt = p + t * E;
        const double max = *std::max_element(lt, lt + E);
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(lt[e]) - max);
        for (int64_t e = 0; e < E; ++e) {
          pt[e] = static_cast<Real>(std::exp(static_cast<double>(lt[e]) - max) / sum);
          prob_share[static_cast<size_t>(e)] += static_cast<double>(pt[e]);
        }
        // The top k, best first; equal probabilities to the lower index.
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t c) {
          return pt[a] > pt[c] || (pt[a] == pt[c] && a < c);
        });
        double chosen = 0;
        for (int64_t j = 0; j < K; ++j)
          chosen += static_cast<double>(pt[order[static_cast<size_t>(j)]]);
        for (int64_t j = 0; j < K; ++j) {
          const int32_t e = order[static_cast<size_t>(j)];
          choice[t * K + j] = e;
          w[t * K + j] = static_cast<Real>(static_cast<double>(pt[e]) / chosen);
          rows[static_cast<size_t>(e)].push_back(static_cast<int32_t>(t));
          slots[static_cast<size_t>(e)].push_back(static_cast<int32_t>(j));
          chosen_share[static_cast<size_t>(e)] += 1;
        }
      }
      double loss = 0;  // Σ_e f_e · P_e of this sequence
      for (int64_t e = 0; e < E; ++e)
        loss += static_cast<double>(E) / static_cast<double>(K * T) *
                chosen_share[static_cast<size_t>(e)] * prob_share[static_cast<size_t>(e)] /
                static_cast<double>(T);
      balance_loss_ += loss / static_cast<double>(B);
    }
    // Each expert on its tokens; their outputs weighed into y, expert by expert (a fixed order).
    const Tensor flat = x.reshape({N, C});
    Real* out = y.data<Real>();
    expert_tokens_.assign(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e) {
      const size_t ei = static_cast<size_t>(e);
      const int64_t n = static_cast<int64_t>(rows[ei].size());
      expert_tokens_[ei] = n;
      rows_[ei] = slots_[ei] = out_[ei] = Tensor();
      if (n == 0) continue;  // an idle expert runs nothing; its gradient stays as it is
      rows_[ei] = Tensor::empty({n}, DType::kI32, ctx.device);
      slots_[ei] = Tensor::empty({n}, DType::kI32, ctx.device);
      std::memcpy(rows_[ei].data<int32_t>(), rows[ei].data(), sizeof(int32_t) * rows[ei].size());
      std::memcpy(slots_[ei].data<int32_t>(), slots[ei].data(), sizeof(int32_t) * rows[ei].size());
      out_[ei] = experts_[ei]->forward(ctx, gather_rows<Real>(flat, rows_[ei], C));
      const Real* oe = out_[ei].data<Real>();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = rows[ei][static_cast<size_t>(i)];
        const Real wt = w[t * K + slots[ei][static_cast<size_t>(i)]];
        Real* yt = out + t * C;
        for (int64_t c = 0; c < C; ++c) yt[c] += wt * oe[i * C + c];
      }
    }
  });
  return y;
}

Tensor MoeMlp::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(probs_.defined());
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  const int64_t B = dy.dim(0), N = dy.numel() / C, T = N / B;
  Tensor dx = Tensor::zeros({N, C}, ctx.dtype, ctx.device);
  Tensor dlogits = Tensor::empty({B, T, E}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    const Tensor dflat = dy.reshape({N, C});
    const Real* w = weight_.data<Real>();
    const Real* p = probs_.data<Real>();
    const int32_t* choice = choice_.data<int32_t>();
    // dweight[t, j]: the loss's gradient at token t's j-th expert weight, dy_t · out_e(t).
    std::vector<double> dweight(static_cast<size_t>(N * K));
    Real* dxp = dx.data<Real>();
    for (int64_t e = 0; e < E; ++e) {
      const size_t ei = static_cast<size_t>(e);
      if (!rows_[ei].defined()) continue;
      const int64_t n = rows_[ei].numel();
      const int32_t* rows = rows_[ei].data<int32_t>();
      const int32_t* slots = slots_[ei].data<int32_t>();
      Tensor g = gather_rows<Real>(dflat, rows_[ei], C);
      Real* gp = g.data<Real>();
      const Real* oe = out_[ei].data<Real>();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = int64_t{rows[i]} * K + slots[i];
        double dot = 0;
        for (int64_t c = 0; c < C; ++c)
          dot += static_cast<double>(gp[i * C + c]) * static_cast<double>(oe[i * C + c]);
        dweight[static_cast<size_t>(slot)] = dot;
        for (int64_t c = 0; c < C; ++c) gp[i * C + c] *= w[slot];
      }
      out_[ei] = Tensor();
      const Tensor dxe = experts_[ei]->backward(ctx, g);
      const Real* dxep = dxe.data<Real>();
      for (int64_t i = 0; i < n; ++i) {
        Real* dxt = dxp + int64_t{rows[i]} * C;
        for (int64_t c = 0; c < C; ++c) dxt[c] += dxep[i * C + c];
      }
    }
    // The router: through the renormalisation w_j = p_j / S (S = Σ over the chosen p), then
    // the balance loss's f_e / T per token at its scale, then the softmax.
    const double aux =
        static_cast<double>(aux_loss_coef_) * ctx.backward_scale / static_cast<double>(B * T);
    std::vector<double> dp(static_cast<size_t>(E)), f(static_cast<size_t>(E));
    Real* dl = dlogits.data<Real>();
    for (int64_t b = 0; b < B; ++b) {
      std::fill(f.begin(), f.end(), 0.0);
      for (int64_t t = b * T; t < (b + 1) * T; ++t)
        for (int64_t j = 0; j < K; ++j) f[static_cast<size_t>(choice[t * K + j])] += 1;
      for (double& fe : f) fe *= static_cast<double>(E) / static_cast<double>(K * T);
      for (int64_t t = b * T; t < (b + 1) * T; ++t) {
        const Real* pt = p + t * E;
        double chosen = 0, weighed = 0;
        for (int64_t j = 0; j < K; ++j) {
          chosen += static_cast<double>(pt[choice[t * K + j]]);
          weighed += static_cast<double>(w[t * K + j]) * dweight[static_cast<size_t>(t * K + j)];
        }
        for (int64_t e = 0; e < E; ++e)
          dp[static_cast<size_t>(e)] = aux * f[static_cast<size_t>(e)];
        for (int64_t j = 0; j < K; ++j)
          dp[static_cast<size_t>(choice[t * K + j])] +=
              (dweight[static_cast<size_t>(t * K + j)] - weighed) / chosen;
        double pdp = 0;
        for (int64_t e = 0; e < E; ++e)
          pdp += static_cast<double>(pt[e]) * dp[static_cast<size_t>(e)];
        for (int64_t e = 0; e < E; ++e)
          dl[t * E + e] =
              static_cast<Real>(static_cast<double>(pt[e]) * (dp[static_cast<size_t>(e)] - pdp));
      }
    }
    const Tensor drouter = router_.backward(ctx, dlogits);
    const Real* dr = drouter.data<Real>();
    for (int64_t i = 0; i < N * C; ++i) dxp[i] += dr[i];
  });
  probs_ = choice_ = weight_ = Tensor();
  for (size_t e = 0; e < rows_.size(); ++e) rows_[e] = slots_[e] = out_[e] = Tensor();
  return dx.reshape(dy.shape());
}

void MoeMlp::drop_recomputable() {
  router_.drop_input();
  for (auto& expert : experts_) expert->drop_recomputable();
}

void MoeMlp::restore_input(const Tensor& x) {
  router_.restore_input(x);
  const Tensor flat = x.reshape({x.numel() / shape_.channels, shape_.channels});
  for (size_t e = 0; e < experts_.size(); ++e) {
    if (!rows_[e].defined()) continue;
    dispatch_float(x.dtype(), [&](auto zero) {
      experts_[e]->restore_input(gather_rows<decltype(zero)>(flat, rows_[e], shape_.channels));
    });
  }
}

void MoeMlp::clear_cache() {
  router_.clear_cache();
  for (auto& expert : experts_) expert->clear_cache();
  probs_ = choice_ = weight_ = Tensor();
  for (size_t e = 0; e < rows_.size(); ++e) rows_[e] = slots_[e] = out_[e] = Tensor();
}

void MoeMlp::collect_cache(std::vector<Tensor*>& out) {
  router_.collect_cache(out);
  for (auto& expert : experts_) expert->collect_cache(out);
  out.push_back(&probs_);
  out.push_back(&choice_);
  out.push_back(&weight_);
  for (size_t e = 0; e < rows_.size(); ++e) {
    out.push_back(&rows_[e]);
    out.push_back(&slots_[e]);
    out.push_back(&out_[e]);
  }
}

}  // namespace loom
