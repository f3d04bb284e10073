#include "nn/swiglu_mlp.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

namespace {
int64_t sliced(const std::string& name, int64_t hidden, const HiddenSlice& slice) {
  if (slice.ranks < 1 || slice.rank < 0 || slice.rank >= slice.ranks || hidden % slice.ranks != 0)
    fail(name, ": a hidden width of ", hidden, " does not split over ", slice.ranks,
         " tensor-parallel ranks (parallel.tp)");
  return hidden / slice.ranks;
}
// fc (2H × C: the gate's H rows, then the up projection's): the slice's rows of each.
Linear sliced_fc(ParameterStore& store, const std::string& name, int64_t C, int64_t H,
                 float init_std, const HiddenSlice& s) {
  if (s.ranks == 1) return Linear(store, name, C, 2 * H, false, init_std);
  const int64_t h = H / s.ranks, first = s.rank * h;
  return Linear(store.add_shard(name + ".weight", {2 * h, C}, {2 * H, C},
                                {{0, h, Region{{2 * H, C}, {first, 0}}},
                                 {h, h, Region{{2 * H, C}, {H + first, 0}}}},
                                InitKind::kNormal, init_std),
                nullptr);
}
// proj (C × H): the slice's columns.
Linear sliced_proj(ParameterStore& store, const std::string& name, int64_t C, int64_t H,
                   float proj_std, const HiddenSlice& s) {
  if (s.ranks == 1) return Linear(store, name, H, C, false, proj_std);
  const int64_t h = H / s.ranks;
  return Linear(
      store.add_shard(name + ".weight", {C, h}, {C, H}, {{0, C, Region{{C, H}, {0, s.rank * h}}}},
                      InitKind::kNormal, proj_std),
      nullptr);
}
}  // namespace

SwiGluMlp::SwiGluMlp(ParameterStore& store, const std::string& name, int64_t channels,
                     int64_t hidden, float init_std, float proj_std, HiddenSlice slice,
                     GatedActivation act)
    : act_(act),
      hidden_(sliced(name, hidden, slice)),
      fc_(sliced_fc(store, name + ".fc", channels, hidden, init_std, slice)),
      proj_(sliced_proj(store, name + ".proj", channels, hidden, proj_std, slice)) {}

Tensor SwiGluMlp::swiglu(Context& ctx) const {
  LOOM_CHECK(h_.defined());
  Shape shape = h_.shape();
  shape.back() = hidden_;
  Tensor a = Tensor::empty(shape, h_.dtype(), ctx.device);
  if (h_.dtype() != ctx.dtype) {  // fc wrote h_ in 16 bits (project_up)
    ops::swiglu_forward_rounded(ctx.exec(), a.raw(), h_.raw(), h_.dtype(),
                                h_.numel() / (2 * hidden_), hidden_, act_);
    return a;
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::swiglu_forward<T>(ctx.exec(), a.data<T>(), h_.data<T>(), h_.numel() / (2 * hidden_),
                           hidden_, act_);
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
                                 h_.numel() / (2 * hidden_), hidden_, act_);
    h_ = Tensor();
    return fc_.backward(ctx, dh);
  }
  Tensor da = proj_.backward(ctx, dy);
  Tensor dh = Tensor::empty(h_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::swiglu_backward<T>(ctx.exec(), dh.data<T>(), da.data<T>(), h_.data<T>(),
                            h_.numel() / (2 * hidden_), hidden_, act_);
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
