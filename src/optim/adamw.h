// AdamW (Loshchilov & Hutter, "Decoupled weight decay regularization", 2019), PyTorch's
// semantics, with decoupled weight decay on the parameters whose Parameter::weight_decay is set
// (weight matrices; not biases or LayerNorm gains). State: first and second moments in flat
// buffers parallel to the parameter buffer, plus the step count.
#pragma once

#include "base/thread_pool.h"
#include "nn/parameter.h"

namespace loom {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

class AdamW {
 public:
  AdamW(ParameterStore& params, const AdamWConfig& config);
  // One update with learning rate `lr` from the gradients currently in the store.
  void step(ThreadPool& pool, float lr);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t step) { step_ = step; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }

 private:
  ParameterStore& params_;
  AdamWConfig config_;
  Tensor m_, v_;
  int64_t step_ = 0;
};

// Learning rate at step `step` (0-based): linear warm-up over `warmup` steps to `lr`, then cosine
// decay to lr·min_ratio at step `total`.
float lr_schedule(int64_t step, int64_t total, int64_t warmup, float lr, float min_ratio);

// The global L2 norm of all gradients; when max_norm > 0 and the norm exceeds it, scales every
// gradient by max_norm / norm. Returns the norm before clipping.
double clip_grad_norm(ThreadPool& pool, ParameterStore& params, double max_norm);

}  // namespace loom
