#include "nn/mlp.h"

#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

Mlp::Mlp(ParameterStore& store, const std::string& name, int64_t channels, float init_std,
         float proj_std)
    : fc_(store, name + ".fc", channels, 4 * channels, true, init_std),
      proj_(store, name + ".proj", 4 * channels, channels, true, proj_std) {}

Tensor Mlp::gelu(Context& ctx) const {
  if (h_.dtype() != ctx.dtype) {  // fc wrote it in 16 bits with the GELU (gelu_in_gemms)
    Tensor g = Tensor::empty(h_.shape(), h_.dtype(), ctx.device);
    ops::gelu_forward_of_rounded(ctx.exec(), g.raw(), h_.raw(), h_.dtype(), h_.numel());
    return g;
  }
  Tensor g = Tensor::empty(h_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::gelu_forward<T>(ctx.exec(), g.data<T>(), h_.data<T>(), h_.numel());
  });
  return g;
}

bool Mlp::gelu_in_gemms(Context& ctx) {
  return ops::matmul_input_dtype(ctx.exec(), ctx.dtype) != ctx.dtype;
}

Tensor Mlp::fc_and_gelu(Context& ctx, const Tensor& x) {
  if (gelu_in_gemms(ctx)) {
    Tensor g;
    h_ = fc_.forward_gelu(ctx, x, g);
    return g;
  }
  h_ = fc_.forward(ctx, x);
  return gelu(ctx);
}

Tensor Mlp::forward(Context& ctx, const Tensor& x) {
  return proj_.forward(ctx, fc_and_gelu(ctx, x));
}

Tensor Mlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return proj_.forward_adding(ctx, fc_and_gelu(ctx, x), residual);
}

void Mlp::drop_recomputable() {
  fc_.drop_input();
  proj_.drop_input();
}

Tensor Mlp::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(h_.defined());
  // No GELU output cached: drop_recomputable() dropped it. The state lives in the cache slots,
  // not in a flag, so it survives stash_activations() with several micro-batches in flight.
  if (!proj_.has_input()) proj_.restore_input(gelu(ctx));
  if (h_.dtype() != ctx.dtype) {  // the GELU in the GEMMs: its gradient in proj's dinp GEMM
    Tensor dh = proj_.backward_into_gelu(ctx, dy, h_);
    h_ = Tensor();
    return fc_.backward(ctx, dh);
  }
  Tensor dg = proj_.backward(ctx, dy);
  // The GELU's backward is part of fc's: one pass over dg and h instead of three on a GPU.
  Tensor dx = fc_.backward_before_gelu(ctx, dg, h_);
  h_ = Tensor();
  return dx;
}

void Mlp::clear_cache() {
  fc_.clear_cache();
  proj_.clear_cache();
  h_ = Tensor();
}

}  // namespace loom
