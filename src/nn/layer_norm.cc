#include "nn/layer_norm.h"

#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

LayerNorm::LayerNorm(ParameterStore& store, const std::string& name, int64_t channels)
    : channels_(channels) {
  weight_ = store.add(name + ".weight", {channels}, InitKind::kOnes);
  bias_ = store.add(name + ".bias", {channels}, InitKind::kZeros);
}

int64_t LayerNorm::cache_input(Context& ctx, const Tensor& x) {
  if (x.dim(-1) != channels_)
    fail(weight_->name, ": input last dim ", x.dim(-1), " != ", channels_);
  const int64_t n = x.numel() / channels_;
  x_ = x;
  mean_ = Tensor::empty({n}, ctx.dtype, ctx.device);
  rstd_ = Tensor::empty({n}, ctx.dtype, ctx.device);
  return n;
}

Tensor LayerNorm::forward_for_matmul(Context& ctx, const Tensor& x) {
  const DType out = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (out == ctx.dtype) return forward(ctx, x);
  const int64_t n = cache_input(ctx, x);
  Tensor y = Tensor::empty(x.shape(), out, ctx.device);
  ops::layernorm_forward_rounded(ctx.exec(), y.raw(), out, mean_.data<float>(), rstd_.data<float>(),
                                 x.data<float>(), weight_->value.data<float>(),
                                 bias_->value.data<float>(), n, channels_);
  return y;
}

Tensor LayerNorm::forward(Context& ctx, const Tensor& x) {
  const int64_t n = cache_input(ctx, x);
  Tensor y = Tensor::empty(x.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::layernorm_forward<T>(ctx.exec(), y.data<T>(), mean_.data<T>(), rstd_.data<T>(),
                              x.data<T>(), weight_->value.data<T>(), bias_->value.data<T>(), n,
                              channels_);
  });
  return y;
}

Tensor LayerNorm::recompute_output(Context& ctx) {
  LOOM_CHECK(x_.defined());
  const Tensor x = x_;  // forward() re-caches it, and writes the same mean and rstd
  return forward(ctx, x);
}

Tensor LayerNorm::backward(Context& ctx, const Tensor& dy) {
  return backward_impl(ctx, dy, nullptr);
}

Tensor LayerNorm::backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) {
  LOOM_CHECK(x_.defined());
  if (dresidual.numel() != x_.numel())
    fail(weight_->name, ": residual gradient has ", dresidual.numel(), " values, the input ",
         x_.numel());
  return backward_impl(ctx, dy, &dresidual);
}

Tensor LayerNorm::backward_impl(Context& ctx, const Tensor& dy, const Tensor* dresidual) {
  LOOM_CHECK(x_.defined());
  const int64_t n = x_.numel() / channels_;
  Tensor dx = Tensor::empty(x_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    if (dresidual != nullptr)
      ops::layernorm_backward_adding<T>(ctx.exec(), dx.data<T>(), weight_->grad.data<T>(),
                                        bias_->grad.data<T>(), dy.data<T>(), x_.data<T>(),
                                        weight_->value.data<T>(), mean_.data<T>(), rstd_.data<T>(),
                                        dresidual->data<T>(), n, channels_);
    else
      ops::layernorm_backward<T>(
          ctx.exec(), dx.data<T>(), weight_->grad.data<T>(), bias_->grad.data<T>(), dy.data<T>(),
          x_.data<T>(), weight_->value.data<T>(), mean_.data<T>(), rstd_.data<T>(), n, channels_);
  });
  clear_cache();
  return dx;
}

}  // namespace loom
