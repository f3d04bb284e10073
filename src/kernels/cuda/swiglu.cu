// SwiGLU (kernels/cpu/swiglu.h): one thread per (row, hidden column) in a grid-stride loop, the
// sigmoid through expf (accurate to an ulp or two; not __expf), the CPU's formulas. GeGLU's
// gate through gelu.cuh's GELU, the elementwise kernels' and the fused Linear backward's.
#include "base/error.h"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

__device__ inline float swiglu_sigmoid(float a) {
  return 1.0f / (1.0f + expf(-a));
}

// E: float, or the 16-bit type of activations kept as GEMM operands (the fc's rounded output in,
// proj's rounded input out; the backward's dout and dh likewise): widened, computed in fp32,
// rounded once.
template <GatedActivation A, typename E>
__global__ void swiglu_forward_kernel(E* out, const E* h, int64_t N, int64_t H) {
  const int64_t n = N * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / H, j = e % H;
    const float a = widen(h[r * 2 * H + j]), u = widen(h[r * 2 * H + H + j]);
    if constexpr (A == GatedActivation::kGeluTanh)
      round_to(out[e], gelu(a) * u);
    else
      round_to(out[e], a * swiglu_sigmoid(a) * u);
  }
}

// dgate = dout ⊙ up ⊙ s·(1 + a·(1 − s)), dup = dout ⊙ a·s, s = sigmoid(a); GeGLU:
// dgate = gelu'(a)·(dout ⊙ up), dup = dout ⊙ gelu(a).
template <GatedActivation A, typename E>
__global__ void swiglu_backward_kernel(E* dh, const E* dout, const E* h, int64_t N, int64_t H) {
  const int64_t n = N * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / H, j = e % H;
    const float a = widen(h[r * 2 * H + j]), u = widen(h[r * 2 * H + H + j]), dy = widen(dout[e]);
    if constexpr (A == GatedActivation::kGeluTanh) {
      round_to(dh[r * 2 * H + j], gelu_grad(a, dy * u));
      round_to(dh[r * 2 * H + H + j], dy * gelu(a));
    } else {
      const float s = swiglu_sigmoid(a);
      round_to(dh[r * 2 * H + j], dy * u * (s * (1.0f + a * (1.0f - s))));
      round_to(dh[r * 2 * H + H + j], dy * (a * s));
    }
  }
}

// Calls f with std::integral_constant<GatedActivation, act>: one kernel instance per activation.
template <typename F>
void with_activation(GatedActivation act, F&& f) {
  if (act == GatedActivation::kGeluTanh)
    f(std::integral_constant<GatedActivation, GatedActivation::kGeluTanh>{});
  else
    f(std::integral_constant<GatedActivation, GatedActivation::kSilu>{});
}

}  // namespace

void swiglu_forward(int device, float* out, const float* h, int64_t N, int64_t H,
                    GatedActivation act) {
  if (N * H == 0) return;
  DeviceGuard guard(device);
  with_activation(act, [&](auto a) {
    launch("swiglu_forward", swiglu_forward_kernel<decltype(a)::value, float>,
           blocks_for(N * H, kThreads), kThreads, out, h, N, H);
  });
}

void swiglu_backward(int device, float* dh, const float* dout, const float* h, int64_t N, int64_t H,
                     GatedActivation act) {
  if (N * H == 0) return;
  DeviceGuard guard(device);
  with_activation(act, [&](auto a) {
    launch("swiglu_backward", swiglu_backward_kernel<decltype(a)::value, float>,
           blocks_for(N * H, kThreads), kThreads, dh, dout, h, N, H);
  });
}

GemmOperand swiglu_forward_rounded(int device, void* out, const void* h, int64_t N, int64_t H,
                                   GatedActivation act) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("swiglu_forward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    if (N * H > 0)
      with_activation(act, [&](auto a) {
        launch("swiglu_forward (rounded)", swiglu_forward_kernel<decltype(a)::value, Half>,
               blocks_for(N * H, kThreads), kThreads, static_cast<Half*>(out),
               static_cast<const Half*>(h), N, H);
      });
  });
  return GemmOperand(out, precision);
}

GemmOperand swiglu_backward_rounded(int device, void* dh, const void* dout, const void* h,
                                    int64_t N, int64_t H, GatedActivation act) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("swiglu_backward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    if (N * H > 0)
      with_activation(act, [&](auto a) {
        launch("swiglu_backward (rounded)", swiglu_backward_kernel<decltype(a)::value, Half>,
               blocks_for(N * H, kThreads), kThreads, static_cast<Half*>(dh),
               static_cast<const Half*>(dout), static_cast<const Half*>(h), N, H);
      });
  });
  return GemmOperand(dh, precision);
}

}  // namespace loom::cuda
