// LayerNorm: one warp per row (the row is read from L1/L2 again in each pass), and the weight and
// bias gradients as fixed-order column sums (column_sums.cuh). Same formulas as the CPU kernel:
// two-pass variance, and dinp = rstd · (g - mean(g) - n · mean(g ∘ n)) with n the normalised
// input and g = weight ∘ dout.
#include "base/error.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// `Out`: float, or the 16-bit type of the GEMM operand it feeds (rounded from the same float).
template <typename Out>
__global__ void layernorm_forward_kernel(Out* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int64_t N,
                                         int64_t C, float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  const int lane = threadIdx.x % 32;
  const float* x = inp + r * C;
  float s = 0.0f;
  for (int64_t c = lane; c < C; c += 32) s += x[c];
  const float m = warp_sum(s) / static_cast<float>(C);
  float q = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float d = x[c] - m;
    q += d * d;
  }
  const float var = warp_sum(q) / static_cast<float>(C);
  const float rs = 1.0f / sqrtf(var + eps);
  Out* y = out + r * C;
  for (int64_t c = lane; c < C; c += 32) round_to(y[c], (x[c] - m) * rs * weight[c] + bias[c]);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dresidual, when non-null, is added to dinp: the gradient of a skip connection around the
// LayerNorm's branch (__fadd_rn: never contracted into the product before it, so the bits are
// those of the separate add).
__global__ void layernorm_backward_kernel(float* dinp, const float* dout, const float* inp,
                                          const float* weight, const float* mean, const float* rstd,
                                          const float* dresidual, int64_t N, int64_t C) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  const int lane = threadIdx.x % 32;
  const float* x = inp + r * C;
  const float* dy = dout + r * C;
  const float m = mean[r], s = rstd[r];
  float g_sum = 0.0f, gn_sum = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float g = weight[c] * dy[c];
    g_sum += g;
    gn_sum += g * ((x[c] - m) * s);
  }
  const float g_mean = warp_sum(g_sum) / static_cast<float>(C);
  const float gn_mean = warp_sum(gn_sum) / static_cast<float>(C);
  float* dx = dinp + r * C;
  for (int64_t c = lane; c < C; c += 32) {
    const float n = (x[c] - m) * s;
    const float v = s * (weight[c] * dy[c] - g_mean - n * gn_mean);
    dx[c] = dresidual != nullptr ? __fadd_rn(v, dresidual[r * C + c]) : v;
  }
}

// dweight's and dbias's terms, dout ∘ n and dout, from one read of dout and the input.
struct DoutTimesNormAndDout {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int64_t C;
  __device__ ColumnPair operator()(int64_t r, int64_t c) const {
    const float dy = dout[r * C + c];
    return {dy * ((inp[r * C + c] - mean[r]) * rstd[r]), dy};
  }
};

}  // namespace

void layernorm_forward(int device, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("layernorm_forward", layernorm_forward_kernel<float>, blocks_of(N, kWarpsPerBlock),
         kWarpsPerBlock * 32, out, mean, rstd, inp, weight, bias, N, C,
         static_cast<float>(cpu::kLayerNormEps));
}

GemmOperand layernorm_forward_rounded(int device, void* out, float* mean, float* rstd,
                                      const float* inp, const float* weight, const float* bias,
                                      int64_t N, int64_t C) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("layernorm_forward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    if (N > 0)
      launch("layernorm_forward (rounded)", layernorm_forward_kernel<Half>,
             blocks_of(N, kWarpsPerBlock), kWarpsPerBlock * 32, static_cast<Half*>(out), mean, rstd,
             inp, weight, bias, N, C, static_cast<float>(cpu::kLayerNormEps));
  });
  return GemmOperand(out, precision);
}

void layernorm_backward_adding(int device, float* dinp, float* dweight, float* dbias,
                               const float* dout, const float* inp, const float* weight,
                               const float* mean, const float* rstd, const float* dresidual,
                               int64_t N, int64_t C) {
  if (N == 0) return;
  DeviceGuard guard(device);
  accumulate_column_sums(device, ColumnPairOut{dweight, dbias},
                         DoutTimesNormAndDout{dout, inp, mean, rstd, C}, N, C,
                         "layernorm_backward (dweight, dbias)");
  // Last, so that dinp may alias dout.
  launch("layernorm_backward", layernorm_backward_kernel, blocks_of(N, kWarpsPerBlock),
         kWarpsPerBlock * 32, dinp, dout, inp, weight, mean, rstd, dresidual, N, C);
}

void layernorm_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C) {
  layernorm_backward_adding(device, dinp, dweight, dbias, dout, inp, weight, mean, rstd, nullptr, N,
                            C);
}

}  // namespace loom::cuda
