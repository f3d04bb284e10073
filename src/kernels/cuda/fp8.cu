// fp8 GEMM operands on GPUs (runtime.matmul_precision = "fp8"): the CPU ranks' block-scaled
// recipe (DeepSeek-V3's; kernels/cpu/fp8.h) with the same bits. Each block of an operand gets the
// power-of-two scale that fits its largest |value| under E4M3's 448, its values are rounded to
// E4M3 (to nearest even, saturating; subnormal steps of 2^-9) and scaled back. Such a value is
// exact in bf16, so the GEMMs run at bf16 on the quantized operands and their products are exact,
// summed in fp32: what an fp8 tensor-core GEMM with per-block scales computes, up to the order
// of the sums. The E4M3 tensor-core GEMM itself (gemm.cu: gemm_fp8, cuBLASLt's VEC128 /
// BLK128x128 scale modes) takes the same values as bytes and scales, from quantize_e4m3 here;
// the Linears below run on it where set_fp8_tensor_cores says so (kernels.h).
//
// One CUDA block per quantization block: its largest |value| by a block reduction in which a NaN
// wins (the block is then copied as it is, so an overflow still reaches the loss scaler), then
// each value. Activations and output gradients in 1 × b blocks, weights b × b, the weight
// gradient's operands b × 1 (along the tokens): one kernel for all three.
#include <atomic>
#include <cmath>
#include <cstdlib>
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

// The largest |value| of the nr × nc values of `in` (row stride ld) from row r0, column c0, a NaN
// winning: by the CUDA block's kFp8Threads threads, `warp_max` their shared scratch; every thread
// gets it.
__device__ float block_amax(float* warp_max, const float* in, int64_t ld, int64_t r0, int64_t c0,
                            int64_t nr, int64_t nc) {
  const int64_t n = nr * nc;
  float m = 0.0f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
    m = nan_max(m, fabsf(in[(r0 + e / nc) * ld + c0 + e % nc]));
  for (int offset = 16; offset > 0; offset >>= 1)
    m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  float amax = 0.0f;
  for (int w = 0; w < kFp8Threads / 32; ++w) amax = nan_max(amax, warp_max[w]);
  return amax;
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
  const float amax = block_amax(warp_max, in, ld_in, r0, c0, nr, nc);
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

// out (rows × cols) += bias, broadcast over the rows.
__global__ void add_bias_kernel(float* out, const float* bias, int64_t rows, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] += bias[i % cols];
}

// An operand quantized for gemm_fp8 into scratch of its own.
struct E4m3Operand {
  Scratch<uint8_t> bytes;
  Scratch<float> scales;
  Fp8Scaling scaling;
  E4m3Operand(int device, const float* in, int64_t rows, int64_t cols, Fp8Scaling s,
              bool transposed = false)
      : bytes(device, rows * cols), scales(device, fp8_scale_count(rows, cols, s)), scaling(s) {
    quantize_e4m3(device, bytes.get(), scales.get(), in, rows, cols, s, transposed);
  }
  Fp8Operand operand() const { return {bytes.get(), scales.get(), scaling}; }
};

// Whether a Linear at fp8 runs on the E4M3 tensor cores (set_fp8_tensor_cores): blocks of 128,
// every contraction a multiple of 16.
bool tensor_core_fp8(int64_t block, int64_t N, int64_t C, int64_t OC) {
  return fp8_tensor_cores() && block == kFp8GemmBlock && N % 16 == 0 && C % 16 == 0 && OC % 16 == 0;
}

// GEMMs on quantized operands run at bf16 (exact for them) whatever the precision's name.
void expect_bf16_gemms(const char* what) {
  if (matmul_precision() != MatmulPrecision::kBf16)
    fail(what, ": fp8 operands are multiplied by the bf16 GEMM; the matmul precision is not bf16");
}

// E4M3's bits of a value round_to_e4m3 gave (|r| ≤ 448, finite): sign, 4 exponent bits (bias 7),
// 3 mantissa bits; below 2^-6 the subnormals, multiples of 2^-9.
__device__ inline uint8_t e4m3_bits(float r) {
  const uint32_t u = fp8_bits_of(r);
  const uint32_t sign = (u >> 24) & 0x80u;
  const float a = fabsf(r);
  uint32_t magnitude = 0;
  if (a >= 0x1p-6f) {
    const uint32_t exponent = ((u >> 23) & 0xFFu) - 127u + 7u;  // 1..15
    magnitude = (exponent << 3) | ((u >> 20) & 7u);
  } else {
    magnitude = static_cast<uint32_t>(a * 512.0f);  // 0..7, exact
  }
  return static_cast<uint8_t>(sign | magnitude);
}

// fp8_scale_index's layout (kernels.h), on both sides: `layout` one of set_fp8_scale_layout's
// variants, v % 2 choosing kVec128's order and v / 2 kBlock128's.
__host__ __device__ inline int64_t scale_index(int64_t rows, int64_t cols, bool vec128, int64_t r,
                                               int64_t c, int layout) {
  const int64_t j = c / kFp8GemmBlock;
  const int64_t col_blocks = (cols + kFp8GemmBlock - 1) / kFp8GemmBlock;
  if (vec128) return layout % 2 == 0 ? r + j * rows : r * col_blocks + j;
  const int64_t i = r / kFp8GemmBlock;
  switch (layout / 2) {
    case 0:
      return i * ((col_blocks + 3) / 4 * 4) + j;  // row blocks apart by col_blocks rounded up to 4
    case 1:
      return i * col_blocks + j;
    default:
      return i + j * ((rows + kFp8GemmBlock - 1) / kFp8GemmBlock);  // row blocks fastest
  }
}

// quantize_fp8_kernel's blocks and values, stored as E4M3 bytes and the scale's reciprocal. The
// operand's (r, c) is in[r·cols + c], or with `transposed` in[c·rows + r] (`in` stored cols ×
// rows).
__global__ void quantize_e4m3_kernel(uint8_t* out, float* scales, const float* in, int64_t rows,
                                     int64_t cols, int64_t block_rows, bool transposed,
                                     int layout) {
  __shared__ float warp_max[kFp8Threads / 32];
  const int64_t block_cols = kFp8GemmBlock;
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
  const int64_t q = blockIdx.x, r0 = q / col_blocks * block_rows, c0 = q % col_blocks * block_cols;
  const int64_t nr = rows - r0 < block_rows ? rows - r0 : block_rows;
  const int64_t nc = cols - c0 < block_cols ? cols - c0 : block_cols;
  const int64_t n = nr * nc;
  const float amax = transposed ? block_amax(warp_max, in, rows, c0, r0, nc, nr)
                                : block_amax(warp_max, in, cols, r0, c0, nr, nc);
  const bool finite = amax <= 3.40282347e38f;  // not an infinity, not a NaN
  const float s = finite && amax > 0.0f ? fp8_block_scale(amax) : 0.0f;
  if (threadIdx.x == 0)
    scales[scale_index(rows, cols, block_rows == 1, r0, c0, layout)] =
        finite ? (s == 0.0f ? 1.0f : 1.0f / s) : 1.0f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t r = r0 + e / nc, c = c0 + e % nc;
    const float x = transposed ? in[c * rows + r] : in[r * cols + c];
    out[r * cols + c] = !finite ? static_cast<uint8_t>(0x7F)  // E4M3's NaN
                                : e4m3_bits(s == 0.0f ? 0.0f : round_to_e4m3(x * s));
  }
}

}  // namespace

namespace {
// LOOM_CUDA_FP8_TENSOR_CORES=1 in the environment turns it on (off until checked on a GPU).
std::atomic<int> tensor_cores{-1};  // -1: not read yet
std::atomic<int> scale_layout{0};
}  // namespace

void set_fp8_scale_layout(int variant) {
  if (variant < 0 || variant >= kFp8ScaleLayouts)
    fail("set_fp8_scale_layout: variant ", variant, " is not in [0, ", kFp8ScaleLayouts, ")");
  scale_layout.store(variant);
}

int fp8_scale_layout() {
  return scale_layout.load();
}

void set_fp8_tensor_cores(bool on) {
  tensor_cores.store(on ? 1 : 0);
}

bool fp8_tensor_cores() {
  int v = tensor_cores.load();
  if (v < 0) {
    const char* env = std::getenv("LOOM_CUDA_FP8_TENSOR_CORES");
    v = env != nullptr && std::strcmp(env, "1") == 0 ? 1 : 0;
    int unset = -1;
    tensor_cores.compare_exchange_strong(unset, v);
    v = tensor_cores.load();
  }
  return v == 1;
}

int64_t fp8_scale_count(int64_t rows, int64_t cols, Fp8Scaling scaling) {
  const int64_t col_blocks = (cols + kFp8GemmBlock - 1) / kFp8GemmBlock;
  if (scaling == Fp8Scaling::kVec128) return rows * col_blocks;
  const int64_t row_blocks = (rows + kFp8GemmBlock - 1) / kFp8GemmBlock;
  return row_blocks * (fp8_scale_layout() / 2 == 0 ? (col_blocks + 3) / 4 * 4 : col_blocks);
}

int64_t fp8_scale_index(int64_t rows, int64_t cols, Fp8Scaling scaling, int64_t r, int64_t c) {
  return scale_index(rows, cols, scaling == Fp8Scaling::kVec128, r, c, fp8_scale_layout());
}

void expect_fp8_gemm_shapes(int64_t M, int64_t N, int64_t K, const Fp8Operand& A) {
  if (M < 0 || N < 0 || K <= 0 || K % 16 != 0)
    fail("cuda::gemm_fp8: bad sizes M=", M, " N=", N, " K=", K, " (K a positive multiple of 16)");
  if (A.scaling != Fp8Scaling::kVec128)
    fail("cuda::gemm_fp8: A's scales are one a row and 128 columns (kVec128)");
}

void quantize_e4m3(int device, uint8_t* out, float* scales, const float* in, int64_t rows,
                   int64_t cols, Fp8Scaling scaling, bool transposed) {
  if (rows < 0 || cols < 0) fail("quantize_e4m3: bad shape (", rows, " x ", cols, ")");
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(device);
  const int64_t block_rows = scaling == Fp8Scaling::kVec128 ? 1 : kFp8GemmBlock;
  const int64_t blocks =
      ((rows + block_rows - 1) / block_rows) * ((cols + kFp8GemmBlock - 1) / kFp8GemmBlock);
  if (blocks > 0x7FFFFFFF) fail("quantize_e4m3: ", blocks, " blocks exceed one grid");
  LOOM_CUDA_CHECK(cudaMemsetAsync(
      scales, 0, static_cast<size_t>(fp8_scale_count(rows, cols, scaling)) * sizeof(float),
      nullptr));
  launch("quantize_e4m3", quantize_e4m3_kernel, static_cast<unsigned>(blocks), kFp8Threads, out,
         scales, in, rows, cols, block_rows, transposed, fp8_scale_layout());
}

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
  if (tensor_core_fp8(block, N, C, OC)) {  // out (N, OC) = inp (N, C) · weight (OC, C)ᵀ
    const E4m3Operand x(device, inp, N, C, Fp8Scaling::kVec128),
        w(device, weight, OC, C, Fp8Scaling::kBlock128);
    gemm_fp8(device, N, OC, C, x.operand(), w.operand(), out);
    if (bias != nullptr)
      launch("matmul_forward_fp8 (bias)", add_bias_kernel, blocks_for(N * OC, 256), 256, out, bias,
             N, OC);
    return;
  }
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
  if (tensor_core_fp8(block, N, C, OC)) {
    if (dinp != nullptr) {  // dinp (N, C) = dout (N, OC) · weight (OC, C): B = weightᵀ (C, OC)
      const E4m3Operand d(device, dout, N, OC, Fp8Scaling::kVec128),
          wt(device, weight, C, OC, Fp8Scaling::kBlock128, true);
      gemm_fp8(device, N, C, OC, d.operand(), wt.operand(), dinp);
    }
    if (dweight != nullptr) {  // dweight (OC, C) += doutᵀ (OC, N) · inpᵀ (C, N)ᵀ, over the tokens
      const E4m3Operand dt(device, dout, OC, N, Fp8Scaling::kVec128, true),
          xt(device, inp, C, N, Fp8Scaling::kVec128, true);
      Scratch<float> product(device, OC * C);
      gemm_fp8(device, OC, C, N, dt.operand(), xt.operand(), product.get());
      add_inplace(device, dweight, product.get(), OC * C);
    }
  } else {
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
  }
  if (dbias != nullptr)  // from the fp32 dout
    accumulate_column_sums(device, dbias, Fp8RowMajor{dout, OC}, N, OC, "matmul_backward (dbias)");
}

}  // namespace loom::cuda
