// ExpertExchange — how a mixture of experts (nn/moe_mlp.h) reaches experts that other ranks hold,
// without the layer knowing about communication: parallel/expert_parallel.h implements it over
// an expert-parallel group (Megatron-LM's "allgather" token dispatcher).
//
// The group's `ranks()` ranks hold the experts in equal, consecutive blocks: rank r holds
// experts [r·E/ranks, (r+1)·E/ranks). Every rank routes its own tokens; the tokens, their
// choices and weights are gathered over the group; each rank runs its experts on the tokens of
// the whole group that chose them; the outputs are summed over the group and each rank keeps its
// tokens' rows (a reduce-scatter). Backward mirrors it. With the all-to-all dispatcher
// (all_to_all_dispatch()) each rank sends each of its tokens' rows only to the ranks of the
// experts that token chose, and gets their outputs back the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace loom {

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int ranks() const = 0;
  virtual int rank() const = 0;
  // Every rank's `local` (the same shape and dtype on each), stacked by rank along dim 0: rank
  // r's rows first at r·local.dim(0). Collective over the group.
  virtual Tensor gather(const Tensor& local) = 0;
  // The sum over the ranks of `stacked` (ranks() × n rows), of which this rank keeps rows
  // [rank()·n, (rank() + 1)·n). Collective over the group.
  virtual Tensor reduce_scatter(const Tensor& stacked) = 0;

  // Whether the layer dispatches by all_to_all (parallel.ep_dispatch = "all_to_all") rather than
  // gather / reduce_scatter.
  virtual bool all_to_all_dispatch() const = 0;
  // `send` (send_rows[r] rows for rank r, block after block) → the blocks every rank sent this
  // one, recv_rows[r] rows from rank r, block after block. Collective over the group.
  virtual Tensor all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                            const std::vector<int64_t>& recv_rows) = 0;
  // What every rank of the group sends this one, from what this one sends each (to_each[r] to
  // rank r): the recv_rows of an all_to_all. Collective over the group; the host waits for it.
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& to_each) = 0;
};

}  // namespace loom
