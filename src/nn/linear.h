// Linear: y = x·Wᵀ + b over the last dim, PyTorch's layout (W is out × in).
// Caches its input in forward; backward accumulates dW, db and returns dx.
#pragma once

#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

// Backward: the combined one (dx, dW, db together), or with Context::deferred_weight_grads set
// dx only and dW / db deferred there (the f32 / f64 path, and fp8; where a GPU keeps 16-bit
// GEMM operands the weight gradients are computed at once all the same).
class Linear {
 public:
  Linear(ParameterStore& store, const std::string& name, int64_t in, int64_t out, bool bias,
         float init_std = 0.02f);
  // Over parameters already registered (a shard of a bigger weight: ParameterStore::add_shard):
  // `weight` (out, in), `bias` (out) or null.
  Linear(Parameter* weight, Parameter* bias);
  // x: (..., in) -> (..., out). x is ctx.dtype, or already rounded for the GEMMs by its producer
  // (ops::matmul_input_dtype: LayerNorm::forward_for_matmul, a GPU at bf16 / fp16).
  Tensor forward(Context& ctx, const Tensor& x);
  // forward writing y in 16 bits (ops::matmul_input_dtype; a GPU at bf16 / fp16), the bias
  // rounded to that type too: an output only 16-bit readers take (ops::
  // matmul_forward_rounded_output; the qkv projection for the flash kernels). Fails elsewhere.
  Tensor forward_rounded_output(Context& ctx, const Tensor& x);
  // forward of a Linear a GELU follows (Mlp's fc) on a GPU at bf16 / fp16 (ops::
  // matmul_input_dtype; fails elsewhere), the GELU in the GEMM's epilogue: returns the GELU's
  // input pre = x·Wᵀ + b, and sets `gelu_out` = GELU(pre), both in 16 bits (ops::
  // matmul_forward_gelu). The caller keeps pre for backward_into_gelu.
  Tensor forward_gelu(Context& ctx, const Tensor& x, Tensor& gelu_out);
  // forward plus `residual` (shaped like the output): a block's skip connection, x + proj(...).
  // On a GPU added in the GEMM's epilogue (ops::matmul_forward_adding), not in a pass of its own.
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual);
  // dy: (..., out) -> dx: (..., in). dy is ctx.dtype, or already rounded for the GEMMs by its
  // producer (ops::attention_backward_rounded, backward_into_gelu) in the type the input was
  // kept in.
  Tensor backward(Context& ctx, const Tensor& dy);
  // backward writing dx in 16 bits (ops::matmul_input_dtype; a GPU at bf16 / fp16, else it
  // fails), for a reader that takes it so: the attention projection's, dO of the flash kernels
  // (ops::matmul_backward_rounded_dinp).
  Tensor backward_rounded_dinp(Context& ctx, const Tensor& dy);
  // backward for a Linear whose output h went into a GELU (Mlp's fc), from dgelu, the gradient
  // at the GELU's output: gelu_backward then backward, in one op (ops::
  // matmul_backward_before_gelu; one pass fewer over the activations on a GPU). dgelu is
  // overwritten. Not on an input kept in 16 bits (forward_gelu's place).
  Tensor backward_before_gelu(Context& ctx, Tensor& dgelu, const Tensor& h);
  // backward of the Linear after that GELU (Mlp's proj, its input the 16-bit gelu_out): returns
  // the gradient at the GELU's input, dpre = GELU'(pre) ⊙ dx, in 16 bits — the fc's dy for
  // backward (ops::matmul_backward_into_gelu).
  Tensor backward_into_gelu(Context& ctx, const Tensor& dy, const Tensor& pre);
  void clear_cache() { x_ = Tensor(); }
  // The tensors kept from forward for backward (nn/context.h: ActivationStash).
  void collect_cache(std::vector<Tensor*>& out) { out.push_back(&x_); }
  // Selective recomputation (models/gpt2.h): an owner that can rebuild this layer's input
  // cheaply (a LayerNorm or GELU output) drops the cached copy after forward, and gives the same
  // values back before backward — the matmul's backward needs them for the weight gradient.
  void drop_input() { x_ = Tensor(); }
  void restore_input(const Tensor& x);
  bool has_input() const { return x_.defined(); }

  Parameter* weight() const { return weight_; }
  Parameter* bias() const { return bias_; }

 private:
  Tensor forward_impl(Context& ctx, const Tensor& x, const Tensor* residual);
  // forward_rounded_output's and forward_gelu's start: checks x and that GEMM inputs are 16-bit
  // here (else fails naming `what`), keeps x_ as the GEMMs read it — x where its producer rounded
  // it, else a buffer the op rounds x into — and returns the 16-bit type.
  DType keep_input_for_sixteen_bit_output(Context& ctx, const Tensor& x, const char* what);
  // backward, through a GELU when `gelu_input` is non-null (its dy is then the GELU's dgelu).
  Tensor backward_impl(Context& ctx, const Tensor& dy, const Tensor* gelu_input);

  int64_t in_, out_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  // (N, in) cached input; on a GPU at bf16 / fp16 matmul precision its 16-bit rounding, what
  // both GEMMs read (ops::matmul_input_dtype).
  Tensor x_;
};

}  // namespace loom
