// Expert parallelism — a mixture's experts spread over ranks (GShard, DeepSpeed-MoE, Megatron-LM's
// expert model parallelism), so that a model with many experts fits: each rank of an
// expert-parallel group of `ep` ranks holds E/ep of every block's experts; attention, norms,
// router and shared experts stay replicated as under plain data parallelism.
//
// Groups: ep divides dp. The dp group's ranks form dp/ep expert-parallel groups of ep consecutive
// ranks (dp ranks g·ep … g·ep + ep − 1); rank i of each holds the same experts, and those ranks —
// dp/ep of them, one per group — form its expert-data-parallel group, over which the experts'
// gradients are averaged and (ZeRO-1/2/3) their optimizer state, gradients and values sharded
// (parallel/data_parallel.h).
//
// Tokens (Megatron-LM's "allgather" dispatcher): every rank routes its own tokens; the tokens,
// their choices and their weights are all-gathered over the ep group; each rank runs its experts
// on the group's tokens that chose them; the weighed outputs are reduce-scattered (summed) back to
// the tokens' ranks. Backward all-gathers the outputs' gradients and reduce-scatters the inputs'
// and the weights'. Collectives of one size on every rank, no capacity, nothing dropped: the
// same tokens reach the same experts as on one device (an all-to-all, sending each token to the
// ranks of its top_k experts only, would move about ep / top_k times fewer bytes; the gather's
// are of one size and need no counts exchanged first).
//
// The all-to-all dispatcher (parallel.ep_dispatch = "all_to_all", Megatron-LM's "alltoall"):
// each rank lays out its (token, slot) pairs by the rank of the chosen expert, exchanges with the
// group how many rows each rank sends each (one all-to-all of ep counts, which the host waits
// for: it sizes the buffers), and all-to-alls the rows with their experts' indices in blocks of
// exactly those sizes (Communicator::all_to_all_v); the experts' outputs come back the same way
// and are weighed into the tokens at home, where the routing weights' gradient is also taken. A
// token's row travels once per chosen expert on another rank: about k/ep of the all-gather's
// bytes, nothing padded.
//
// Equivalence with one device: an expert's gradient on its rank sums the group's tokens, each
// with its own rank's loss scale (1 / its micro-batch tokens): averaged over the expert-data-
// parallel group and divided by ep it is the mean over the whole dp group's batch — dense
// parameters' average over dp. The router sees each token where it was routed, its gradient
// arriving through the weights' reduce-scatter.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "nn/expert_exchange.h"

namespace loom {

class ExpertParallel final : public ExpertExchange {
 public:
  // all_to_all_dispatch: parallel.ep_dispatch = "all_to_all" (below).
  explicit ExpertParallel(Communicator& ep, bool all_to_all_dispatch = false)
      : ep_(ep), all_to_all_dispatch_(all_to_all_dispatch) {}
  int ranks() const override { return ep_.size(); }
  int rank() const override { return ep_.rank(); }
  Tensor gather(const Tensor& local) override;
  Tensor reduce_scatter(const Tensor& stacked) override;
  bool all_to_all_dispatch() const override { return all_to_all_dispatch_; }
  Tensor all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                    const std::vector<int64_t>& recv_rows) override;
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& to_each) override;

 private:
  Communicator& ep_;
  bool all_to_all_dispatch_;
};

// The two groups of expert parallelism within a dp group (collective over it): `ep`, this rank's
// expert-parallel group, and `experts_dp`, the ranks holding its experts. `ep` must divide
// dp.size() (an error naming parallel.ep and parallel.dp). `gradients`: the gradients' group
// where it is wider than dp (dp × cp under context parallelism; collective over it too): the ep
// groups stay within dp — ranks at the same positions of their sequences, as the checkpoints'
// writers expect —, and experts_dp spans it, all the ranks holding the same experts.
struct ExpertGroups {
  std::unique_ptr<Communicator> ep;
  std::unique_ptr<Communicator> experts_dp;
};
ExpertGroups split_expert_groups(Communicator& dp, int ep, Communicator* gradients = nullptr);

}  // namespace loom
