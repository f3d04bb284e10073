// An RMSNorm whose rows a tensor-parallel group splits: OLMo 2's query and key norms over all the
// heads of a row (nn/qk_norm.h, model.qk_norm_scope = "full") when tp gives each rank some of the
// heads. Each rank holds `channels` / ranks of a row's columns, the slice [rank·w, (rank + 1)·w),
// and that slice of the weight (a shard: checkpoints and the gradient norm see it as the tp
// layers' shards). The row's mean square needs every column, so the forward sums the rank's Σx²
// over the group (one value a row, TensorSplit::all_reduce) before it scales its columns; the
// backward likewise sums Σ weight·dout·x, the one term of the input gradient that spans the row.
// The weight's gradient is the rank's own slice, whole: nothing to sum over tp.
//
// Without a split (one rank) it is RmsNorm's formula with the row's sums taken in another order:
// equal to rounding, not bit for bit (kernels/cpu/rmsnorm.h).
#pragma once

#include <string>
#include <vector>

#include "nn/norm.h"
#include "nn/tensor_split.h"

namespace loom {

class SplitRmsNorm : public Norm {
 public:
  // `channels`: the whole row's; it must divide over split.ranks().
  SplitRmsNorm(ParameterStore& store, const std::string& name, int64_t channels, double eps,
               TensorSplit& split);
  // x (.., channels / ranks): this rank's columns of every row. Collective over the split.
  Tensor forward(Context& ctx, const Tensor& x) override;
  Tensor forward_for_matmul(Context& ctx, const Tensor& x) override { return forward(ctx, x); }
  Tensor backward(Context& ctx, const Tensor& dy) override;  // collective over the split
  Tensor backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) override;
  Tensor recompute_output(Context& ctx) override;  // collective: the sums again
  void clear_cache() override { x_ = rstd_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) override { out.insert(out.end(), {&x_, &rstd_}); }
  std::vector<Parameter*> parameters() const override { return {weight_}; }

 private:
  // Σ a·b(·weight) of every row of this rank's columns, summed over the split.
  Tensor row_sums(Context& ctx, const Tensor& a, const Tensor& b, bool weighted);
  int64_t channels_, local_;
  double eps_;
  TensorSplit& split_;
  Parameter* weight_;
  Tensor x_, rstd_;
};

}  // namespace loom
