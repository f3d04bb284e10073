// AdamW, elementwise. The factors come from the same host code as the CPU update
// (kernels/adamw_factors.h) and each element performs the CPU's correctly rounded operations,
// fused where the CPU's FMA build fuses them, so the GPU update is bitwise the CPU's (x86-64-v3
// build) on the same inputs.
#include "kernels/adamw_factors.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                             AdamWFactors<float> f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float g = __fmul_rn(grad[i], f.grad_scale);
    const float mo = m[i];
    const float diff = __fsub_rn(g, mo);
    const float mi =
        f.lerp_from_m ? __fmaf_rn(diff, f.w1, mo) : __fmaf_rn(-diff, f.one_minus_w1, g);
    const float vi = __fmaf_rn(v[i], f.b2, __fmul_rn(__fmul_rn(f.w2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), f.bc2_sqrt), f.eps);
    const float u = __fmul_rn(__fdiv_rn(mi, denom), f.step_size);
    param[i] = __fmaf_rn(param[i], f.decay, -u);
    m[i] = mi;
    v[i] = vi;
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

}  // namespace loom::cuda
