// Llama's MLP (Shazeer 2020, "GLU Variants Improve Transformer"): proj(silu(gate(x)) ⊙ up(x)),
// no biases; or with GatedActivation::kGeluTanh Gemma's GeGLU, proj(gelu(gate(x)) ⊙ up(x)). The
// gate and up projections are one fused Linear, fc (C -> 2H: the gate's H rows, then the up
// projection's), so one GEMM makes both and the tensor-parallel split takes a slice of each
// (parallel/tensor_parallel_block.h); proj is H -> C.
#pragma once

#include <string>

#include "kernels/gated_activation.h"
#include "nn/feed_forward.h"
#include "nn/linear.h"

namespace loom {

// A slice of the hidden width: rank `rank` of `ranks` holds hidden / ranks of it (a mixture's
// experts under tensor parallelism, nn/moe_mlp.h) — the gate's and the up projection's matching
// rows of fc and proj's matching columns, each a block of the full weight (ParameterStore::
// add_shard), so that the sliced MLP's output summed over the ranks is the whole MLP's.
struct HiddenSlice {
  int64_t rank = 0;
  int64_t ranks = 1;
};

class SwiGluMlp : public FeedForward {
 public:
  // proj_std: the residual-stream projection's init std (scaled by depth, as GPT-2's). `hidden`
  // is the whole width; `slice` says which part of it this one holds.
  SwiGluMlp(ParameterStore& store, const std::string& name, int64_t channels, int64_t hidden,
            float init_std, float proj_std, HiddenSlice slice = {},
            GatedActivation act = GatedActivation::kSilu);
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) override;
  Tensor backward(Context& ctx, const Tensor& dy) override;
  void clear_cache() override;
  // Drops fc's input and proj's (the SwiGLU output, rebuilt from the kept fc output h).
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
  Tensor swiglu(Context& ctx) const;                 // act(gate) ⊙ up of h_, in h_'s type
  Tensor project_up(Context& ctx, const Tensor& x);  // fc: h_ and its SwiGLU output
  GatedActivation act_;
  int64_t hidden_;  // this slice's width
  Linear fc_;
  Linear proj_;
  // (..., 2H) fc output: the gate and up projections side by side. On a GPU at bf16 / fp16
  // matmul precision in 16 bits (ops::matmul_input_dtype), as are the SwiGLU output (proj's
  // input) and both gradients: the GEMMs read them so, and h_ is the MLP's largest activation.
  Tensor h_;
};

}  // namespace loom
