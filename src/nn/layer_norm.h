// LayerNorm over the last dim (eps 1e-5, biased variance, as PyTorch). Caches input, mean, rstd.
#pragma once

#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

class LayerNorm {
 public:
  LayerNorm(ParameterStore& store, const std::string& name, int64_t channels);
  Tensor forward(Context& ctx, const Tensor& x);
  Tensor backward(Context& ctx, const Tensor& dy);
  void clear_cache() { x_ = mean_ = rstd_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) { out.insert(out.end(), {&x_, &mean_, &rstd_}); }

 private:
  int64_t channels_;
  Parameter* weight_;
  Parameter* bias_;
  Tensor x_, mean_, rstd_;
};

}  // namespace loom
