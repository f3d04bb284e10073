// Causal multi-head self-attention of GPT-2: a fused qkv projection (C -> 3C), softmax attention
// per head with a causal mask, an output projection (C -> C). The attention kernel keeps only
// the per-row log-sum-exp for backward, not the T×T probabilities.
#pragma once

#include <string>

#include "nn/linear.h"

namespace loom {

class CausalSelfAttention {
 public:
  CausalSelfAttention(ParameterStore& store, const std::string& name, int64_t channels,
                      int64_t heads, float init_std, float proj_std);
  Tensor forward(Context& ctx, const Tensor& x);    // x: (B, T, C)
  // forward + residual (B, T, C), the block's skip connection added by the output projection.
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual);
  Tensor backward(Context& ctx, const Tensor& dy);  // dy: (B, T, C)
  void clear_cache();
  // Selective recomputation (models/gpt2.h): the qkv projection's cached input is the owner's
  // LayerNorm output, which the owner drops after forward and rebuilds before backward.
  void drop_input() { qkv_.drop_input(); }
  void restore_input(const Tensor& x) { qkv_.restore_input(x); }
  void collect_cache(std::vector<Tensor*>& out) {
    qkv_.collect_cache(out);
    proj_.collect_cache(out);
    out.insert(out.end(), {&qkv_out_, &att_, &lse_});
  }

 private:
  Tensor attend(Context& ctx, const Tensor& x);  // qkv and attention: proj's input
  int64_t channels_, heads_;
  Linear qkv_;
  Linear proj_;
  Tensor qkv_out_;  // (B, T, 3C)
  Tensor att_;      // (B, T, C) attention output before proj
  Tensor lse_;      // (B, NH, T)
};

}  // namespace loom
