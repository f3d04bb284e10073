#include "optim/loss_scaler.h"

#include <cmath>

#include "base/error.h"

namespace loom {

namespace {

constexpr double kMaxScale = 18446744073709551616.0;  // 2^64

bool power_of_two_in_range(double s) {
  if (!(s >= 1 && s <= kMaxScale)) return false;
  int exponent = 0;
  return std::frexp(s, &exponent) == 0.5;
}

}  // namespace

LossScaleMode parse_loss_scale_mode(const std::string& name, const std::string& matmul_precision) {
  if (name == "auto")
    return matmul_precision == "fp16" ? LossScaleMode::kDynamic : LossScaleMode::kNone;
  if (name == "none") return LossScaleMode::kNone;
  if (name == "static") return LossScaleMode::kStatic;
  if (name == "dynamic") return LossScaleMode::kDynamic;
  fail("train.loss_scale = \"", name, "\": expected auto, none, static or dynamic");
}

LossScaler::LossScaler(const LossScalerConfig& config) : config_(config) {
  if (config_.mode == LossScaleMode::kNone) return;  // scale stays 1
  if (!power_of_two_in_range(config_.init))
    fail("train.loss_scale_init = ", config_.init, " must be a power of two in [1, 2^64]");
  if (!power_of_two_in_range(config_.min) || config_.min > config_.init)
    fail("train.loss_scale_min = ", config_.min,
         " must be a power of two in [1, train.loss_scale_init = ", config_.init, "]");
  if (config_.window < 1) fail("train.loss_scale_window = ", config_.window, " must be positive");
  state_.scale = config_.init;
}

bool LossScaler::update(double grad_norm) {
  if (config_.mode == LossScaleMode::kNone) return true;
  if (!std::isfinite(grad_norm)) {
    state_.good_steps = 0;
    if (config_.mode == LossScaleMode::kStatic) return false;
    if (state_.scale <= config_.min)
      fail("the gradients are not finite at the minimum loss scale ", state_.scale,
           " (train.loss_scale_min): training diverged (lower train.lr?)");
    state_.scale /= 2;
    return false;
  }
  if (config_.mode == LossScaleMode::kDynamic && ++state_.good_steps >= config_.window) {
    state_.good_steps = 0;
    if (state_.scale < kMaxScale) state_.scale *= 2;
  }
  return true;
}

void LossScaler::set_state(const LossScalerState& state) {
  if (!power_of_two_in_range(state.scale) || state.good_steps < 0)
    fail("loss scaler state: scale ", state.scale, ", good steps ", state.good_steps,
         ": the scale must be a power of two in [1, 2^64]");
  state_ = enabled() ? state : LossScalerState{};
}

}  // namespace loom
