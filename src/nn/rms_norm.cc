#include "nn/rms_norm.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/layer_norm.h"
#include "tensor/dispatch.h"

namespace loom {

std::unique_ptr<Norm> make_norm(ParameterStore& store, const std::string& name, int64_t channels,
                                bool rms, double eps) {
  if (rms) return std::make_unique<RmsNorm>(store, name, channels, eps);
  return std::make_unique<LayerNorm>(store, name, channels);
}

RmsNorm::RmsNorm(ParameterStore& store, const std::string& name, int64_t channels, double eps)
    : channels_(channels), eps_(eps) {
  weight_ = store.add(name + ".weight", {channels}, InitKind::kOnes);
}

int64_t RmsNorm::cache_input(Context& ctx, const Tensor& x) {
  if (x.dim(-1) != channels_) fail(weight_->name, ": input last dim ", x.dim(-1), " != ", channels_);
  const int64_t n = x.numel() / channels_;
  x_ = x;
  rstd_ = Tensor::empty({n}, ctx.dtype, ctx.device);
  return n;
}

Tensor RmsNorm::forward_for_matmul(Context& ctx, const Tensor& x) {
  const DType out = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (out == ctx.dtype) return forward(ctx, x);
  const int64_t n = cache_input(ctx, x);
  Tensor y = Tensor::empty(x.shape(), out, ctx.device);
  ops::rmsnorm_forward_rounded(ctx.exec(), y.raw(), out, rstd_.data<float>(), x.data<float>(),
                               weight_->value.data<float>(), n, channels_, eps_);
  return y;
}

Tensor RmsNorm::forward(Context& ctx, const Tensor& x) {
  const int64_t n = cache_input(ctx, x);
  Tensor y = Tensor::empty(x.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::rmsnorm_forward<T>(ctx.exec(), y.data<T>(), rstd_.data<T>(), x.data<T>(),
                            weight_->value.data<T>(), n, channels_, eps_);
  });
  return y;
}

Tensor RmsNorm::recompute_output(Context& ctx) {
  LOOM_CHECK(x_.defined());
  const Tensor x = x_;  // forward() re-caches it and writes the same rstd
  return forward(ctx, x);
}

Tensor RmsNorm::backward(Context& ctx, const Tensor& dy) { return backward_impl(ctx, dy, nullptr); }

Tensor RmsNorm::backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) {
  LOOM_CHECK(x_.defined());
  if (dresidual.numel() != x_.numel())
    fail(weight_->name, ": residual gradient has ", dresidual.numel(), " values, the input ",
         x_.numel());
  return backward_impl(ctx, dy, &dresidual);
}

Tensor RmsNorm::backward_impl(Context& ctx, const Tensor& dy, const Tensor* dresidual) {
  LOOM_CHECK(x_.defined());
  const int64_t n = x_.numel() / channels_;
  Tensor dx = Tensor::empty(x_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    if (dresidual != nullptr)
      ops::rmsnorm_backward_adding<T>(ctx.exec(), dx.data<T>(), weight_->grad.data<T>(),
                                      dy.data<T>(), x_.data<T>(), weight_->value.data<T>(),
                                      rstd_.data<T>(), dresidual->data<T>(), n, channels_);
    else
      ops::rmsnorm_backward<T>(ctx.exec(), dx.data<T>(), weight_->grad.data<T>(), dy.data<T>(),
                               x_.data<T>(), weight_->value.data<T>(), rstd_.data<T>(), n,
                               channels_);
  });
  clear_cache();
  return dx;
}

}  // namespace loom
