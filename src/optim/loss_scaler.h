// Loss scaling for gradients computed in a narrow format (fp16 GEMM operands on a GPU,
// runtime.matmul_precision = "fp16"): the backward pass starts from loss × S instead of the
// loss, so that small gradients stay above fp16's underflow; the optimizer then reads the
// gradients times 1/S. A step whose gradients overflowed (a non-finite global norm) is skipped:
// no update, AdamW's step count unchanged, and — dynamic scaling — S halves. After `window`
// consecutive good steps S doubles again (Micikevicius et al., "Mixed precision training", 2018;
// PyTorch's GradScaler, DeepSpeed's and Megatron-LM's dynamic scalers).
//
// S is always a power of two, so scaling and unscaling are exact in binary floating point: a
// run whose gradients never overflow computes bit for bit what the unscaled run computes (every
// backward operation is linear in the incoming gradient, and multiplying by 2^k commutes with
// rounding). Scales are kept in [2^0, 2^64]; at 2^64 the unscaling factor (clip factor / S) stays
// a normal float for any sensible clip.
//
// The scaler holds no tensors and talks to no one: the caller feeds it the global norm, which
// every rank computes identically (parallel/data_parallel.h), so every rank decides the same.
#pragma once

#include <cstdint>
#include <string>

namespace loom {

enum class LossScaleMode { kNone, kStatic, kDynamic };

// "none", "static" or "dynamic"; "auto" is "dynamic" under fp16 GEMMs, else "none". Throws
// loom::Error naming train.loss_scale for anything else.
LossScaleMode parse_loss_scale_mode(const std::string& name, const std::string& matmul_precision);

struct LossScalerConfig {
  LossScaleMode mode = LossScaleMode::kNone;
  double init = 65536;    // the first S (a power of two in [1, 2^64])
  int64_t window = 1000;  // dynamic: good steps in a row before S doubles
  double min = 1;         // dynamic: S never halves below this (a power of two, <= init)
};

// What a checkpoint keeps so that a resumed run scales exactly as the uninterrupted one.
struct LossScalerState {
  double scale = 1;
  int64_t good_steps = 0;  // consecutive finite steps since S last changed
};

class LossScaler {
 public:
  // Throws loom::Error when init/min are not powers of two in range or window < 1.
  explicit LossScaler(const LossScalerConfig& config);

  // The factor the loss's gradient is multiplied by (1 when mode is kNone).
  double scale() const { return state_.scale; }
  bool enabled() const { return config_.mode != LossScaleMode::kNone; }

  // Takes the step's global gradient norm (of the unscaled gradients: any overflow already
  // made it non-finite) and says whether to apply the update. kNone: always true (a non-finite
  // norm then shows as a diverging loss, as without scaling). kStatic: false on a non-finite
  // norm. kDynamic: false on a non-finite norm, and S halves; throws loom::Error when S is
  // already at its minimum (the gradients overflow without any scaling: training diverged).
  bool update(double grad_norm);

  const LossScalerState& state() const { return state_; }
  // Restores a checkpoint's state; throws loom::Error when the scale is not a power of two in
  // range (a corrupt or hand-edited state.json).
  void set_state(const LossScalerState& state);

 private:
  LossScalerConfig config_;
  LossScalerState state_;
};

}  // namespace loom
