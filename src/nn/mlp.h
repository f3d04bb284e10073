// MLP of a GPT-2 block: fc (C -> 4C), tanh-GELU, proj (4C -> C).
#pragma once

#include <string>

#include "nn/feed_forward.h"
#include "nn/linear.h"

namespace loom {

class Mlp : public FeedForward {
 public:
  // proj_std: GPT-2 scales the init of residual-stream projections by 1/sqrt(2·n_layers).
  Mlp(ParameterStore& store, const std::string& name, int64_t channels, float init_std,
      float proj_std);
  Tensor forward(Context& ctx, const Tensor& x) override;
  // forward + residual, the block's skip connection added by proj (Linear::forward_adding).
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void clear_cache() override;
  // Selective recomputation (models/gpt2.h), for the owner right after forward: drops the cached
  // input (the owner's LayerNorm output: it rebuilds it and hands it back with restore_input
  // before backward) and the GELU output (4C wide), which backward recomputes from the kept fc
  // output h — keeping h alone rebuilds the GELU output with one element-wise pass.
  void drop_recomputable() override;
  void restore_input(const Tensor& x) override { fc_.restore_input(x); }
  bool drop_activation_only() override {
    proj_.drop_input();
    return true;
  }
  void collect_cache(std::vector<Tensor*>& out) override {
    fc_.collect_cache(out);
    proj_.collect_cache(out);
    out.push_back(&h_);
  }

 private:
  Linear fc_;
  Linear proj_;
  // On a GPU at bf16 / fp16 the GELU runs in the GEMMs' epilogues (Linear::forward_gelu,
  // backward_into_gelu) and h_ is kept in 16 bits; elsewhere fc writes h_, a pass the GELU.
  static bool gelu_in_gemms(Context& ctx);
  Tensor fc_and_gelu(Context& ctx, const Tensor& x);  // GELU(fc(x)), proj's input; sets h_
  Tensor gelu(Context& ctx) const;  // GELU(h_)
  Tensor h_;                        // fc output, the GELU's input (16-bit where gelu_in_gemms)
};

}  // namespace loom
