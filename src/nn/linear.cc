#include "nn/linear.h"

#include "kernels/ops.h"
#include "nn/deferred_weight_grads.h"
#include "nn/rounded_weights.h"
#include "tensor/dispatch.h"

namespace loom {

namespace {
Shape with_last(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}
}  // namespace

Linear::Linear(ParameterStore& store, const std::string& name, int64_t in, int64_t out, bool bias,
               float init_std)
    : in_(in), out_(out) {
  weight_ = store.add(name + ".weight", {out, in}, InitKind::kNormal, init_std);
  weight_->gemm_operand = true;
  if (bias) bias_ = store.add(name + ".bias", {out}, InitKind::kZeros);
}

Linear::Linear(Parameter* weight, Parameter* bias)
    : in_(weight->shape.at(1)), out_(weight->shape.at(0)), weight_(weight), bias_(bias) {
  LOOM_CHECK(weight->shape.size() == 2 && (bias == nullptr || bias->numel() == out_));
  weight_->gemm_operand = true;
}

Tensor Linear::forward(Context& ctx, const Tensor& x) {
  return forward_impl(ctx, x, nullptr);
}

Tensor Linear::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  if (residual.numel() != x.numel() / in_ * out_)
    fail(weight_->name, ": residual has ", residual.numel(), " values, the output ",
         x.numel() / in_ * out_);
  return forward_impl(ctx, x, &residual);
}

Tensor Linear::forward_impl(Context& ctx, const Tensor& x, const Tensor* residual) {
  if (x.dim(-1) != in_) fail(weight_->name, ": input last dim ", x.dim(-1), " != ", in_);
  Tensor y = Tensor::empty(with_last(x.shape(), out_), ctx.dtype, ctx.device);
  const int64_t n = x.numel() / in_;
  const auto residual_f32 = [&] { return residual ? residual->data<float>() : nullptr; };
  if (x.dtype() != ctx.dtype) {  // rounded by its producer (LayerNorm, GELU) already
    x_ = x;
    ops::matmul_forward_from_rounded_input(
        ctx.exec(), y.data<float>(), x.raw(), x.dtype(), gemm_weight(ctx, *weight_),
        bias_ ? bias_->value.data<float>() : nullptr, n, in_, out_, residual_f32());
    return y;
  }
  if (const DType kept = ops::matmul_input_dtype(ctx.exec(), ctx.dtype); kept != ctx.dtype) {
    // A GPU rounding GEMM inputs to 16 bits: keep the input as the GEMMs read it (ops.h).
    x_ = Tensor::empty(x.shape(), kept, ctx.device);
    ops::matmul_forward_keeping_rounded_input(
        ctx.exec(), y.data<float>(), x_.raw(), x.data<float>(), gemm_weight(ctx, *weight_),
        bias_ ? bias_->value.data<float>() : nullptr, n, in_, out_, residual_f32());
    return y;
  }
  x_ = x;
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::linear_forward<T>(ctx.exec(), y.data<T>(), x.data<T>(), weight_->value.data<T>(),
                           bias_ ? bias_->value.data<T>() : nullptr,
                           residual ? residual->data<T>() : nullptr, n, in_, out_);
  });
  return y;
}

DType Linear::keep_input_for_sixteen_bit_output(Context& ctx, const Tensor& x, const char* what) {
  if (x.dim(-1) != in_) fail(weight_->name, ": input last dim ", x.dim(-1), " != ", in_);
  const DType out_dtype = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (out_dtype == ctx.dtype)
    fail(weight_->name, ": ", what, " needs a GPU at bf16 / fp16 matmul precision");
  // Rounded by its producer (LayerNorm) already, or f32, rounded by the op into this buffer.
  x_ = x.dtype() != ctx.dtype ? x : Tensor::empty(x.shape(), out_dtype, ctx.device);
  return out_dtype;
}

Tensor Linear::forward_rounded_output(Context& ctx, const Tensor& x) {
  const DType out_dtype = keep_input_for_sixteen_bit_output(ctx, x, "a 16-bit output");
  Tensor y = Tensor::empty(with_last(x.shape(), out_), out_dtype, ctx.device);
  ops::matmul_forward_rounded_output(
      ctx.exec(), y.raw(), out_dtype, x.raw(), x.dtype(), x_.raw(), gemm_weight(ctx, *weight_),
      bias_ ? bias_->value.data<float>() : nullptr, x.numel() / in_, in_, out_);
  return y;
}

Tensor Linear::forward_gelu(Context& ctx, const Tensor& x, Tensor& gelu_out) {
  const DType out_dtype = keep_input_for_sixteen_bit_output(ctx, x, "a GELU in the GEMM");
  Tensor pre = Tensor::empty(with_last(x.shape(), out_), out_dtype, ctx.device);
  gelu_out = Tensor::empty(pre.shape(), out_dtype, ctx.device);
  ops::matmul_forward_gelu(ctx.exec(), gelu_out.raw(), pre.raw(), out_dtype, x.raw(), x.dtype(),
                           x_.raw(), gemm_weight(ctx, *weight_),
                           bias_ ? bias_->value.data<float>() : nullptr, x.numel() / in_, in_,
                           out_);
  return pre;
}

void Linear::restore_input(const Tensor& x) {
  if (x.dim(-1) != in_) fail(weight_->name, ": restored input last dim ", x.dim(-1), " != ", in_);
  x_ = x;
}

Tensor Linear::backward(Context& ctx, const Tensor& dy) {
  return backward_impl(ctx, dy, nullptr);
}

Tensor Linear::backward_before_gelu(Context& ctx, Tensor& dgelu, const Tensor& h) {
  if (h.numel() != dgelu.numel())
    fail(weight_->name, ": GELU input has ", h.numel(), " values, its gradient ", dgelu.numel());
  return backward_impl(ctx, dgelu, &h);
}

Tensor Linear::backward_rounded_dinp(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(x_.defined());
  const DType dx_dtype = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (dx_dtype == ctx.dtype || dy.dtype() != ctx.dtype)
    fail(weight_->name, ": a 16-bit input gradient needs bf16 / fp16 GEMMs on a GPU and an ",
         dtype_name(ctx.dtype), " output gradient");
  Tensor dx = Tensor::empty(x_.shape(), dx_dtype, ctx.device);
  input_grad_now_weight_grads_at_w(
      ctx.deferred_weight_grads, ctx.exec(), dx.raw(),
      [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = x_, dx_dtype,
       n = x_.numel() / in_, in = in_, out = out_](const Exec& ex, void* dinp, bool weights) {
        ops::matmul_backward_rounded_dinp(ex, dinp, dx_dtype,
                                          weights ? w->grad.data<float>() : nullptr,
                                          weights && b ? b->grad.data<float>() : nullptr,
                                          dy.data<float>(), x.raw(), x.dtype(), wop, n, in, out);
      },
      static_cast<int64_t>(dy.nbytes() + x_.nbytes()));
  x_ = Tensor();
  return dx;
}

Tensor Linear::backward_into_gelu(Context& ctx, const Tensor& dy, const Tensor& pre) {
  LOOM_CHECK(x_.defined());
  if (pre.numel() != x_.numel() || pre.dtype() != x_.dtype() || dy.dtype() != ctx.dtype)
    fail(weight_->name, ": backward into a GELU takes an ", dtype_name(ctx.dtype),
         " output gradient and the GELU's input in the type this layer's input was kept in (",
         dtype_name(x_.dtype()), ", ", x_.numel(), " values), not ", dtype_name(dy.dtype()),
         " and ", dtype_name(pre.dtype()), " (", pre.numel(), " values)");
  Tensor dpre = Tensor::empty(x_.shape(), x_.dtype(), ctx.device);
  // pre by its address: only the input half (now) reads it.
  input_grad_now_weight_grads_at_w(
      ctx.deferred_weight_grads, ctx.exec(), dpre.raw(),
      [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = x_, pre = pre.raw(),
       n = x_.numel() / in_, in = in_, out = out_](const Exec& ex, void* dinp, bool weights) {
        ops::matmul_backward_into_gelu(
            ex, dinp, x.dtype(), weights ? w->grad.data<float>() : nullptr,
            weights && b ? b->grad.data<float>() : nullptr, dy.data<float>(), x.raw(), wop,
            dinp != nullptr ? pre : nullptr, n, in, out);
      },
      static_cast<int64_t>(dy.nbytes() + x_.nbytes()));
  x_ = Tensor();
  return dpre;
}

Tensor Linear::backward_impl(Context& ctx, const Tensor& dy, const Tensor* gelu_input) {
  LOOM_CHECK(x_.defined());
  Tensor dx = Tensor::empty(x_.shape(), ctx.dtype, ctx.device);
  const int64_t n = x_.numel() / in_;
  if (dy.dtype() != ctx.dtype) {  // rounded by its producer (attention, backward_into_gelu)
    // The input as forward kept it (16-bit), or as a recomputation restored it (ctx.dtype).
    if ((x_.dtype() != dy.dtype() && x_.dtype() != ctx.dtype) || gelu_input != nullptr)
      fail(weight_->name, ": a ", dtype_name(dy.dtype()),
           " output gradient needs an input kept in ", dtype_name(dy.dtype()), " or ",
           dtype_name(ctx.dtype), ", not ", dtype_name(x_.dtype()));
    input_grad_now_weight_grads_at_w(
        ctx.deferred_weight_grads, ctx.exec(), dx.raw(),
        [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = x_, n, in = in_,
         out = out_](const Exec& ex, void* dinp, bool weights) {
          ops::matmul_backward_from_rounded(
              ex, static_cast<float*>(dinp), weights ? w->grad.data<float>() : nullptr,
              weights && b ? b->grad.data<float>() : nullptr, dy.raw(), dy.dtype(), x.raw(),
              x.dtype(), wop, n, in, out);
        },
        static_cast<int64_t>(dy.nbytes() + x_.nbytes()));
  } else if (x_.dtype() != ctx.dtype) {  // kept rounded by forward (an f32 model on a GPU)
    // There the MLP's GELU runs in the GEMMs instead (forward_gelu, backward_into_gelu).
    if (gelu_input != nullptr)
      fail(weight_->name, ": backward_before_gelu on an input kept in ", dtype_name(x_.dtype()),
           ": with 16-bit GEMM inputs the GELU goes through forward_gelu and backward_into_gelu");
    input_grad_now_weight_grads_at_w(
        ctx.deferred_weight_grads, ctx.exec(), dx.raw(),
        [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = x_, n, in = in_,
         out = out_](const Exec& ex, void* dinp, bool weights) {
          ops::matmul_backward_from_rounded_input(
              ex, static_cast<float*>(dinp), weights ? w->grad.data<float>() : nullptr,
              weights && b ? b->grad.data<float>() : nullptr, dy.data<float>(), x.raw(), x.dtype(),
              wop, n, in, out);
        },
        static_cast<int64_t>(dy.nbytes() + x_.nbytes()));
  } else {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T = decltype(zero);
      // backward_before_gelu's dgelu is overwritten; a plain dy is only read.
      const T* gelu = gelu_input ? gelu_input->data<T>() : nullptr;
      if (ctx.deferred_weight_grads != nullptr) {  // B of a zero-bubble schedule: dW later
        ops::linear_backward_input<T>(ctx.exec(), dx.data<T>(), dy.data<T>(), gelu,
                                      weight_->value.data<T>(), n, in_, out_);
        defer_weight_grad<T>(*ctx.deferred_weight_grads, weight_, bias_, dy, x_, n, in_, out_);
        return;
      }
      ops::linear_backward<T>(ctx.exec(), dx.data<T>(), weight_->grad.data<T>(),
                              bias_ ? bias_->grad.data<T>() : nullptr, dy.data<T>(), gelu,
                              x_.data<T>(), weight_->value.data<T>(), n, in_, out_);
    });
  }
  x_ = Tensor();
  return dx;
}

}  // namespace loom
