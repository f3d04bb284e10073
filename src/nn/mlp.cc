#include "nn/mlp.h"

#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

Mlp::Mlp(ParameterStore& store, const std::string& name, int64_t channels, float init_std,
         float proj_std)
    : fc_(store, name + ".fc", channels, 4 * channels, true, init_std),
      proj_(store, name + ".proj", 4 * channels, channels, true, proj_std) {}

Tensor Mlp::gelu(Context& ctx) const {
  Tensor g = Tensor::empty(h_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::gelu_forward<T>(ctx.exec(), g.data<T>(), h_.data<T>(), h_.numel());
  });
  return g;
}

Tensor Mlp::gelu_for_proj(Context& ctx) const {
  const DType out = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (out == ctx.dtype) return gelu(ctx);
  // A GPU rounding GEMM inputs to 16 bits: the GELU writes proj's kept input directly.
  Tensor g = Tensor::empty(h_.shape(), out, ctx.device);
  ops::gelu_forward_rounded(ctx.exec(), g.raw(), out, h_.data<float>(), h_.numel());
  return g;
}

Tensor Mlp::forward(Context& ctx, const Tensor& x) {
  h_ = fc_.forward(ctx, x);
  return proj_.forward(ctx, gelu_for_proj(ctx));
}

Tensor Mlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  h_ = fc_.forward(ctx, x);
  return proj_.forward_adding(ctx, gelu_for_proj(ctx), residual);
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
