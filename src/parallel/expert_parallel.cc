// Expert parallelism: see expert_parallel.h.
#include "parallel/expert_parallel.h"

#include "base/error.h"

namespace loom {

Tensor ExpertParallel::gather(const Tensor& local) {
  Shape shape = local.shape();
  shape[0] *= ep_.size();
  Tensor out = Tensor::empty(shape, local.dtype(), local.device());
  // Read by device work only (the experts' GEMMs; the choices through a copy to the host).
  ep_.all_gather_async(local, out)->wait_on_device();
  return out;
}

Tensor ExpertParallel::reduce_scatter(const Tensor& stacked) {
  Shape shape = stacked.shape();
  LOOM_CHECK(shape[0] % ep_.size() == 0);
  shape[0] /= ep_.size();
  Tensor out = Tensor::empty(shape, stacked.dtype(), stacked.device());
  ep_.reduce_scatter_async(stacked, out, ReduceOp::kSum)->wait_on_device();
  return out;
}

Tensor ExpertParallel::all_to_all(const Tensor& send) {
  Tensor out = Tensor::empty(send.shape(), send.dtype(), send.device());
  ep_.all_to_all_async(send, out)->wait_on_device();
  return out;
}

int64_t ExpertParallel::max_over_group(int64_t value) {
  return static_cast<int64_t>(all_reduce_value(ep_, static_cast<double>(value), ReduceOp::kMax));
}

ExpertGroups split_expert_groups(Communicator& dp, int ep, Communicator* gradients) {
  if (ep < 1 || dp.size() % ep != 0)
    fail("parallel.ep = ", ep, " must divide parallel.dp = ", dp.size(),
         ": expert-parallel groups are made of data-parallel ranks");
  ExpertGroups groups;
  groups.ep = dp.split(dp.rank() / ep, dp.rank());
  Communicator& all = gradients != nullptr ? *gradients : dp;
  groups.experts_dp = all.split(dp.rank() % ep, all.rank());
  return groups;
}

}  // namespace loom
