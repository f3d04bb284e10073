// MLP of a GPT-2 block: fc (C -> 4C), tanh-GELU, proj (4C -> C).
#pragma once

#include <string>

#include "nn/linear.h"

namespace loom {

class Mlp {
 public:
  // proj_std: GPT-2 scales the init of residual-stream projections by 1/sqrt(2·n_layers).
  Mlp(ParameterStore& store, const std::string& name, int64_t channels, float init_std,
      float proj_std);
  Tensor forward(Context& ctx, const Tensor& x);
  Tensor backward(Context& ctx, const Tensor& dy);
  void clear_cache();
  void collect_cache(std::vector<Tensor*>& out) {
    fc_.collect_cache(out);
    proj_.collect_cache(out);
    out.push_back(&h_);
  }

 private:
  Linear fc_;
  Linear proj_;
  Tensor h_;  // fc output, the GELU's input
};

}  // namespace loom
