#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "kernels/ops.h"

namespace loom {

AdamW::AdamW(ParameterStore& params, const AdamWConfig& config)
    : params_(&params), config_(config) {
  LOOM_CHECK(params.allocated() && params.values().defined() && params.grads().defined());
  if (params.dtype() != DType::kF32) fail("AdamW needs f32 parameters");
  m_ = Tensor::zeros({params.numel()}, DType::kF32, params.device());
  v_ = Tensor::zeros({params.numel()}, DType::kF32, params.device());
  std::vector<AdamWSegment> segments;
  for (const auto& p : params.parameters())
    segments.push_back({p->offset, p->offset, p->offset, p->numel(), p->weight_decay});
  make_runs(segments);
}

AdamW::AdamW(const AdamWConfig& config, std::vector<AdamWSegment> segments, int64_t state_numel,
             Device device)
    : config_(config) {
  for (const AdamWSegment& s : segments) LOOM_CHECK(s.state_offset + s.numel <= state_numel);
  m_ = Tensor::zeros({state_numel}, DType::kF32, device);
  v_ = Tensor::zeros({state_numel}, DType::kF32, device);
  make_runs(segments);
}

void AdamW::make_runs(const std::vector<AdamWSegment>& segments) {
  for (const AdamWSegment& s : segments)
    runs_.push_back({s.value_offset, s.grad_offset, s.state_offset, s.numel, s.decay ? 1 : 0});
  number_adamw_chunks(runs_);
  if (m_.device().is_cpu() || runs_.empty()) return;
  constexpr int64_t kFields = sizeof(AdamWRun) / sizeof(int64_t);
  static_assert(sizeof(AdamWRun) == kFields * sizeof(int64_t));
  Tensor table =
      Tensor::empty({static_cast<int64_t>(runs_.size()) * kFields}, DType::kI64, Device::cpu());
  std::memcpy(table.data<int64_t>(), runs_.data(), runs_.size() * sizeof(AdamWRun));
  runs_on_gpu_ = table.to(m_.device());
}

void AdamW::step(ThreadPool& pool, float lr, float grad_scale) {
  LOOM_CHECK(params_ != nullptr);
  step(pool, lr, params_->values().data<float>(), params_->grads().data<float>(), grad_scale);
}

void AdamW::step(ThreadPool& pool, float lr, float* values, const float* grads, float grad_scale) {
  ++step_;
  const auto* runs_on_gpu = runs_on_gpu_.defined()
                                ? reinterpret_cast<const AdamWRun*>(runs_on_gpu_.data<int64_t>())
                                : nullptr;
  ops::adamw_update_runs(Exec{&pool, m_.device()}, values, grads, m_.data<float>(),
                         v_.data<float>(), runs_, runs_on_gpu, lr, config_.beta1, config_.beta2,
                         config_.eps, config_.weight_decay, step_, grad_scale);
}

FlatModelState on_host(const FlatModelState& state) {
  FlatModelState host = state;
  for (Tensor* t : {&host.values, &host.exp_avg, &host.exp_avg_sq})
    if (t->defined() && !t->device().is_cpu()) *t = t->to(Device::cpu());
  return host;
}

LrDecay parse_lr_decay(const std::string& name) {
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "constant") return LrDecay::kConstant;
  if (name == "wsd") return LrDecay::kWsd;
  fail("learning-rate schedule '", name, "': expected cosine, linear, constant or wsd");
}

float LrSchedule::at(int64_t step) const {
  return at_progress(static_cast<double>(step), static_cast<double>(step + 1));
}

float LrSchedule::at_progress(double done, double through) const {
  // Whole steps give exact integers throughout: the per-step schedule's values bit for bit.
  const auto warmup_steps = static_cast<double>(warmup);
  if (done < warmup_steps)
    return lr * static_cast<float>(std::min(through, warmup_steps)) / static_cast<float>(warmup);
  double start = warmup_steps;  // where the decay begins
  if (decay == LrDecay::kConstant) return lr;
  if (decay == LrDecay::kWsd)
    start =
        std::max(warmup_steps, total - static_cast<double>(std::llround(decay_fraction * total)));
  const double decay_steps = total - start;
  if (decay_steps <= 0 || done < start) return lr;
  const double progress = std::min(1.0, (done - start) / decay_steps);
  const double left = decay == LrDecay::kCosine ? 0.5 * (1.0 + std::cos(M_PI * progress))
                                                : 1.0 - progress;  // linear, wsd
  return static_cast<float>(lr * (min_ratio + (1.0 - min_ratio) * left));
}

double grad_norm(ThreadPool& pool, ParameterStore& params) {
  const Tensor& g = params.grads();
  return std::sqrt(ops::sum_squares<float>(Exec{&pool, g.device()}, g.data<float>(), g.numel()));
}

double clip_grad_norm(ThreadPool& pool, ParameterStore& params, double max_norm) {
  Tensor& g = params.grads();
  const double norm = grad_norm(pool, params);
  const float coef = clip_coefficient(norm, max_norm);
  if (coef != 1.0f)
    ops::scale_inplace<float>(Exec{&pool, g.device()}, g.data<float>(), coef, g.numel());
  return norm;
}

float clip_coefficient(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.0f;
}

}  // namespace loom
