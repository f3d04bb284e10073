// Megatron-LM's tensor-parallel linear layers (issue 5), the communication inside them.
//
// y = x·Wᵀ + b with W (out, in). Over a tp group of size P:
//
//   ColumnParallelLinear: rank r holds the rows of W (output features) of its slice and the
//     matching bias entries. Forward needs the whole input and makes its slice of the output
//     (no communication); backward's input gradient is a partial sum over ranks → all-reduce.
//   RowParallelLinear: rank r holds the columns of W (input features) of its slice; the bias is
//     replicated. Forward takes the input's slice (what a column-parallel layer produced) and
//     makes a partial output → all-reduce; backward needs no communication.
//
// A column-parallel layer followed by a row-parallel one (the MLP; QKV then the attention
// projection) costs one all-reduce forward and one backward.
//
// Sequence parallelism (Korthikanti et al. 2022): outside the pair, activations are split by
// rows (tokens) across the group. The column layer's input is then all-gathered first (and its
// input gradient reduce-scattered instead of all-reduced); the row layer's output is
// reduce-scattered instead of all-reduced (and its output gradient all-gathered in backward).
// The same bytes move; the activations between pairs shrink P-fold. As in Megatron-LM, the
// column layer keeps only this rank's rows of its input and all-gathers them again in backward
// (behind the input gradient's GEMM, which does not read them): the kept input shrinks P-fold
// too, for one more all-gather per column layer backward. The row-parallel bias's
// gradient is computed from the gathered output gradient, so it is whole on every rank; a model
// must all-reduce over tp the gradients of replicated parameters used on row slices only
// (LayerNorm gains in the sequence-parallel regions).
//
// Shards initialise from the counter-based RNG as blocks of the full weight
// (ParameterStore::add_shard), so the tp = P layer is exactly the tp = 1 layer split up.
// A fused weight (QKV: three blocks of rows) is split block by block: `out_blocks` lists the
// blocks' sizes, each divided by P, and rank r holds slice r of each.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

class ColumnParallelLinear {
 public:
  // out_blocks: sizes of the fused blocks of output features (default: one block of `out`);
  // each must be divisible by tp.size().
  ColumnParallelLinear(ParameterStore& store, const std::string& name, int64_t in, int64_t out,
                       Communicator& tp, bool bias, float init_std, bool sequence_parallel,
                       std::vector<int64_t> out_blocks = {});
  // x: (N, in), or with sequence parallelism this rank's (N/P, in) rows → (N, out/P). x is fp32,
  // or on a GPU at bf16 / fp16 matmul precision already rounded for the GEMMs by its producer (a
  // norm's forward_for_matmul): then it is gathered and kept in those 16 bits (half the bytes of
  // the sequence-parallel all-gathers and of the kept input), as nn::Linear keeps it. Under
  // sequence parallelism only this rank's rows are kept.
  Tensor forward(Context& ctx, const Tensor& x);
  // forward writing y in 16 bits (a GPU at bf16 / fp16 matmul precision; fails elsewhere), its
  // bias rounded too: nn::Linear::forward_rounded_output's, for the attention's qkv where the
  // flash kernels read it so. The input is kept rounded as forward keeps it (an f32 input rounded
  // by the GEMM, or under sequence parallelism by the layer before its gather).
  Tensor forward_rounded_output(Context& ctx, const Tensor& x);
  // forward of a layer a GELU follows (the MLP's fc) on a GPU at bf16 / fp16 (fails elsewhere),
  // the GELU in the GEMM's epilogue: returns its input pre = x·Wᵀ + b and sets `gelu_out` =
  // GELU(pre), both (N, out/P) in 16 bits — nn::Linear::forward_gelu's. The caller keeps pre for
  // the row-parallel proj's backward_into_gelu, whose 16-bit result backward takes.
  Tensor forward_gelu(Context& ctx, const Tensor& x, Tensor& gelu_out);
  // dy: (N, out/P) → dx shaped like forward's x. Accumulates the weight (and bias) gradient.
  // dy is fp32, or 16-bit as its producer rounded it for the GEMMs (the attention's dqkv on a GPU
  // at bf16 / fp16), as nn::Linear::backward takes it.
  Tensor backward(Context& ctx, const Tensor& dy);
  // backward of a layer whose output h went into a GELU (the MLP's fc), from dgelu, the gradient
  // at the GELU's output (overwritten): nn::Linear::backward_before_gelu's one op.
  Tensor backward_before_gelu(Context& ctx, Tensor& dgelu, const Tensor& h);
  void clear_cache() { x_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) { out.push_back(&x_); }
  // Selective recomputation (models/gpt2.h): the owner drops the cached input (its LayerNorm's
  // output) after forward and, before backward, hands back x as forward got it (with sequence
  // parallelism this rank's rows, which backward gathers).
  void drop_input() { x_ = Tensor(); }
  void restore_input(const Tensor& x);
  int64_t local_out() const { return local_out_; }

 private:
  Tensor whole_input(const Tensor& x);  // x, all-gathered with sequence parallelism
  // forward_rounded_output's and forward_gelu's start: x kept in x_ as the GEMMs read it (as its
  // producer rounded it; else a buffer the op rounds it into, or under sequence parallelism x's
  // rows rounded here); returns the input the op reads, gathered, and sets `out_dtype`, the
  // 16-bit type (failing where GEMM inputs are not 16-bit: `what`).
  Tensor keep_input_for_sixteen_bit_output(Context& ctx, const Tensor& x, const char* what,
                                           DType& out_dtype);
  Tensor backward_impl(Context& ctx, const Tensor& dy, const Tensor* gelu_input);
  int64_t in_, local_out_;
  Communicator& tp_;
  bool sequence_parallel_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  Tensor x_;  // the input kept for backward: with sequence parallelism this rank's rows
};

class RowParallelLinear {
 public:
  // in must be divisible by tp.size().
  RowParallelLinear(ParameterStore& store, const std::string& name, int64_t in, int64_t out,
                    Communicator& tp, bool bias, float init_std, bool sequence_parallel);
  // x: (N, in/P) → (N, out), or with sequence parallelism this rank's (N/P, out) rows. x is fp32,
  // or 16-bit as its producer rounded it for the GEMMs (the attention's output on a GPU at bf16 /
  // fp16), then kept so.
  Tensor forward(Context& ctx, const Tensor& x);
  // dy shaped like forward's output → dx (N, in/P).
  Tensor backward(Context& ctx, const Tensor& dy);
  // backward writing dx in 16 bits (a GPU at bf16 / fp16): the attention's dO where the flash
  // kernels read it so, as nn::Linear::backward_rounded_dinp.
  Tensor backward_rounded_dinp(Context& ctx, const Tensor& dy);
  // backward of the layer after a GELU (the MLP's proj, its input the 16-bit gelu_out of the
  // column-parallel fc's forward_gelu): returns the gradient at the GELU's input, dpre =
  // GELU'(pre) ⊙ dx, (N, in/P) in pre's 16 bits — fc's dy for backward (nn::Linear::
  // backward_into_gelu's).
  Tensor backward_into_gelu(Context& ctx, const Tensor& dy, const Tensor& pre);
  void clear_cache() { x_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) { out.push_back(&x_); }
  // Selective recomputation: as ColumnParallelLinear, without communication (x is local).
  void drop_input() { x_ = Tensor(); }
  void restore_input(const Tensor& x) {
    check_input(x);
    x_ = x;
  }
  Parameter* bias() const { return bias_; }  // replicated over the group

 private:
  void check_input(const Tensor& x) const;
  Tensor gathered_output_grad(Context& ctx, const Tensor& dy);  // dy, all-gathered under sp
  int64_t local_in_, out_;
  Communicator& tp_;
  bool sequence_parallel_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  Tensor x_;
};

}  // namespace loom
