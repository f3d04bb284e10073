// SwiGLU (kernels/cpu/swiglu.h): one thread per (row, hidden column) in a grid-stride loop, the
// sigmoid through expf (accurate to an ulp or two; not __expf), the CPU's formulas.
#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

__device__ inline float swiglu_sigmoid(float a) {
  return 1.0f / (1.0f + expf(-a));
}

__global__ void swiglu_forward_kernel(float* out, const float* h, int64_t N, int64_t H) {
  const int64_t n = N * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / H, j = e % H;
    const float a = h[r * 2 * H + j], u = h[r * 2 * H + H + j];
    out[e] = a * swiglu_sigmoid(a) * u;
  }
}

// dgate = dout ⊙ up ⊙ s·(1 + a·(1 − s)), dup = dout ⊙ a·s, s = sigmoid(a).
__global__ void swiglu_backward_kernel(float* dh, const float* dout, const float* h, int64_t N,
                                       int64_t H) {
  const int64_t n = N * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / H, j = e % H;
    const float a = h[r * 2 * H + j], u = h[r * 2 * H + H + j], dy = dout[e];
    const float s = swiglu_sigmoid(a);
    dh[r * 2 * H + j] = dy * u * (s * (1.0f + a * (1.0f - s)));
    dh[r * 2 * H + H + j] = dy * (a * s);
  }
}

}  // namespace

void swiglu_forward(int device, float* out, const float* h, int64_t N, int64_t H) {
  if (N * H == 0) return;
  DeviceGuard guard(device);
  launch("swiglu_forward", swiglu_forward_kernel, blocks_for(N * H, kThreads), kThreads, out, h, N,
         H);
}

void swiglu_backward(int device, float* dh, const float* dout, const float* h, int64_t N,
                     int64_t H) {
  if (N * H == 0) return;
  DeviceGuard guard(device);
  launch("swiglu_backward", swiglu_backward_kernel, blocks_for(N * H, kThreads), kThreads, dh, dout,
         h, N, H);
}

}  // namespace loom::cuda
