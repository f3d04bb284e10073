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
  // Beside the losses, in the same slots (so read by the same copy): one micro-batch's Σ lse²
  // over n rows, which its head's op writes into the returned double (ops::lse_square_sum), for
  // the step's reported z-loss (train.z_loss).
  double* add_lse_square_sum_of(int64_t n);
  // The losses' means in the order they were added — each sum / n in double, as
  // ops::sum(...) / n —, with one read of the device's slots; then empty for the next step.
  std::vector<double> take();
  // The Σ lse² entries' means (sum / n) that the last take() read, in the order they were added.
  const std::vector<double>& taken_lse_square_means() const { return taken_lse_squares_; }

 private:
  struct Entry {
    int64_t slot = 0;  // index into slots_
    int64_t n = 0;
    bool lse_square = false;  // an add_lse_square_sum_of entry, not a loss
  };
  Device device_;
  Tensor slots_;  // f64 sums, on device_; grown by doubling
  int64_t used_ = 0;
  std::vector<Entry> entries_;
  std::vector<double> taken_lse_squares_;
};

// A head's loss, the mean of the first n of `losses`: queued into ctx.losses where a training
// step set it (*loss then left as it is), else read now into *loss.
void report_mean_loss(Context& ctx, const Tensor& losses, int64_t n, double* loss);

}  // namespace loom
