// DeferredWeightGrads — the weight-gradient GEMMs of one backward pass, put off until later.
//
// A zero-bubble pipeline schedule (parallel/pipeline_schedule.h, "zb-h1") splits a stage's
// backward into B, the input gradient — which the previous stage is waiting for — and W, the
// weight gradients, which nobody waits for and can fill the time a rank would otherwise idle.
// During B the model runs its ordinary backward with Context::deferred_weight_grads set: every
// Linear computes its input gradient and, instead of its dW = dyᵀ·x (and db), adds that work
// here, holding on to dy and x (so B keeps, per Linear, one output gradient more than the
// combined backward, until W). Gradients outside Linears (LayerNorm, embedding, LM head) stay in
// B: they are small or have no input gradient to hurry.
//
// This object also stands in as B's ParamHooks, recording where each parameter unit's backward
// begins and ends; run() replays that sequence with the strategy's real hooks around the
// deferred work, so a data-parallel engine sees after_backward(u) only once u's gradients are
// final, as in a combined backward. The work runs in the order it was added — the order the
// combined backward computes it — so each gradient accumulates the same products in the same
// order, and on CPU ranks the run is bit for bit the combined schedule's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/exec.h"
#include "kernels/ops.h"
#include "nn/hooks.h"
#include "nn/parameter.h"
#include "tensor/tensor.h"

namespace loom {

class DeferredWeightGrads : public ParamHooks {
 public:
  using Work = std::function<void(const Exec&)>;

  // A weight gradient to compute later; `bytes` is what it keeps alive meanwhile (its dy and x,
  // which a combined backward releases as it goes), for the memory statistics.
  void add(Work work, int64_t bytes);
  void before_backward(size_t unit) override;
  void after_backward(size_t unit) override;

  // Runs the work in the order it was added, calling `hooks` (may be null) before and after each
  // unit's share as B's backward did; then it is empty.
  void run(const Exec& ex, ParamHooks* hooks);
  bool empty() const { return entries_.empty(); }
  size_t pending() const { return work_count_; }
  int64_t bytes() const { return bytes_; }

 private:
  enum class Kind { kBeforeUnit, kAfterUnit, kWork };
  struct Entry {
    Kind kind;
    size_t unit = 0;
    Work work;
  };
  std::vector<Entry> entries_;
  size_t work_count_ = 0;
  int64_t bytes_ = 0;
};

// A Linear's weight gradients, dW += dyᵀ·x and db += Σ dy (dy, x: (n, out), (n, in) of type T,
// or f32 in the tensor-parallel Linears), added to `deferred` to run later
// (ops::linear_backward_weight): the input-gradient pass of a zero-bubble pipeline schedule.
// The gradient buffers are looked up when the work runs, not now.
template <typename T>
void defer_weight_grad(DeferredWeightGrads& deferred, Parameter* weight, Parameter* bias,
                       const Tensor& dy, const Tensor& x, int64_t n, int64_t in, int64_t out) {
  deferred.add(
      [weight, bias, dy, x, n, in, out](const Exec& ex) {
        ops::linear_backward_weight<T>(ex, weight->grad.data<T>(),
                                       bias ? bias->grad.data<T>() : nullptr, dy.data<T>(),
                                       x.data<T>(), n, in, out);
      },
      static_cast<int64_t>(dy.nbytes() + x.nbytes()));
}

// A backward op computing a layer's input gradient and its weight's gradients in one call that
// can also do either half alone — op(ex, dinp, weights): dinp = nullptr for the weight half,
// weights = false for the input half (the GPU's 16-bit ops, kernels/ops.h). Without `deferred`
// the whole op runs now; with it (B of a zero-bubble schedule) the input half runs now and the
// weight half is added to run at W. `op` holds what the weight half reads (its dy and x:
// `kept_bytes`) and looks the gradient buffers up when it runs.
template <typename Op>
void input_grad_now_weight_grads_at_w(DeferredWeightGrads* deferred, const Exec& ex, void* dinp,
                                      Op op, int64_t kept_bytes) {
  if (deferred == nullptr) {
    op(ex, dinp, true);
    return;
  }
  op(ex, dinp, false);
  deferred->add([op](const Exec& later) { op(later, nullptr, true); }, kept_bytes);
}

}  // namespace loom
