// fp8 GEMM operands on GPUs (runtime.matmul_precision = "fp8"): the CPU ranks' block-scaled
// recipe (DeepSeek-V3's; kernels/cpu/fp8.h) with the same bits. Each block of an operand gets the
// power-of-two scale that fits its largest |value| under E4M3's 448, its values are rounded to
// E4M3 (to nearest even, saturating; subnormal steps of 2^-9) and scaled back. Such a value is
// exact in bf16, so the GEMMs run at bf16 on the quantized operands and their products are exact,
// summed in fp32: what an fp8 tensor-core GEMM with per-block scales computes, up to the order
// of the sums. (The E4M3 tensor-core GEMM itself, cuBLASLt's VEC128 / BLK128x128 scale modes, is
// the next step; these kernels are its quantization and its reference.)
//
// One CUDA block per quantization block: its largest |value| by a block reduction in which a NaN
// wins (the block is then copied as it is, so an overflow still reaches the loss scaler), then
// each value. Activations and output gradients in 1 × b blocks, weights b × b, the weight
// gradient's operands b × 1 (along the tokens): one kernel for all three.
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

constexpr float kFp8Max = 448.0f;  // E4M3's largest finite value
constexpr int kFp8Threads = 256;

__device__ inline uint32_t fp8_bits_of(float x) {
  uint32_t u = 0;
  memcpy(&u, &x, sizeof u);
  return u;
}

__device__ inline float fp8_float_of(uint32_t u) {
  float x = 0;
  memcpy(&x, &u, sizeof x);
  return x;
}

// cpu::round_to_e4m3: the same operations.
__device__ inline float round_to_e4m3(float x) {
  if (x != x) return x;
  const float a = fabsf(x);
  float r = 0.0f;
  if (a >= 0x1p-6f) {  // normal: 3 of the 23 mantissa bits, to nearest even
    uint32_t u = fp8_bits_of(a);
    u += 0x7FFFFu + ((u >> 20) & 1u);
    r = fp8_float_of(u & 0xFFF00000u);
    if (!(r <= kFp8Max)) r = kFp8Max;  // saturate (an infinity too)
  } else {                             // subnormal: multiples of 2^-9, to nearest even
    r = rintf(a * 512.0f) * 0x1p-9f;
  }
  return copysignf(r, x);
}

// The power of two s with amax · s ≤ 448 < amax · 2s (amax > 0, finite), kept a normal float:
// cpu's block_scale, in double, its estimate corrected the same way.
__device__ inline float fp8_block_scale(float amax) {
  const double m = static_cast<double>(amax);
  int k = static_cast<int>(floor(log2(static_cast<double>(kFp8Max) / m)));
  if (m * ldexp(1.0, k) > kFp8Max) --k;
  if (m * ldexp(1.0, k + 1) <= kFp8Max) ++k;
  k = k < -126 ? -126 : (k > 126 ? 126 : k);
  return ldexpf(1.0f, k);
}

// The larger of two |values|, a NaN winning (cpu's reduction: m < |x| || |x| != |x|).
__device__ inline float nan_max(float m, float a) {
  return (a > m || a != a) ? a : m;
}

__global__ void quantize_fp8_kernel(float* out, int64_t ld_out, const float* in, int64_t ld_in,
                                    int64_t rows, int64_t cols, int64_t block_rows,
                                    int64_t block_cols) {
  __shared__ float warp_max[kFp8Threads / 32];
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
  const int64_t q = blockIdx.x, r0 = q / col_blocks * block_rows, c0 = q % col_blocks * block_cols;
  const int64_t nr = rows - r0 < block_rows ? rows - r0 : block_rows;
  const int64_t nc = cols - c0 < block_cols ? cols - c0 : block_cols;
  const int64_t n = nr * nc;
  float m = 0.0f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
    m = nan_max(m, fabsf(in[(r0 + e / nc) * ld_in + c0 + e % nc]));
  for (int offset = 16; offset > 0; offset >>= 1)
    m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  float amax = 0.0f;
  for (int w = 0; w < kFp8Threads / 32; ++w) amax = nan_max(amax, warp_max[w]);
  const bool finite = amax <= 3.40282347e38f;  // not an infinity, not a NaN
  const float s = finite && amax > 0.0f ? fp8_block_scale(amax) : 0.0f;
  const float inverse = s == 0.0f ? 0.0f : 1.0f / s;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t r = r0 + e / nc, c = c0 + e % nc;
    const float x = in[r * ld_in + c];
    out[r * ld_out + c] = s == 0.0f ? x : round_to_e4m3(x * s) * inverse;
  }
}

// Row r, column c of a row-major fp32 matrix: the values whose column sums are dbias.
struct Fp8RowMajor {
  const float* data;
  int64_t ld;
  __device__ float operator()(int64_t r, int64_t c) const { return data[r * ld + c]; }
};

// GEMMs on quantized operands run at bf16 (exact for them) whatever the precision's name.
void expect_bf16_gemms(const char* what) {
  if (matmul_precision() != MatmulPrecision::kBf16)
    fail(what, ": fp8 operands are multiplied by the bf16 GEMM; the matmul precision is not bf16");
}

}  // namespace

void quantize_fp8_blocks(int device, float* out, int64_t ld_out, const float* in, int64_t ld_in,
                         int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  if (block_rows <= 0 || block_cols <= 0 || rows < 0 || cols < 0 || ld_in < cols || ld_out < cols)
    fail("quantize_fp8_blocks: bad shape (", rows, " x ", cols, ", blocks ", block_rows, " x ",
         block_cols, ")");
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(device);
  const int64_t blocks = ((rows + block_rows - 1) / block_rows) *
                         ((cols + block_cols - 1) / block_cols);
  if (blocks > 0x7FFFFFFF) fail("quantize_fp8_blocks: ", blocks, " blocks exceed one grid");
  launch("quantize_fp8_blocks", quantize_fp8_kernel, static_cast<unsigned>(blocks), kFp8Threads,
         out, ld_out, in, ld_in, rows, cols, block_rows, block_cols);
}

void matmul_forward_fp8(int device, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC, int64_t block) {
  expect_bf16_gemms("matmul_forward_fp8");
  DeviceGuard guard(device);
  Scratch<float> xq(device, N * C), wq(device, OC * C);
  quantize_fp8_blocks(device, xq.get(), C, inp, C, N, C, 1, block);
  quantize_fp8_blocks(device, wq.get(), C, weight, C, OC, C, block, block);
  matmul_forward(device, out, xq.get(), wq.get(), bias, N, C, OC);
}

void matmul_backward_fp8(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                         int64_t block) {
  expect_bf16_gemms("matmul_backward_fp8");
  DeviceGuard guard(device);
  Scratch<float> dq(device, N * OC);
  if (dinp != nullptr) {  // dinp (N, C) = dout (N, OC) · weight (OC, C), contraction over OC
    Scratch<float> wq(device, OC * C);
    quantize_fp8_blocks(device, dq.get(), OC, dout, OC, N, OC, 1, block);
    quantize_fp8_blocks(device, wq.get(), C, weight, C, OC, C, block, block);
    gemm(device, false, false, N, C, OC, 1.0f, dq.get(), OC, wq.get(), C, 0.0f, dinp, C);
  }
  // dweight (OC, C) += doutᵀ (OC, N) · inp (N, C), contraction over the N tokens.
  if (dweight != nullptr) {
    Scratch<float> xq(device, N * C);
    quantize_fp8_blocks(device, dq.get(), OC, dout, OC, N, OC, block, 1);
    quantize_fp8_blocks(device, xq.get(), C, inp, C, N, C, block, 1);
    gemm(device, true, false, OC, C, N, 1.0f, dq.get(), OC, xq.get(), C, 1.0f, dweight, C);
  }
  if (dbias != nullptr)  // from the fp32 dout
    accumulate_column_sums(device, dbias, Fp8RowMajor{dout, OC}, N, OC, "matmul_backward (dbias)");
}

}  // namespace loom::cuda
