// Context parallelism — the sequence split over the ranks of the mesh's cp axis, so activations
// of long sequences fit (Megatron-LM's context parallelism, torchtitan's CP): every rank of a cp
// group trains on the same sequences, each holding 1/cp of each one's positions through every
// layer. Only the attention mixes positions. Two exchanges (parallel.cp_comm):
// - "all_gather" (Llama 3's training): all-gather the keys and values over cp, compute the
//   rank's query rows against every key, reduce-scatter the keys' and values' gradients in the
//   backward — one collective each way, the whole sequence's keys and values held per layer.
// - "ring" (Megatron-LM's p2p, ring attention): each rank's keys and values pass round the group
//   one block at a time, the next arriving from the previous rank while the current one
//   computes; partial results merge by their log-sum-exp. The backward passes the blocks round
//   again, each block's gradient travelling with it and summed on the way home. Only the rank's
//   own keys and values are kept: 1/cp of the all-gather's.
// The queries and dQ stay local either way. Parameters are replicated over cp and their
// gradients are summed with dp's: the trainer's data-parallel group is dp × cp
// (docs/context_parallel.md).
//
// Load balance: a causal query row at position i does i + 1 keys' work, so a contiguous split
// would leave the last rank cp times the first's. Each sequence is cut into 2·cp chunks and rank
// r holds chunks r and 2·cp − 1 − r (the "zigzag" of Megatron-LM and ring-flash-attention):
// every rank does the same work.
#pragma once

#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "nn/sequence_shard.h"

namespace loom {

// Rank r's positions of a length-T sequence over cp ranks: chunks r and 2·cp − 1 − r of 2·cp
// (T % (2·cp) == 0); the whole sequence when cp = 1.
std::vector<cpu::RowRange> zigzag_positions(int64_t T, int cp, int rank);

// tokens (B, T) i32 → this rank's positions' columns (B, Tl), on the host.
Tensor shard_tokens(const Tensor& tokens, const std::vector<cpu::RowRange>& positions);

class ContextParallel final : public SequenceShard {
 public:
  // cp: this rank's group along the cp axis; T: the whole sequence's length; ring: the ring
  // exchange (parallel.cp_comm = "ring"), else the all-gather.
  ContextParallel(Communicator& cp, int64_t T, bool ring = false);

  int64_t full_length() const override { return T_; }
  const std::vector<cpu::RowRange>& positions() const override { return positions_[cp_.rank()]; }
  Tensor gather(Context& ctx, const Tensor& local) override;
  Tensor reduce_scatter(Context& ctx, const Tensor& full) override;
  void sum_over_group(std::vector<double>& values) override {
    values = all_reduce_values(cp_, values);
  }
  bool ring() const override { return ring_; }
  void ring_blocks(Context& ctx, const Tensor& local, const BlockVisit& visit) override;
  Tensor ring_blocks_backward(Context& ctx, const Tensor& local, DType grad_dtype,
                              const GradVisit& visit) override;

 private:
  // The ring's walk: step(s, block) for s = 0..cp-1 with rank (rank - s)'s block, the next one
  // already on its way from the previous rank (and this one to the next) while step runs.
  void walk_ring(Context& ctx, const Tensor& local,
                 const std::function<void(int, const Tensor&)>& step);

  Communicator& cp_;
  int64_t T_;
  bool ring_;
  std::vector<std::vector<cpu::RowRange>> positions_;  // every rank's
};

}  // namespace loom
