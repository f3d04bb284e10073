// Context — what a module needs to run a kernel: the rank's thread pool and where activations
// live. Passed explicitly to every forward/backward; no globals.
#pragma once

#include "base/thread_pool.h"
#include "device/device.h"
#include "kernels/cpu/attention.h"
#include "kernels/exec.h"
#include "nn/hooks.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace loom {

class DeferredWeightGrads;
class RoundedWeights;
class SequenceShard;
class StepLosses;

struct Context {
  ThreadPool* pool = nullptr;
  Device device = Device::cpu();
  DType dtype = DType::kF32;  // activations' compute dtype (f64 in gradient checks)
  ParamHooks* hooks = nullptr;  // a parallel strategy's hooks (nn/hooks.h); none on one device
  // Set during a zero-bubble schedule's input-gradient pass: Linears add their weight gradients
  // here instead of computing them (nn/deferred_weight_grads.h).
  DeferredWeightGrads* deferred_weight_grads = nullptr;
  // Context parallelism: this rank holds only these positions of each sequence
  // (nn/sequence_shard.h); null when it holds them all.
  SequenceShard* sequence = nullptr;
  // Set by a training step: the head queues its loss here, read with the step's others at its
  // end, instead of reading it after each forward (nn/step_losses.h); null: read at once.
  StepLosses* losses = nullptr;

  // Set by a training step on a GPU at bf16 / fp16: the weights' 16-bit copies, made once a step,
  // that the Linears' and the LM head's GEMMs read (nn/rounded_weights.h); null: each GEMM casts.
  RoundedWeights* rounded_weights = nullptr;

  // Tensor-parallel layers compute their weight gradients while their input gradient's
  // collective is in flight (parallel/tp_backward_overlap.h; the trainer sets it from
  // parallel.tp_backward_overlap); the same bits either way.
  bool tp_backward_overlap = true;

  // The LM head's auxiliary z-loss coefficient (train.z_loss): its backward adds the gradient of
  // z_loss · lse² per position, and with `losses` set its forward queues Σ lse² over the
  // positions that count there (StepLosses::add_lse_square_sum_of) for the step's reported
  // z-loss. 0: none.
  float z_loss = 0;

  // Set by a model's backward to the `scale` its loss's gradient is taken at (1 / micro-batches,
  // times a loss scale): a loss added inside the network — a mixture of experts' balance loss
  // (nn/moe_mlp.h) — takes its gradient at the same scale.
  double backward_scale = 1;

  // The token ids were checked where they came from (kernels/exec.h): a training step's.
  bool ids_checked = false;

  // Document masking (data.document_mask): the micro-batch's document starts, (B, T) int32 on
  // `device` for the whole sequences (data/documents.h), set by whoever runs its forward; each
  // attention keeps it for its backward. Null: causal attention.
  const Tensor* documents = nullptr;
  // Positions reset at each document (data.reset_position_ids, which needs documents): a learned
  // position table's row for a token is its place in its document, not in the sequence
  // (document_position_ids, nn/embedding.h). Rotary positions need nothing: under the document
  // mask a query sees only its document's keys, at the same distances either way.
  bool reset_position_ids = false;

  // Where kernels/ops.h runs this module's kernels.
  Exec exec() const { return {pool, device, ids_checked}; }
};

// What the attention kernels take of a documents tensor like Context::documents (none: causal).
inline cpu::DocumentStarts document_starts_of(const Tensor& documents) {
  if (!documents.defined()) return {};
  return {documents.data<int32_t>(), documents.dim(1)};
}
// The micro-batch's documents as an attention keeps them: ctx.documents, or none.
inline Tensor documents_of(const Context& ctx) {
  return ctx.documents != nullptr ? *ctx.documents : Tensor();
}

// Hook calls that do nothing without hooks.
// x (a float tensor on ctx's device) times s in place; s = 1 leaves it, bit for bit
// (nn/context.cc). Gemma's embedding multiplier and its query scale.
void scale_in_place(Context& ctx, Tensor& x, double s);

inline void hook_before_forward(Context& ctx, size_t unit) { if (ctx.hooks) ctx.hooks->before_forward(unit); }
inline void hook_after_forward(Context& ctx, size_t unit) { if (ctx.hooks) ctx.hooks->after_forward(unit); }
inline void hook_before_backward(Context& ctx, size_t unit) { if (ctx.hooks) ctx.hooks->before_backward(unit); }
inline void hook_after_backward(Context& ctx, size_t unit) { if (ctx.hooks) ctx.hooks->after_backward(unit); }

}  // namespace loom
