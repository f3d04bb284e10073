// The scalar factors of one AdamW update (kernels/cpu/adamw.h has the formulas), computed in
// double like PyTorch's Python floats and rounded to Real once per call. Shared by the CPU and
// CUDA updates so that both start from the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "base/check.h"

namespace loom {

template <typename Real>
struct AdamWFactors {
  Real decay, w1, b2, w2, step_size, bc2_sqrt, eps, grad_scale;
  bool lerp_from_m;  // ATen's lerp: a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w)
  Real one_minus_w1;
};

template <typename Real>
AdamWFactors<Real> adamw_factors(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, int64_t step, Real grad_scale) {
  LOOM_CHECK_MSG(step >= 1, "AdamW steps count from 1");
  const double step_d = static_cast<double>(step);
  AdamWFactors<Real> f;
  f.decay = static_cast<Real>(1 - lr * weight_decay);
  f.w1 = static_cast<Real>(1 - beta1);
  f.one_minus_w1 = Real(1) - f.w1;
  f.lerp_from_m = f.w1 < Real(0.5);
  f.b2 = static_cast<Real>(beta2);
  f.w2 = static_cast<Real>(1 - beta2);
  f.step_size = static_cast<Real>(lr / (1 - std::pow(beta1, step_d)));
  f.bc2_sqrt = static_cast<Real>(std::sqrt(1 - std::pow(beta2, step_d)));
  f.eps = static_cast<Real>(eps);
  f.grad_scale = grad_scale;
  return f;
}

// One run of an AdamW update over flat buffers (optim/adamw.h's segments as the kernels see them):
// values[value_offset + i], grads[grad_offset + i] and the moments at state_offset + i for
// i < numel, with weight decay when `decay` is 1. All int64_t: the GPU reads a table of them.
struct AdamWRun {
  int64_t value_offset = 0, grad_offset = 0, state_offset = 0, numel = 0, decay = 0;
  int64_t first_chunk = 0;  // set by number_adamw_chunks
};

// Elements a GPU block updates at a time in ops::adamw_update_runs.
inline constexpr int64_t kAdamWChunk = 4096;

// The chunks of kAdamWChunk elements a run of `numel` takes.
inline int64_t adamw_chunks_of(int64_t numel) {
  return (numel + kAdamWChunk - 1) / kAdamWChunk;
}

// Numbers the runs' chunks one after another (first_chunk) and returns how many there are.
inline int64_t number_adamw_chunks(std::vector<AdamWRun>& runs) {
  int64_t chunks = 0;
  for (AdamWRun& r : runs) {
    r.first_chunk = chunks;
    chunks += adamw_chunks_of(r.numel);
  }
  return chunks;
}

// The chunks of numbered runs, all together.
inline int64_t adamw_chunk_count(const std::vector<AdamWRun>& runs) {
  return runs.empty() ? 0 : runs.back().first_chunk + adamw_chunks_of(runs.back().numel);
}

}  // namespace loom
