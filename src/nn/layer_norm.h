// LayerNorm over the last dim (eps 1e-5, biased variance, as PyTorch). Caches input, mean, rstd.
#pragma once

#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/norm.h"
#include "nn/parameter.h"

namespace loom {

class LayerNorm : public Norm {
 public:
  LayerNorm(ParameterStore& store, const std::string& name, int64_t channels);
  Tensor forward(Context& ctx, const Tensor& x) override;
  // forward for an output that only a Linear reads: on a GPU at bf16 / fp16 matmul precision
  // written straight in the 16-bit type the Linear keeps its input in (ops::matmul_input_dtype),
  // bit for bit forward's output rounded; elsewhere forward itself.
  Tensor forward_for_matmul(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  // backward plus dresidual, the gradient of the skip connection around a pre-norm block's
  // branch (x + f(ln(x))): one op (ops::layernorm_backward_adding), one pass fewer on a GPU.
  Tensor backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) override;
  void clear_cache() override { x_ = mean_ = rstd_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) override {
    out.insert(out.end(), {&x_, &mean_, &rstd_});
  }
  std::vector<Parameter*> parameters() const override { return {weight_, bias_}; }
  // The last forward's output again, from the cached input, by the same kernel: bitwise the same.
  // Selective recomputation (models/gpt2.h) drops the output — which the next layer would
  // otherwise keep, one value per input value — since the input, mean and rstd stay cached for
  // this LayerNorm's own backward anyway and rebuilding costs one element-wise pass.
  Tensor recompute_output(Context& ctx) override;

 private:
  Tensor backward_impl(Context& ctx, const Tensor& dy, const Tensor* dresidual);
  // Checks x and caches it with fresh mean and rstd tensors; returns its rows.
  int64_t cache_input(Context& ctx, const Tensor& x);

  int64_t channels_;
  Parameter* weight_;
  Parameter* bias_;
  Tensor x_, mean_, rstd_;
};

}  // namespace loom
