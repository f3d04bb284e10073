// AdamW, elementwise. The factors come from the same host code as the CPU update
// (kernels/adamw_factors.h) and each element performs the CPU's correctly rounded operations,
// fused where the CPU's FMA build fuses them, so the GPU update is bitwise the CPU's (x86-64-v3
// build) on the same inputs.
#include "kernels/adamw_factors.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

// Element i of one run's update.
__device__ inline void adamw_element(float* param, const float* grad, float* m, float* v, int64_t i,
                                     const AdamWFactors<float>& f) {
  const float g = __fmul_rn(grad[i], f.grad_scale);
  const float mo = m[i];
  const float diff = __fsub_rn(g, mo);
  const float mi = f.lerp_from_m ? __fmaf_rn(diff, f.w1, mo) : __fmaf_rn(-diff, f.one_minus_w1, g);
  const float vi = __fmaf_rn(v[i], f.b2, __fmul_rn(__fmul_rn(f.w2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), f.bc2_sqrt), f.eps);
  const float u = __fmul_rn(__fdiv_rn(mi, denom), f.step_size);
  param[i] = __fmaf_rn(param[i], f.decay, -u);
  m[i] = mi;
  v[i] = vi;
}

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                             AdamWFactors<float> f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    adamw_element(param, grad, m, v, i, f);
}

__global__ void adamw_runs_kernel(float* values, const float* grads, float* m, float* v,
                                  const AdamWRun* runs, int64_t count, int64_t chunks,
                                  AdamWFactors<float> with_decay, AdamWFactors<float> without) {
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    // The run holding this chunk: the last one starting at or before it (empty runs start where
    // the next one does, so they are never it).
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (runs[mid].first_chunk <= chunk)
        lo = mid;
      else
        hi = mid - 1;
    }
    const AdamWRun r = runs[lo];
    const int64_t begin = (chunk - r.first_chunk) * kAdamWChunk;
    const int64_t end = begin + kAdamWChunk < r.numel ? begin + kAdamWChunk : r.numel;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      adamw_element(values + r.value_offset, grads + r.grad_offset, m + r.state_offset,
                    v + r.state_offset, i, r.decay != 0 ? with_decay : without);
  }
}

}  // namespace

void adamw_update(int device, float* param, const float* grad, float* m, float* v, int64_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  int64_t step, float grad_scale) {
  const AdamWFactors<float> f =
      adamw_factors<float>(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("adamw_update", adamw_kernel, blocks_for(n, kThreads), kThreads, param, grad, m, v, n, f);
}

void adamw_update_runs(int device, float* values, const float* grads, float* m, float* v,
                       const AdamWRun* runs, int64_t count, int64_t chunks, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step,
                       float grad_scale) {
  const AdamWFactors<float> with_decay =
      adamw_factors<float>(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const AdamWFactors<float> without =
      adamw_factors<float>(lr, beta1, beta2, eps, 0.0, step, grad_scale);
  if (chunks == 0) return;
  DeviceGuard guard(device);
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  launch("adamw_update", adamw_runs_kernel,
         static_cast<unsigned>(chunks < kMaxBlocks ? chunks : kMaxBlocks), kThreads, values, grads,
         m, v, runs, count, chunks, with_decay, without);
}

}  // namespace loom::cuda
