// Tensor-parallel linear layers: see tensor_parallel_linear.h.
#include "parallel/tensor_parallel_linear.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/deferred_weight_grads.h"
#include "nn/rounded_weights.h"
#include "parallel/tp_backward_overlap.h"

namespace loom {
namespace {
void check_2d(const Tensor& x, int64_t cols, const std::string& who) {
  if (x.ndim() != 2 || x.dim(1) != cols)
    fail(who, ": input ", shape_str(x.shape()), " is not (rows, ", cols, ")");
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(ParameterStore& store, const std::string& name,
                                           int64_t in, int64_t out, Communicator& tp, bool bias,
                                           float init_std, bool sequence_parallel,
                                           std::vector<int64_t> out_blocks)
    : in_(in), tp_(tp), sequence_parallel_(sequence_parallel) {
  const int64_t P = tp.size(), r = tp.rank();
  if (out_blocks.empty()) out_blocks = {out};
  std::vector<ShardPiece> weight_pieces, bias_pieces;
  int64_t global_row = 0, local_row = 0;
  for (int64_t block : out_blocks) {
    if (block % P != 0)
      fail(name, ": ", block, " output features do not split over ", P, " tensor-parallel ranks");
    const int64_t rows = block / P;
    weight_pieces.push_back({local_row, rows, Region{{out, in}, {global_row + r * rows, 0}}});
    bias_pieces.push_back({local_row, rows, Region{{out}, {global_row + r * rows}}});
    global_row += block;
    local_row += rows;
  }
  if (global_row != out) fail(name, ": fused blocks sum to ", global_row, ", not ", out);
  local_out_ = local_row;
  weight_ = store.add_shard(name + ".weight", {local_out_, in}, {out, in}, weight_pieces,
                            InitKind::kNormal, init_std);
  weight_->gemm_operand = true;
  if (bias)
    bias_ = store.add_shard(name + ".bias", {local_out_}, {out}, bias_pieces, InitKind::kZeros);
}

Tensor ColumnParallelLinear::whole_input(const Tensor& x) {
  check_2d(x, in_, weight_->name);
  if (!sequence_parallel_) return x;
  Tensor all = Tensor::empty({x.dim(0) * tp_.size(), in_}, x.dtype(), x.device());
  tp_.all_gather_async(x, all)->wait_on_device();
  return all;
}

void ColumnParallelLinear::restore_input(const Tensor& x) {
  check_2d(x, in_, weight_->name);
  x_ = x;
}

Tensor ColumnParallelLinear::forward(Context& ctx, const Tensor& x) {
  const Tensor whole = whole_input(x);
  x_ = x;  // under sequence parallelism this rank's rows: backward gathers them again
  const int64_t n = whole.dim(0);
  Tensor y = Tensor::empty({n, local_out_}, DType::kF32, ctx.device);
  if (whole.dtype() != DType::kF32) {  // rounded by its producer (a norm's forward_for_matmul)
    ops::matmul_forward_from_rounded_input(
        ctx.exec(), y.data<float>(), whole.raw(), whole.dtype(), gemm_weight(ctx, *weight_),
        bias_ ? bias_->value.data<float>() : nullptr, n, in_, local_out_);
    return y;
  }
  ops::linear_forward<float>(
      ctx.exec(), y.data<float>(), whole.data<float>(), weight_->value.data<float>(),
      bias_ ? bias_->value.data<float>() : nullptr, nullptr, n, in_, local_out_);
  return y;
}

Tensor ColumnParallelLinear::keep_input_for_sixteen_bit_output(Context& ctx, const Tensor& x,
                                                               const char* what,
                                                               DType& out_dtype) {
  out_dtype = ops::matmul_input_dtype(ctx.exec(), DType::kF32);
  if (out_dtype == DType::kF32)
    fail(weight_->name, ": ", what, " needs a GPU at bf16 / fp16 matmul precision");
  check_2d(x, in_, weight_->name);
  // Kept as the GEMMs read it: as its producer rounded it, else rounded by the op into x_ —
  // under sequence parallelism rounded here first, this rank's rows kept so (and gathered in
  // half the bytes): the same bits as the op's rounding of the gathered rows.
  if (x.dtype() != DType::kF32) {
    x_ = x;
    return whole_input(x);
  }
  x_ = Tensor::empty(x.shape(), out_dtype, ctx.device);
  if (!sequence_parallel_) return x;
  ops::round_for_matmul(ctx.exec(), x_.raw(), out_dtype, x.data<float>(), x.numel());
  return whole_input(x_);
}

Tensor ColumnParallelLinear::forward_rounded_output(Context& ctx, const Tensor& x) {
  DType out_dtype;
  const Tensor whole = keep_input_for_sixteen_bit_output(ctx, x, "a 16-bit output", out_dtype);
  const int64_t n = whole.dim(0);
  Tensor y = Tensor::empty({n, local_out_}, out_dtype, ctx.device);
  ops::matmul_forward_rounded_output(
      ctx.exec(), y.raw(), out_dtype, whole.raw(), whole.dtype(), x_.raw(),
      gemm_weight(ctx, *weight_), bias_ ? bias_->value.data<float>() : nullptr, n, in_, local_out_);
  return y;
}

Tensor ColumnParallelLinear::forward_gelu(Context& ctx, const Tensor& x, Tensor& gelu_out) {
  DType out_dtype;
  const Tensor whole = keep_input_for_sixteen_bit_output(ctx, x, "a GELU in the GEMM", out_dtype);
  const int64_t n = whole.dim(0);
  Tensor pre = Tensor::empty({n, local_out_}, out_dtype, ctx.device);
  gelu_out = Tensor::empty(pre.shape(), out_dtype, ctx.device);
  ops::matmul_forward_gelu(ctx.exec(), gelu_out.raw(), pre.raw(), out_dtype, whole.raw(),
                           whole.dtype(), x_.raw(), gemm_weight(ctx, *weight_),
                           bias_ ? bias_->value.data<float>() : nullptr, n, in_, local_out_);
  return pre;
}

Tensor ColumnParallelLinear::backward(Context& ctx, const Tensor& dy) {
  return backward_impl(ctx, dy, nullptr);
}

Tensor ColumnParallelLinear::backward_before_gelu(Context& ctx, Tensor& dgelu, const Tensor& h) {
  if (h.numel() != dgelu.numel())
    fail(weight_->name, ": GELU input has ", h.numel(), " values, its gradient ", dgelu.numel());
  return backward_impl(ctx, dgelu, &h);
}

Tensor ColumnParallelLinear::backward_impl(Context& ctx, const Tensor& dy,
                                           const Tensor* gelu_input) {
  LOOM_CHECK(x_.defined());
  Tensor kept = x_;
  x_ = Tensor();
  // Under sequence parallelism only this rank's rows were kept (Megatron-LM's): the whole input
  // is all-gathered again, behind the input gradient's GEMM, which does not read it; the weight
  // gradients wait for it.
  Tensor whole = kept;
  WorkHandle gather;
  if (sequence_parallel_) {
    whole = Tensor::empty({kept.dim(0) * tp_.size(), in_}, kept.dtype(), kept.device());
    gather = tp_.all_gather_async(kept, whole);
  }
  const int64_t n = whole.dim(0);
  Tensor dx = Tensor::empty({n, in_}, DType::kF32, ctx.device);
  float* dbias = bias_ ? bias_->grad.data<float>() : nullptr;
  // The weight gradients go to a zero-bubble schedule's W, or behind the collective below —
  // or, with nothing to put them behind, right after the gather.
  WeightGradsBehindComm weight_grads(ctx);
  DeferredWeightGrads after_gather;
  DeferredWeightGrads* later = weight_grads.later();
  if (later == nullptr && gather) later = &after_gather;
  if (dy.dtype() != DType::kF32) {  // rounded by its producer (the attention's dqkv)
    if ((kept.dtype() != dy.dtype() && kept.dtype() != DType::kF32) || gelu_input != nullptr)
      fail(weight_->name, ": a ", dtype_name(dy.dtype()),
           " output gradient needs an input kept in ", dtype_name(dy.dtype()), " or f32, not ",
           dtype_name(kept.dtype()));
    input_grad_now_weight_grads_at_w(
        later, ctx.exec(), dx.raw(),
        [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = whole, n, in = in_,
         out = local_out_](const Exec& ex, void* dinp, bool weights) {
          ops::matmul_backward_from_rounded(
              ex, static_cast<float*>(dinp), weights ? w->grad.data<float>() : nullptr,
              weights && b ? b->grad.data<float>() : nullptr, dy.raw(), dy.dtype(), x.raw(),
              x.dtype(), wop, n, in, out);
        },
        static_cast<int64_t>(dy.nbytes() + whole.nbytes()));
  } else if (kept.dtype() != DType::kF32) {  // kept as its producer rounded it
    float* d = dy.data<float>();  // backward_before_gelu's dgelu: overwritten, as documented
    if (gelu_input != nullptr)
      ops::gelu_backward<float>(ctx.exec(), d, gelu_input->data<float>(), d, dy.numel());
    input_grad_now_weight_grads_at_w(
        later, ctx.exec(), dx.raw(),
        [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy, x = whole, n, in = in_,
         out = local_out_](const Exec& ex, void* dinp, bool weights) {
          ops::matmul_backward_from_rounded_input(
              ex, static_cast<float*>(dinp), weights ? w->grad.data<float>() : nullptr,
              weights && b ? b->grad.data<float>() : nullptr, dy.data<float>(), x.raw(), x.dtype(),
              wop, n, in, out);
        },
        static_cast<int64_t>(dy.nbytes() + whole.nbytes()));
  } else if (later != nullptr) {  // dW at W, behind the collective, or after the gather
    ops::linear_backward_input<float>(ctx.exec(), dx.data<float>(), dy.data<float>(),
                                      gelu_input != nullptr ? gelu_input->data<float>() : nullptr,
                                      weight_->value.data<float>(), n, in_, local_out_);
    // (Under sequence parallelism the gathered input stays until W.)
    defer_weight_grad<float>(*later, weight_, bias_, dy, whole, n, in_, local_out_);
  } else {
    ops::linear_backward<float>(
        ctx.exec(), dx.data<float>(), weight_->grad.data<float>(), dbias, dy.data<float>(),
        gelu_input != nullptr ? gelu_input->data<float>() : nullptr, whole.data<float>(),
        weight_->value.data<float>(), n, in_, local_out_);
  }
  if (gather) {
    // The compute (on a GPU its stream) waits for the rows before any weight gradient reads them.
    gather->wait_on_device();
    if (!after_gather.empty()) after_gather.run(ctx.exec(), nullptr);
  }
  kept = whole = Tensor();  // freed before the collective (work deferred to W holds its own)
  // Each rank's dx is its output slice's contribution: sum over the group.
  if (!sequence_parallel_) {
    weight_grads.finish(tp_.all_reduce_async(dx, ReduceOp::kSum));
    return dx;
  }
  Tensor mine = Tensor::empty({n / tp_.size(), in_}, DType::kF32, ctx.device);
  weight_grads.finish(tp_.reduce_scatter_async(dx, mine, ReduceOp::kSum));
  return mine;
}

RowParallelLinear::RowParallelLinear(ParameterStore& store, const std::string& name, int64_t in,
                                     int64_t out, Communicator& tp, bool bias, float init_std,
                                     bool sequence_parallel)
    : out_(out), tp_(tp), sequence_parallel_(sequence_parallel) {
  const int64_t P = tp.size(), r = tp.rank();
  if (in % P != 0) fail(name, ": ", in, " input features do not split over ", P, " tensor-parallel ranks");
  local_in_ = in / P;
  weight_ = store.add_shard(name + ".weight", {out, local_in_}, {out, in},
                            {{0, out, Region{{out, in}, {0, r * local_in_}}}}, InitKind::kNormal, init_std);
  weight_->gemm_operand = true;
  if (bias) bias_ = store.add(name + ".bias", {out}, InitKind::kZeros);
}

void RowParallelLinear::check_input(const Tensor& x) const { check_2d(x, local_in_, weight_->name); }

Tensor RowParallelLinear::forward(Context& ctx, const Tensor& x) {
  check_input(x);
  x_ = x;
  const int64_t n = x.dim(0);
  Tensor partial = Tensor::empty({n, out_}, DType::kF32, ctx.device);
  // The bias joins the sum once: rank 0 adds it to its partial output.
  const float* bias = bias_ != nullptr && tp_.rank() == 0 ? bias_->value.data<float>() : nullptr;
  if (x.dtype() != DType::kF32)  // rounded by its producer (the attention's output), kept so
    ops::matmul_forward_from_rounded_input(ctx.exec(), partial.data<float>(), x.raw(), x.dtype(),
                                           gemm_weight(ctx, *weight_), bias, n, local_in_, out_);
  else
    ops::linear_forward<float>(ctx.exec(), partial.data<float>(), x.data<float>(),
                               weight_->value.data<float>(), bias, nullptr, n, local_in_, out_);
  if (!sequence_parallel_) {
    tp_.all_reduce_async(partial, ReduceOp::kSum)->wait_on_device();
    return partial;
  }
  Tensor mine = Tensor::empty({n / tp_.size(), out_}, DType::kF32, ctx.device);
  tp_.reduce_scatter_async(partial, mine, ReduceOp::kSum)->wait_on_device();
  return mine;
}

Tensor RowParallelLinear::gathered_output_grad(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(x_.defined());
  if (!sequence_parallel_) return dy;
  Tensor dy_all = Tensor::empty({x_.dim(0), out_}, DType::kF32, ctx.device);
  tp_.all_gather_async(dy, dy_all)->wait_on_device();
  return dy_all;
}

Tensor RowParallelLinear::backward_rounded_dinp(Context& ctx, const Tensor& dy) {
  const Tensor dy_all = gathered_output_grad(ctx, dy);
  const DType dx_dtype = ops::matmul_input_dtype(ctx.exec(), DType::kF32);
  if (dx_dtype == DType::kF32 || dy.dtype() != DType::kF32)
    fail(weight_->name, ": a 16-bit input gradient needs bf16 / fp16 GEMMs on a GPU and an f32 "
         "output gradient");
  const int64_t n = x_.dim(0);
  Tensor dx = Tensor::empty({n, local_in_}, dx_dtype, ctx.device);
  input_grad_now_weight_grads_at_w(
      ctx.deferred_weight_grads, ctx.exec(), dx.raw(),
      [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy_all, x = x_, dx_dtype, n,
       in = local_in_, out = out_](const Exec& ex, void* dinp, bool weights) {
        ops::matmul_backward_rounded_dinp(
            ex, dinp, dx_dtype, weights ? w->grad.data<float>() : nullptr,
            weights && b ? b->grad.data<float>() : nullptr, dy_all.data<float>(), x.raw(),
            x.dtype(), wop, n, in, out);
      },
      static_cast<int64_t>(dy_all.nbytes() + x_.nbytes()));
  x_ = Tensor();
  return dx;
}

Tensor RowParallelLinear::backward_into_gelu(Context& ctx, const Tensor& dy, const Tensor& pre) {
  const Tensor dy_all = gathered_output_grad(ctx, dy);
  const int64_t n = x_.dim(0);
  if (pre.numel() != x_.numel() || pre.dtype() != x_.dtype() || dy.dtype() != DType::kF32)
    fail(weight_->name, ": backward into a GELU takes an f32 output gradient and the GELU's input "
         "in the type this layer's input was kept in (", dtype_name(x_.dtype()), ", ", x_.numel(),
         " values), not ", dtype_name(dy.dtype()), " and ", dtype_name(pre.dtype()), " (",
         pre.numel(), " values)");
  Tensor dpre = Tensor::empty({n, local_in_}, x_.dtype(), ctx.device);
  // pre by its address: only the input half (now) reads it.
  input_grad_now_weight_grads_at_w(
      ctx.deferred_weight_grads, ctx.exec(), dpre.raw(),
      [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy_all, x = x_, pre = pre.raw(), n,
       in = local_in_, out = out_](const Exec& ex, void* dinp, bool weights) {
        ops::matmul_backward_into_gelu(
            ex, dinp, x.dtype(), weights ? w->grad.data<float>() : nullptr,
            weights && b ? b->grad.data<float>() : nullptr, dy_all.data<float>(), x.raw(), wop,
            dinp != nullptr ? pre : nullptr, n, in, out);
      },
      static_cast<int64_t>(dy_all.nbytes() + x_.nbytes()));
  x_ = Tensor();
  return dpre;
}

Tensor RowParallelLinear::backward(Context& ctx, const Tensor& dy) {
  const Tensor dy_all = gathered_output_grad(ctx, dy);
  const int64_t n = x_.dim(0);
  // dy_all holds every row, so the (replicated) bias gradient is whole on every rank.
  Tensor dx = Tensor::empty({n, local_in_}, DType::kF32, ctx.device);
  if (x_.dtype() != DType::kF32) {  // kept as its producer rounded it
    input_grad_now_weight_grads_at_w(
        ctx.deferred_weight_grads, ctx.exec(), dx.raw(),
        [w = weight_, wop = gemm_weight(ctx, *weight_), b = bias_, dy_all, x = x_, n,
         in = local_in_, out = out_](const Exec& ex, void* dinp, bool weights) {
          ops::matmul_backward_from_rounded_input(
              ex, static_cast<float*>(dinp), weights ? w->grad.data<float>() : nullptr,
              weights && b ? b->grad.data<float>() : nullptr, dy_all.data<float>(), x.raw(),
              x.dtype(), wop, n, in, out);
        },
        static_cast<int64_t>(dy_all.nbytes() + x_.nbytes()));
    x_ = Tensor();
    return dx;
  }
  if (ctx.deferred_weight_grads != nullptr) {  // B of a zero-bubble schedule: dW later
    ops::linear_backward_input<float>(ctx.exec(), dx.data<float>(), dy_all.data<float>(), nullptr,
                                      weight_->value.data<float>(), n, local_in_, out_);
    defer_weight_grad<float>(*ctx.deferred_weight_grads, weight_, bias_, dy_all, x_, n, local_in_,
                             out_);
    x_ = Tensor();
    return dx;
  }
  ops::linear_backward<float>(ctx.exec(), dx.data<float>(), weight_->grad.data<float>(),
                              bias_ ? bias_->grad.data<float>() : nullptr, dy_all.data<float>(),
                              nullptr, x_.data<float>(), weight_->value.data<float>(), n, local_in_,
                              out_);
  x_ = Tensor();
  return dx;
}

}  // namespace loom
