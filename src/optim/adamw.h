// AdamW (Loshchilov & Hutter, "Decoupled weight decay regularization", 2019), PyTorch's
// semantics, with decoupled weight decay on the parameters whose Parameter::weight_decay is set
// (weight matrices; not biases or LayerNorm gains). State: first and second moments in flat
// buffers parallel to the parameter buffer, plus the step count.
#pragma once

#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/adamw_factors.h"
#include "nn/parameter.h"

namespace loom {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

// A run of elements updated with one weight-decay setting: values[value_offset + i],
// grads[grad_offset + i] and the moments at state_offset + i, for i < numel. ZeRO builds these
// for the pieces of parameters that fall into a rank's shard.
struct AdamWSegment {
  int64_t value_offset = 0;
  int64_t grad_offset = 0;
  int64_t state_offset = 0;
  int64_t numel = 0;
  bool decay = false;
};

class AdamW {
 public:
  // Every parameter of the store, moments in the store's flat layout.
  AdamW(ParameterStore& params, const AdamWConfig& config);
  // Moments of `state_numel` elements for the given segments (a ZeRO shard).
  AdamW(const AdamWConfig& config, std::vector<AdamWSegment> segments, int64_t state_numel,
        Device device);
  // One update with learning rate `lr` from the gradients currently in the store (first form).
  // Gradients are read multiplied by `grad_scale` (a clipping factor; see kernels/cpu/adamw.h).
  void step(ThreadPool& pool, float lr, float grad_scale = 1.0f);
  // One update of the segments' elements of `values` from `grads` (second form).
  void step(ThreadPool& pool, float lr, float* values, const float* grads, float grad_scale = 1.0f);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t step) { step_ = step; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }

 private:
  ParameterStore* params_ = nullptr;  // the first form's store
  void make_runs(const std::vector<AdamWSegment>& segments);

  AdamWConfig config_;
  std::vector<AdamWRun> runs_;  // the segments, numbered in chunks for the GPU's single launch
  Tensor runs_on_gpu_;          // on a GPU: runs_ in its memory (int64), read by every step
  Tensor m_, v_;
  int64_t step_ = 0;
};

// A model's whole (unsharded) state in the flat layout of its ParameterStore: the values and
// AdamW's moments (undefined exp_avg: no optimizer state). Checkpoints read and write it;
// data-parallel ranks under ZeRO assemble it from their shards (parallel/data_parallel.h).
struct FlatModelState {
  Tensor values;
  Tensor exp_avg;
  Tensor exp_avg_sq;
};

// The same state in host memory (a copy of what lives on a GPU; as it is otherwise), for files.
FlatModelState on_host(const FlatModelState& state);

// The learning-rate schedule: linear warm-up over `warmup` steps to `lr`, then `decay`:
//   kCosine    half a cosine from lr to lr·min_ratio at step `total`
//   kLinear    a straight line from lr to lr·min_ratio at step `total`
//   kConstant  lr
//   kWsd       warmup-stable-decay: lr until the last decay_fraction·total steps (never before
//              warm-up ends), then a straight line to lr·min_ratio at `total` — a run can be
//              stopped at the stable phase's end and decayed from a checkpoint later
// A pure function of the step, so a resumed run has the uninterrupted run's rates.
enum class LrDecay { kCosine, kLinear, kConstant, kWsd };
// "cosine", "linear", "constant" or "wsd" (train.lr_schedule); throws loom::Error otherwise.
LrDecay parse_lr_decay(const std::string& name);

struct LrSchedule {
  LrDecay decay = LrDecay::kCosine;
  // The run's length and the warm-up's, in steps of the full batch; `total` is a fraction where
  // a batch-size ramp-up's smaller steps make the run shorter than a whole number of them.
  double total = 0;
  int64_t warmup = 0;
  float lr = 0, min_ratio = 0;
  double decay_fraction = 0.2;  // kWsd only

  // The rate at step `step` (0-based): at_progress(step, step + 1).
  float at(int64_t step) const;
  // The rate of a step that begins `done` full batches into the run and ends `through` full
  // batches into it: a batch-size ramp-up's steps are fractions of one, so the schedule follows
  // the sequences consumed (Megatron-LM's schedules by samples). Warm-up to `through` (never past
  // lr), the decay from `done`.
  float at_progress(double done, double through) const;
};

// The global L2 norm of all gradients; when max_norm > 0 and the norm exceeds it, scales every
// gradient by max_norm / norm. Returns the norm before clipping.
double clip_grad_norm(ThreadPool& pool, ParameterStore& params, double max_norm);

// The global L2 norm of all gradients, which are left as they are.
double grad_norm(ThreadPool& pool, ParameterStore& params);

// The factor clip_grad_norm scales gradients by for a global norm `norm` (1 when no clipping):
// for callers that compute the norm of sharded gradients themselves.
float clip_coefficient(double norm, double max_norm);

}  // namespace loom
