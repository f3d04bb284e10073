// GPT-2's GELU (the CPU's tanh form) on the GPU, one definition for the elementwise kernels
// (elementwise.cu) and the Linear backward that folds the GELU's gradient into its own pass
// (matmul.cu), so the two compute the same bits.
#pragma once

#include "kernels/cuda/launch.cuh"

namespace loom::cuda {

#if defined(__CUDACC__) || defined(LOOM_CUDA_EMULATE)
inline constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;

// 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))
__device__ inline float gelu(float x) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

// The gradient at the GELU's input x from `dout`, the gradient at its output:
// d/dx = (1 + tanh u)/2 + x/2 · (1 - tanh² u) · sqrt(2/π)·(1 + 3·0.044715·x²)
__device__ inline float gelu_grad(float x, float dout) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
  const float th = tanhf(u);
  const float du = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du) * dout;
}
#endif

}  // namespace loom::cuda
