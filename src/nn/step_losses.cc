#include "nn/step_losses.h"

#include <algorithm>

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

void StepLosses::add_mean_of(const Exec& ex, const Tensor& losses, int64_t n) {
  LOOM_CHECK_MSG(losses.numel() >= n && losses.device() == device_,
                 "StepLosses: losses on another device, or fewer than n");
  double* slot = add_sum_of(n);
  dispatch_float(losses.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ops::sum_into<T>(ex, losses.data<T>(), n, slot);
  });
}

double* StepLosses::add_sum_of(int64_t n) {
  if (used_ == (slots_.defined() ? slots_.numel() : 0)) {
    // Grown by doubling; a step's micro-batches fit the first allocation in a training loop
    // (the copy of the slots in use waits for them: rare, never per micro-batch).
    Tensor grown = Tensor::empty({std::max<int64_t>(16, 2 * used_)}, DType::kF64, device_);
    if (used_ > 0) grown.narrow(0, used_).copy_from(slots_.narrow(0, used_));
    slots_ = grown;
  }
  entries_.push_back({used_, n});
  return slots_.data<double>() + used_++;
}

double* StepLosses::add_lse_square_sum_of(int64_t n) {
  double* slot = add_sum_of(n);
  entries_.back().lse_square = true;
  return slot;
}

std::vector<double> StepLosses::take() {
  std::vector<double> sums;
  if (used_ > 0) {
    const Tensor host = slots_.narrow(0, used_).to(Device::cpu());  // the one wait
    sums.assign(host.data<double>(), host.data<double>() + used_);
  }
  std::vector<double> means;
  means.reserve(entries_.size());
  taken_lse_squares_.clear();
  for (const Entry& e : entries_)
    (e.lse_square ? taken_lse_squares_ : means)
        .push_back(sums[static_cast<size_t>(e.slot)] / static_cast<double>(e.n));
  entries_.clear();
  used_ = 0;
  return means;
}

void report_mean_loss(Context& ctx, const Tensor& losses, int64_t n, double* loss) {
  if (ctx.losses != nullptr) {
    ctx.losses->add_mean_of(ctx.exec(), losses, n);
    return;
  }
  LOOM_CHECK(loss != nullptr);
  *loss = dispatch_float(losses.dtype(), [&](auto zero) {
    using T = decltype(zero);
    return ops::sum<T>(ctx.exec(), losses.data<T>(), n) / static_cast<double>(n);
  });
}

}  // namespace loom
