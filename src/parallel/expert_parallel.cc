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

Tensor ExpertParallel::all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                                  const std::vector<int64_t>& recv_rows) {
  Shape shape = send.shape();
  int64_t row = 1;  // elements a row
  for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
  std::vector<int64_t> send_counts, recv_counts;
  shape[0] = 0;
  for (size_t r = 0; r < send_rows.size(); ++r) {
    send_counts.push_back(send_rows[r] * row);
    recv_counts.push_back(recv_rows[r] * row);
    shape[0] += recv_rows[r];
  }
  Tensor out = Tensor::empty(shape, send.dtype(), send.device());
  // Read by device work only (the experts' GEMMs; the indices through a copy to the host).
  ep_.all_to_all_v_async(send, send_counts, out, recv_counts)->wait_on_device();
  return out;
}

std::vector<int64_t> ExpertParallel::exchange_counts(const std::vector<int64_t>& to_each) {
  return all_to_all_values(ep_, to_each);  // one wait: up queued, back behind the exchange
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
