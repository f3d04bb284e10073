// RMSNorm over the last dim (Zhang & Sennrich 2019), Llama's normalisation: y = x · rstd · w with
// rstd = 1/sqrt(mean(x²) + eps); a weight and no bias, no mean subtracted. Caches input and rstd.
#pragma once

#include <string>
#include <vector>

#include "nn/norm.h"

namespace loom {

class RmsNorm : public Norm {
 public:
  RmsNorm(ParameterStore& store, const std::string& name, int64_t channels, double eps);
  Tensor forward(Context& ctx, const Tensor& x) override;
  // On a GPU at bf16 / fp16 matmul precision written straight in the Linear's 16-bit input type
  // (ops::rmsnorm_forward_rounded, bit for bit forward's output rounded); elsewhere forward.
  Tensor forward_for_matmul(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  Tensor backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) override;
  Tensor recompute_output(Context& ctx) override;
  void clear_cache() override { x_ = rstd_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) override { out.insert(out.end(), {&x_, &rstd_}); }
  std::vector<Parameter*> parameters() const override { return {weight_}; }

 private:
  Tensor backward_impl(Context& ctx, const Tensor& dy, const Tensor* dresidual);
  int64_t cache_input(Context& ctx, const Tensor& x);  // x_ and a fresh rstd_; returns the rows
  int64_t channels_;
  double eps_;
  Parameter* weight_;
  Tensor x_, rstd_;
};

}  // namespace loom
