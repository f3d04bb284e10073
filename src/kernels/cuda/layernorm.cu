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

// One row r's dinp, by a warp. dresidual, when non-null, is added to dinp: the gradient of a skip
// connection around the LayerNorm's branch (__fadd_rn: never contracted into the product before
// it, so the bits are those of the separate add). visit(j, dout, n) sees each of the lane's
// values (column lane + 32·j) with its normalised input in the first pass — for kCols > 0 over
// j < kCols unrolled (the caller's per-lane sums stay in registers), for kCols = 0 in a loop.
template <int kCols, typename Visit>
__device__ void layernorm_backward_row(float* dinp, const float* dout, const float* inp,
                                       const float* weight, const float* mean, const float* rstd,
                                       const float* dresidual, int64_t r, int64_t C,
                                       Visit&& visit) {
  const int lane = threadIdx.x % 32;
  const float* x = inp + r * C;
  const float* dy = dout + r * C;
  const float m = mean[r], s = rstd[r];
  float g_sum = 0.0f, gn_sum = 0.0f;
  const auto first_pass = [&](int j, int64_t c) {
    const float d = dy[c];
    const float g = weight[c] * d;
    const float n = (x[c] - m) * s;
    g_sum += g;
    gn_sum += g * n;
    visit(j, d, n);
  };
  if constexpr (kCols > 0) {
    LOOM_UNROLL
    for (int j = 0; j < kCols; ++j)
      if (lane + 32 * j < C) first_pass(j, lane + 32 * j);
  } else {
    for (int64_t c = lane; c < C; c += 32) first_pass(0, c);
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

// dinp alone, a warp a row (with the column sums apart: rows wider than the fused kernel takes).
__global__ void layernorm_backward_kernel(float* dinp, const float* dout, const float* inp,
                                          const float* weight, const float* mean, const float* rstd,
                                          const float* dresidual, int64_t N, int64_t C) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  layernorm_backward_row<0>(dinp, dout, inp, weight, mean, rstd, dresidual, r, C,
                            [](int, float, float) {});
}

// Rows per block of the fused backward (kRowsPerWarp per warp): its warps' partial sums of the
// weight and bias gradients take N·C / kRowsPerWarp · 8 bytes of scratch.
constexpr int kRowsPerWarp = 8;

// dinp as above, and each warp's sums over its rows of dout ∘ n and dout per column — dweight's and
// dbias's terms — from the same one read of dout and the input (the column sums apart read both
// again: 2.4 GB a step at GPT-2 124M, T = 1024, batch 16). Warp w of block b takes rows b·64 + w,
// + 8, ... and writes its sums as partials[(b·8 + w)·C + c]; column_finish_kernel adds them in that
// order. Columns up to 32·kCols.
template <int kCols>
__global__ void layernorm_backward_fused_kernel(float* dinp, ColumnPair* partials,
                                                const float* dout, const float* inp,
                                                const float* weight, const float* mean,
                                                const float* rstd, const float* dresidual,
                                                int64_t N, int64_t C) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float dn_sum[kCols] = {}, d_sum[kCols] = {};
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock * kRowsPerWarp;
  const int64_t r1 =
      r0 + kWarpsPerBlock * kRowsPerWarp < N ? r0 + kWarpsPerBlock * kRowsPerWarp : N;
  for (int64_t r = r0 + warp; r < r1; r += kWarpsPerBlock)
    layernorm_backward_row<kCols>(dinp, dout, inp, weight, mean, rstd, dresidual, r, C,
                                  [&](int j, float d, float n) {
                                    dn_sum[j] += d * n;
                                    d_sum[j] += d;
                                  });
  ColumnPair* out = partials + (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * C;
  LOOM_UNROLL
  for (int j = 0; j < kCols; ++j)
    if (lane + 32 * j < C) out[lane + 32 * j] = ColumnPair{dn_sum[j], d_sum[j]};
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

namespace {
// The fused backward for rows of up to 32·kCols columns, its partials summed after.
template <int kCols>
void layernorm_backward_fused(int device, float* dinp, float* dweight, float* dbias,
                              const float* dout, const float* inp, const float* weight,
                              const float* mean, const float* rstd, const float* dresidual,
                              int64_t N, int64_t C) {
  const unsigned blocks = blocks_of(N, kWarpsPerBlock * kRowsPerWarp);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;
  Scratch<ColumnPair> partials(device, warps * C);
  launch("layernorm_backward", layernorm_backward_fused_kernel<kCols>, blocks, kWarpsPerBlock * 32,
         dinp, partials.get(), dout, inp, weight, mean, rstd, dresidual, N, C);
  launch("layernorm_backward (dweight, dbias)", column_finish_kernel<ColumnPair, ColumnPairOut>,
         blocks_of(C, 256), 256, ColumnPairOut{dweight, dbias},
         static_cast<const ColumnPair*>(partials.get()), warps, C);
}
}  // namespace

void layernorm_backward_adding(int device, float* dinp, float* dweight, float* dbias,
                               const float* dout, const float* inp, const float* weight,
                               const float* mean, const float* rstd, const float* dresidual,
                               int64_t N, int64_t C) {
  if (N == 0) return;
  DeviceGuard guard(device);
  // One read of dout and the input for all three gradients, where a lane's column sums fit in
  // registers (C ≤ 2048: every GPT-2 size); wider rows sum their columns in a pass of their own.
  const int64_t cols = (C + 31) / 32;
  if (cols <= 8)
    return layernorm_backward_fused<8>(device, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                       dresidual, N, C);
  if (cols <= 24)
    return layernorm_backward_fused<24>(device, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                        dresidual, N, C);
  if (cols <= 64)
    return layernorm_backward_fused<64>(device, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                        dresidual, N, C);
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
