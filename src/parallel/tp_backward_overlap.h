// WeightGradsBehindComm — a tensor-parallel layer's weight-gradient GEMMs run while the collective
// of its input gradient is in flight (Context::tp_backward_overlap, from
// parallel.tp_backward_overlap; Megatron-LM's asynchronous tensor-parallel all-reduce).
//
// The backward of a column-parallel Linear (and of the vocabulary-parallel head) ends in an
// all-reduce of its input gradient over tp — a reduce-scatter under sequence parallelism — that
// nothing but the layer below waits for, while the layer's weight gradient (dW = dyᵀ·x: as many
// FLOPs as the input gradient's GEMM; at the head the largest GEMM of the model) waits for
// nothing. So the layer computes the input gradient first, issues the collective, computes the
// weight gradients, and only then waits: on a GPU the NCCL kernel on the communicator's stream
// runs beside the GEMM on the compute stream; on CPU ranks the backend's progress thread
// reduces while the rank's threads multiply — on the same cores, when the ranks' threads take
// them all, which is why parallel.tp_backward_overlap = "auto" leaves it off there.
//
// The same split as a zero-bubble schedule's B and W (nn/deferred_weight_grads.h): the same
// GEMMs in the same order, so the run's bits do not change. Under such a schedule the weight
// gradients already wait for W and this object adds nothing.
#pragma once

#include "comm/communicator.h"
#include "nn/context.h"
#include "nn/deferred_weight_grads.h"

namespace loom {

class WeightGradsBehindComm {
 public:
  explicit WeightGradsBehindComm(Context& ctx)
      : ctx_(ctx),
        later_(ctx.deferred_weight_grads != nullptr ? ctx.deferred_weight_grads
               : ctx.tp_backward_overlap            ? &held_
                                                    : nullptr) {}
  WeightGradsBehindComm(const WeightGradsBehindComm&) = delete;
  WeightGradsBehindComm& operator=(const WeightGradsBehindComm&) = delete;

  // Where the layer puts its weight-gradient work as it computes the input gradient: a
  // zero-bubble schedule's W, this object, or nowhere (null: computed with the input gradient).
  DeferredWeightGrads* later() const { return later_; }

  // Runs the weight-gradient work this object holds — the input gradient's collective, `comm`,
  // issued before — then makes the rank's compute wait for the collective (on a GPU its stream).
  void finish(const WorkHandle& comm) {
    if (later_ == &held_) held_.run(ctx_.exec(), nullptr);
    comm->wait_on_device();
  }

 private:
  Context& ctx_;
  DeferredWeightGrads held_;
  DeferredWeightGrads* later_;
};

}  // namespace loom
