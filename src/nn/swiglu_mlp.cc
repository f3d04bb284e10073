#include "nn/swiglu_mlp.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

SwiGluMlp::SwiGluMlp(ParameterStore& store, const std::string& name, int64_t channels,
                     int64_t hidden, float init_std, float proj_std)
    : hidden_(hidden),
      fc_(store, name + ".fc", channels, 2 * hidden, false, init_std),
      proj_(store, name + ".proj", hidden, channels, false, proj_std) {}

Tensor SwiGluMlp::swiglu(Context& ctx) const {
  LOOM_CHECK(h_.defined());
  Shape shape = h_.shape();
  shape.back() = hidden_;
  Tensor a = Tensor::empty(shape, h_.dtype(), ctx.device);
  if (h_.dtype() != ctx.dtype) {  // fc wrote h_ in 16 bits (project_up)
    ops::swiglu_forward_rounded(ctx.exec(), a.raw(), h_.raw(), h_.dtype(),
                                h_.numel() / (2 * hidden_), hidden_);
    return a;
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::swiglu_forward<T>(ctx.exec(), a.data<T>(), h_.data<T>(), h_.numel() / (2 * hidden_),
                           hidden_);
  });
  return a;
}

Tensor SwiGluMlp::project_up(Context& ctx, const Tensor& x) {
  const bool sixteen_bit = ops::matmul_input_dtype(ctx.exec(), ctx.dtype) != ctx.dtype;
  h_ = sixteen_bit ? fc_.forward_rounded_output(ctx, x) : fc_.forward(ctx, x);
  return swiglu(ctx);
}

Tensor SwiGluMlp::forward(Context& ctx, const Tensor& x) {
  return proj_.forward(ctx, project_up(ctx, x));
}

Tensor SwiGluMlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return proj_.forward_adding(ctx, project_up(ctx, x), residual);
}

void SwiGluMlp::drop_recomputable() {
  fc_.drop_input();
  proj_.drop_input();
}

Tensor SwiGluMlp::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(h_.defined());
  // No SwiGLU output cached: drop_recomputable() dropped it (the state lives in the cache slots,
  // so it survives stash_activations()).
  if (!proj_.has_input()) proj_.restore_input(swiglu(ctx));
  if (h_.dtype() != ctx.dtype) {  // 16-bit activations: proj writes da so, fc reads dh so
    Tensor da = proj_.backward_rounded_dinp(ctx, dy);
    Tensor dh = Tensor::empty(h_.shape(), h_.dtype(), ctx.device);
    ops::swiglu_backward_rounded(ctx.exec(), dh.raw(), da.raw(), h_.raw(), h_.dtype(),
                                 h_.numel() / (2 * hidden_), hidden_);
    h_ = Tensor();
    return fc_.backward(ctx, dh);
  }
  Tensor da = proj_.backward(ctx, dy);
  Tensor dh = Tensor::empty(h_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::swiglu_backward<T>(ctx.exec(), dh.data<T>(), da.data<T>(), h_.data<T>(),
                            h_.numel() / (2 * hidden_), hidden_);
  });
  h_ = Tensor();
  return fc_.backward(ctx, dh);
}

void SwiGluMlp::clear_cache() {
  fc_.clear_cache();
  proj_.clear_cache();
  h_ = Tensor();
}

}  // namespace loom
