// RMSNorm: one warp per row, as layernorm.cu (the row is read from L1/L2 again in each pass), and
// the weight gradient as fixed-order column sums, from the dinp kernel's own read of dout and the
// input where a lane's sums fit in registers. Same formulas as the CPU kernel: rstd =
// 1/sqrt(mean(x²) + eps), and dinp = rstd · (g - n · mean(g ∘ n)) with n = x·rstd and g =
// weight ∘ dout. A row split over a tensor-parallel group (rmsnorm_forward_of_sums and
// rmsnorm_backward_of_dots) takes its Σx² or Σ weight·dout·x over the whole row from `sums`, the
// group's sum of rmsnorm_partial_sums, instead of its own warp sum, over C_full columns.
#include "base/error.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

// (Names distinct from layernorm.cu's: the kernel files share one translation unit.)
constexpr int kRmsWarpsPerBlock = 8;

// `Out`: float, or the 16-bit type of the GEMM operand it feeds (rounded from the same float).
// `sums`: null, or the split rows' Σx² over C_full columns.
template <typename Out>
__global__ void rmsnorm_forward_kernel(Out* out, float* rstd, const float* inp, const float* weight,
                                       const float* sums, int64_t N, int64_t C, int64_t C_full,
                                       float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRmsWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  const int lane = threadIdx.x % 32;
  const float* x = inp + r * C;
  float ms;
  if (sums != nullptr) {
    ms = sums[r] / static_cast<float>(C_full);
  } else {
    float q = 0.0f;
    for (int64_t c = lane; c < C; c += 32) q += x[c] * x[c];
    ms = warp_sum(q) / static_cast<float>(C);
  }
  const float rs = 1.0f / sqrtf(ms + eps);
  Out* y = out + r * C;
  for (int64_t c = lane; c < C; c += 32) round_to(y[c], x[c] * rs * weight[c]);
  if (lane == 0) rstd[r] = rs;
}

// One row r's dinp, by a warp. dresidual, when non-null, is added to dinp with __fadd_rn (never
// contracted into the product before it, so the bits are those of the separate add_inplace).
// visit(j, dout, n) sees each of the lane's values (column lane + 32·j) with its normalised input
// in the first pass — for kCols > 0 over j < kCols unrolled (the caller's per-lane sums stay in
// registers), for kCols = 0 in a loop. `dots`: null, or the split rows' Σ weight·dout·x over
// C_full columns.
template <int kCols, typename Visit>
__device__ void rmsnorm_backward_row(float* dinp, const float* dout, const float* inp,
                                     const float* weight, const float* rstd, const float* dresidual,
                                     const float* dots, int64_t r, int64_t C, int64_t C_full,
                                     Visit&& visit) {
  const int lane = threadIdx.x % 32;
  const float* x = inp + r * C;
  const float* dy = dout + r * C;
  const float s = rstd[r];
  float gn_sum = 0.0f;
  const auto first_pass = [&](int j, int64_t c) {
    const float d = dy[c];
    const float n = x[c] * s;
    gn_sum += weight[c] * d * n;
    visit(j, d, n);
  };
  if constexpr (kCols > 0) {
    LOOM_UNROLL
    for (int j = 0; j < kCols; ++j)
      if (lane + 32 * j < C) first_pass(j, lane + 32 * j);
  } else {
    for (int64_t c = lane; c < C; c += 32) first_pass(0, c);
  }
  const float gn_mean = dots != nullptr ? s * dots[r] / static_cast<float>(C_full)
                                        : warp_sum(gn_sum) / static_cast<float>(C);
  float* dx = dinp + r * C;
  for (int64_t c = lane; c < C; c += 32) {
    const float v = s * (weight[c] * dy[c] - x[c] * s * gn_mean);
    dx[c] = dresidual != nullptr ? __fadd_rn(v, dresidual[r * C + c]) : v;
  }
}

// dinp alone, a warp a row (with the column sums apart: rows wider than the fused kernel takes).
__global__ void rmsnorm_backward_kernel(float* dinp, const float* dout, const float* inp,
                                        const float* weight, const float* rstd,
                                        const float* dresidual, const float* dots, int64_t N,
                                        int64_t C, int64_t C_full) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRmsWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  rmsnorm_backward_row<0>(dinp, dout, inp, weight, rstd, dresidual, dots, r, C, C_full,
                          [](int, float, float) {});
}

// sums[r] = Σ_c a[r,c]·b[r,c]·(weight ? weight[c] : 1), a warp a row.
__global__ void rmsnorm_partial_sums_kernel(float* sums, const float* a, const float* b,
                                            const float* weight, int64_t N, int64_t C) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRmsWarpsPerBlock + threadIdx.x / 32;
  if (r >= N) return;
  const int lane = threadIdx.x % 32;
  float q = 0.0f;
  for (int64_t c = lane; c < C; c += 32)
    q += (weight != nullptr ? weight[c] * a[r * C + c] : a[r * C + c]) * b[r * C + c];
  const float sum = warp_sum(q);
  if (lane == 0) sums[r] = sum;
}

// Rows per warp of the fused backward: its warps' partial weight gradients take N·C /
// kRmsRowsPerWarp · 4 bytes of scratch.
constexpr int kRmsRowsPerWarp = 8;

// dinp as above, and each warp's sums over its rows of dout ∘ n per column — dweight's terms —
// from the same one read of dout and the input. Warp w of block b takes rows b·64 + w, + 8, ...
// and writes its sums as partials[(b·8 + w)·C + c]; column_finish_kernel adds them in that order.
// Columns up to 32·kCols.
template <int kCols>
__global__ void rmsnorm_backward_fused_kernel(float* dinp, float* partials, const float* dout,
                                              const float* inp, const float* weight,
                                              const float* rstd, const float* dresidual,
                                              const float* dots, int64_t N, int64_t C,
                                              int64_t C_full) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float dn_sum[kCols] = {};
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRmsWarpsPerBlock * kRmsRowsPerWarp;
  const int64_t r1 =
      r0 + kRmsWarpsPerBlock * kRmsRowsPerWarp < N ? r0 + kRmsWarpsPerBlock * kRmsRowsPerWarp : N;
  for (int64_t r = r0 + warp; r < r1; r += kRmsWarpsPerBlock)
    rmsnorm_backward_row<kCols>(dinp, dout, inp, weight, rstd, dresidual, dots, r, C, C_full,
                                [&](int j, float d, float n) { dn_sum[j] += d * n; });
  float* out = partials + (static_cast<int64_t>(blockIdx.x) * kRmsWarpsPerBlock + warp) * C;
  LOOM_UNROLL
  for (int j = 0; j < kCols; ++j)
    if (lane + 32 * j < C) out[lane + 32 * j] = dn_sum[j];
}

// dweight's term, dout ∘ n, for the column sums apart.
struct DoutTimesRmsNorm {
  const float* dout;
  const float* inp;
  const float* rstd;
  int64_t C;
  __device__ float operator()(int64_t r, int64_t c) const {
    return dout[r * C + c] * (inp[r * C + c] * rstd[r]);
  }
};

// The fused backward for rows of up to 32·kCols columns, its partials summed after.
template <int kCols>
void rmsnorm_backward_fused(int device, float* dinp, float* dweight, const float* dout,
                            const float* inp, const float* weight, const float* rstd,
                            const float* dresidual, const float* dots, int64_t N, int64_t C,
                            int64_t C_full) {
  const unsigned blocks = blocks_of(N, kRmsWarpsPerBlock * kRmsRowsPerWarp);
  const int64_t warps = static_cast<int64_t>(blocks) * kRmsWarpsPerBlock;
  Scratch<float> partials(device, warps * C);
  launch("rmsnorm_backward", rmsnorm_backward_fused_kernel<kCols>, blocks, kRmsWarpsPerBlock * 32,
         dinp, partials.get(), dout, inp, weight, rstd, dresidual, dots, N, C, C_full);
  launch("rmsnorm_backward (dweight)", column_finish_kernel<float, float*>, blocks_of(C, 256), 256,
         dweight, static_cast<const float*>(partials.get()), warps, C);
}

// The backward's host side, for whole rows (dots null) and split ones.
void backward_rows(int device, float* dinp, float* dweight, const float* dout, const float* inp,
                   const float* weight, const float* rstd, const float* dresidual,
                   const float* dots, int64_t N, int64_t C, int64_t C_full) {
  if (N == 0) return;
  DeviceGuard guard(device);
  // One read of dout and the input for both gradients where a lane's column sums fit in
  // registers (C ≤ 2048); wider rows sum their columns in a pass of their own.
  const int64_t cols = (C + 31) / 32;
  if (cols <= 8)
    return rmsnorm_backward_fused<8>(device, dinp, dweight, dout, inp, weight, rstd, dresidual,
                                     dots, N, C, C_full);
  if (cols <= 24)
    return rmsnorm_backward_fused<24>(device, dinp, dweight, dout, inp, weight, rstd, dresidual,
                                      dots, N, C, C_full);
  if (cols <= 64)
    return rmsnorm_backward_fused<64>(device, dinp, dweight, dout, inp, weight, rstd, dresidual,
                                      dots, N, C, C_full);
  accumulate_column_sums(device, dweight, DoutTimesRmsNorm{dout, inp, rstd, C}, N, C,
                         "rmsnorm_backward (dweight)");
  // Last, so that dinp may alias dout.
  launch("rmsnorm_backward", rmsnorm_backward_kernel, blocks_of(N, kRmsWarpsPerBlock),
         kRmsWarpsPerBlock * 32, dinp, dout, inp, weight, rstd, dresidual, dots, N, C, C_full);
}

}  // namespace

void rmsnorm_forward(int device, float* out, float* rstd, const float* inp, const float* weight,
                     int64_t N, int64_t C, double eps) {
  rmsnorm_forward_of_sums(device, out, rstd, nullptr, inp, weight, N, C, C, eps);
}

GemmOperand rmsnorm_forward_rounded(int device, void* out, float* rstd, const float* inp,
                                    const float* weight, int64_t N, int64_t C, double eps) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("rmsnorm_forward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    if (N > 0)
      launch("rmsnorm_forward (rounded)", rmsnorm_forward_kernel<Half>,
             blocks_of(N, kRmsWarpsPerBlock), kRmsWarpsPerBlock * 32, static_cast<Half*>(out), rstd,
             inp, weight, static_cast<const float*>(nullptr), N, C, C, static_cast<float>(eps));
  });
  return GemmOperand(out, precision);
}

void rmsnorm_backward_adding(int device, float* dinp, float* dweight, const float* dout,
                             const float* inp, const float* weight, const float* rstd,
                             const float* dresidual, int64_t N, int64_t C) {
  backward_rows(device, dinp, dweight, dout, inp, weight, rstd, dresidual, nullptr, N, C, C);
}

void rmsnorm_backward(int device, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  backward_rows(device, dinp, dweight, dout, inp, weight, rstd, nullptr, nullptr, N, C, C);
}

void rmsnorm_partial_sums(int device, float* sums, const float* a, const float* b,
                          const float* weight, int64_t N, int64_t C) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("rmsnorm_partial_sums", rmsnorm_partial_sums_kernel, blocks_of(N, kRmsWarpsPerBlock),
         kRmsWarpsPerBlock * 32, sums, a, b, weight, N, C);
}

void rmsnorm_forward_of_sums(int device, float* out, float* rstd, const float* sums,
                             const float* inp, const float* weight, int64_t N, int64_t C,
                             int64_t C_full, double eps) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("rmsnorm_forward", rmsnorm_forward_kernel<float>, blocks_of(N, kRmsWarpsPerBlock),
         kRmsWarpsPerBlock * 32, out, rstd, inp, weight, sums, N, C, C_full,
         static_cast<float>(eps));
}

void rmsnorm_backward_of_dots(int device, float* dinp, float* dweight, const float* dout,
                              const float* inp, const float* weight, const float* rstd,
                              const float* dots, int64_t N, int64_t C, int64_t C_full) {
  backward_rows(device, dinp, dweight, dout, inp, weight, rstd, nullptr, dots, N, C, C_full);
}

}  // namespace loom::cuda
