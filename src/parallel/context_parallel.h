// Context parallelism — the sequence split over the ranks of the mesh's cp axis, so activations
// of long sequences fit (Megatron-LM's context parallelism, torchtitan's CP): every rank of a cp
// group trains on the same sequences, each holding 1/cp of each one's positions through every
// layer. Only the attention mixes positions: it all-gathers the keys and values over cp, computes
// its own query rows against every key, and reduce-scatters the keys' and values' gradients in
// the backward; the queries and dQ stay local (the all-gather variant of Llama 3's training, not
// a ring of key/value blocks: one collective each way). Parameters are replicated over cp and their gradients are summed with dp's: the
// trainer's data-parallel group is dp × cp (docs/context_parallel.md).
//
// Load balance: a causal query row at position i does i + 1 keys' work, so a contiguous split
// would leave the last rank cp times the first's. Each sequence is cut into 2·cp chunks and rank
// r holds chunks r and 2·cp − 1 − r (the "zigzag" of Megatron-LM and ring-flash-attention):
// every rank does the same work.
#pragma once

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
  // cp: this rank's group along the cp axis; T: the whole sequence's length.
  ContextParallel(Communicator& cp, int64_t T);

  int64_t full_length() const override { return T_; }
  const std::vector<cpu::RowRange>& positions() const override { return positions_[cp_.rank()]; }
  Tensor gather(Context& ctx, const Tensor& local) override;
  Tensor reduce_scatter(Context& ctx, const Tensor& full) override;

 private:
  Communicator& cp_;
  int64_t T_;
  std::vector<std::vector<cpu::RowRange>> positions_;  // every rank's
};

}  // namespace loom
