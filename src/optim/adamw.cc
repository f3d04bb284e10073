#include "optim/adamw.h"

#include <cmath>

#include "base/error.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/elementwise.h"

namespace loom {

AdamW::AdamW(ParameterStore& params, const AdamWConfig& config)
    : params_(params), config_(config) {
  LOOM_CHECK(params.allocated());
  if (params.values().dtype() != DType::kF32) fail("AdamW needs f32 parameters");
  m_ = Tensor::zeros(params.values().shape(), DType::kF32, params.values().device());
  v_ = Tensor::zeros(params.values().shape(), DType::kF32, params.values().device());
}

void AdamW::step(ThreadPool& pool, float lr) {
  ++step_;
  for (const auto& p : params_.parameters()) {
    const float decay = p->weight_decay ? config_.weight_decay : 0.0f;
    cpu::adamw_update(pool, p->value.data<float>(), p->grad.data<float>(),
                      m_.data<float>() + p->offset, v_.data<float>() + p->offset, p->numel(), lr,
                      config_.beta1, config_.beta2, config_.eps, decay, step_);
  }
}

float lr_schedule(int64_t step, int64_t total, int64_t warmup, float lr, float min_ratio) {
  if (step < warmup) return lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  const int64_t decay_steps = total - warmup;
  if (decay_steps <= 0) return lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(lr * (min_ratio + (1.0 - min_ratio) * cosine));
}

double clip_grad_norm(ThreadPool& pool, ParameterStore& params, double max_norm) {
  Tensor& g = params.grads();
  const double norm = std::sqrt(cpu::sum_squares<float>(pool, g.data<float>(), g.numel()));
  if (max_norm > 0 && norm > max_norm) {
    cpu::scale_inplace<float>(pool, g.data<float>(), static_cast<float>(max_norm / (norm + 1e-6)),
                              g.numel());
  }
  return norm;
}

}  // namespace loom
