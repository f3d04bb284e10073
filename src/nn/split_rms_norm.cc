#include "nn/split_rms_norm.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

SplitRmsNorm::SplitRmsNorm(ParameterStore& store, const std::string& name, int64_t channels,
                           double eps, TensorSplit& split)
    : channels_(channels), local_(channels / split.ranks()), eps_(eps), split_(split) {
  if (channels % split.ranks() != 0)
    fail(name, ": ", channels, " channels do not split over ", split.ranks(), " ranks");
  weight_ =
      store.add_shard(name + ".weight", {local_}, {channels},
                      {{0, local_, Region{{channels}, {split.rank() * local_}}}}, InitKind::kOnes);
}

Tensor SplitRmsNorm::row_sums(Context& ctx, const Tensor& a, const Tensor& b, bool weighted) {
  const int64_t n = a.numel() / local_;
  Tensor sums = Tensor::empty({n}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::rmsnorm_partial_sums<T>(ctx.exec(), sums.data<T>(), a.data<T>(), b.data<T>(),
                                 weighted ? weight_->value.data<T>() : nullptr, n, local_);
  });
  split_.all_reduce(sums);
  return sums;
}

Tensor SplitRmsNorm::forward(Context& ctx, const Tensor& x) {
  if (x.dim(-1) != local_ || x.dtype() != ctx.dtype)
    fail(weight_->name, ": input ", shape_str(x.shape()), " is not rows of this rank's ", local_,
         " of ", channels_, " channels");
  const int64_t n = x.numel() / local_;
  const Tensor sums = row_sums(ctx, x, x, false);
  x_ = x;
  rstd_ = Tensor::empty({n}, ctx.dtype, ctx.device);
  Tensor y = Tensor::empty(x.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::rmsnorm_forward_of_sums<T>(ctx.exec(), y.data<T>(), rstd_.data<T>(), sums.data<T>(),
                                    x.data<T>(), weight_->value.data<T>(), n, local_, channels_,
                                    eps_);
  });
  return y;
}

Tensor SplitRmsNorm::recompute_output(Context& ctx) {
  LOOM_CHECK(x_.defined());
  const Tensor x = x_;
  return forward(ctx, x);
}

Tensor SplitRmsNorm::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(x_.defined());
  if (dy.numel() != x_.numel() || dy.dtype() != ctx.dtype)
    fail(weight_->name, ": gradient ", shape_str(dy.shape()), " is not the input's ",
         shape_str(x_.shape()));
  const int64_t n = x_.numel() / local_;
  const Tensor dots = row_sums(ctx, dy, x_, true);
  Tensor dx = Tensor::empty(x_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::rmsnorm_backward_of_dots<T>(ctx.exec(), dx.data<T>(), weight_->grad.data<T>(),
                                     dy.data<T>(), x_.data<T>(), weight_->value.data<T>(),
                                     rstd_.data<T>(), dots.data<T>(), n, local_, channels_);
  });
  clear_cache();
  return dx;
}

Tensor SplitRmsNorm::backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) {
  if (dresidual.numel() != x_.numel())
    fail(weight_->name, ": residual gradient has ", dresidual.numel(), " values, the input ",
         x_.numel());
  Tensor dx = backward(ctx, dy);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::add_inplace<T>(ctx.exec(), dx.data<T>(), dresidual.data<T>(), dx.numel());
  });
  return dx;
}

}  // namespace loom
