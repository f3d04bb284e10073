// TensorSplit — how a layer whose weights a tensor-parallel group splits sums what its ranks
// computed, without the layer knowing about communication. A mixture of experts under tensor
// parallelism (nn/moe_mlp.h) holds a slice of every expert's hidden width on each rank: its
// output and input gradient are partial sums over the group, and so are the gradients of its
// routing weights, which the router's backward needs whole. parallel/tensor_parallel_block.cc
// implements it over the block's tp communicator.
#pragma once

#include "tensor/tensor.h"

namespace loom {

class TensorSplit {
 public:
  virtual ~TensorSplit() = default;
  virtual int ranks() const = 0;
  virtual int rank() const = 0;
  // `partial` (the same shape on every rank) replaced by its sum over the group's ranks, on
  // every rank. Collective over the group.
  virtual void all_reduce(Tensor& partial) = 0;
};

}  // namespace loom
