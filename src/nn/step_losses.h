// StepLosses — the mean losses of a step's micro-batches, kept where they are computed and read
// once, at the step's end.
//
// Reading a micro-batch's loss as soon as its forward has run makes the host wait for the GPU in
// the middle of every micro-batch (the backward is not yet queued, so the GPU then runs dry). A
// training step needs the losses only for its report: the head queues each micro-batch's sum
// into a slot here (ops::sum_into: ops::sum's kernels and bits) and the trainer takes them all
// with one copy, as torchtitan reads its loss only when it logs. On a CPU rank a slot is written
// at once and nothing waits either way.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/exec.h"
#include "nn/context.h"
#include "tensor/tensor.h"

namespace loom {

class StepLosses {
 public:
  explicit StepLosses(Device device) : device_(device) {}

  // One micro-batch's mean loss: Σ losses[0..n) / n, summed where `losses` lives (f32, or f64
  // on a CPU rank), queued on a GPU.
  void add_mean_of(const Exec& ex, const Tensor& losses, int64_t n);
  // One micro-batch's mean loss as a sum of n rows' losses that the caller's op writes (queued)
  // into the returned double, in device memory, before the next take (the vocabulary-parallel
  // head's: ops::vocab_shard_loss_sum).
  double* add_sum_of(int64_t n);
  // The means in the order they were added — each sum / n in double, as ops::sum(...) / n —,
  // with one read of the device's slots; then empty for the next step.
  std::vector<double> take();

 private:
  struct Entry {
    int64_t slot = 0;  // index into slots_
    int64_t n = 0;
  };
  Device device_;
  Tensor slots_;  // f64 sums, on device_; grown by doubling
  int64_t used_ = 0;
  std::vector<Entry> entries_;
};

// A head's loss, the mean of the first n of `losses`: queued into ctx.losses where a training
// step set it (*loss then left as it is), else read now into *loss.
void report_mean_loss(Context& ctx, const Tensor& losses, int64_t n, double* loss);

}  // namespace loom
