// cuda::gemm under the CUDA emulator (LOOM_CUDA_EMULATE), in place of gemm.cu: cuBLASLt needs a
// GPU. The same row-major contract, checked as strictly: the operands must be GPU memory, the
// bias is for unbatched products only, K = 0 is refused. Operands are rounded as the tensor cores
// see them at the process's matmul precision (bf16 and fp16 to nearest even, TF32 to 10 mantissa
// bits), products summed in double and rounded once to fp32; beta = 0 never reads C (it may hold
// anything, as cuBLAS allows). So the emulated GEMM is at least as accurate as the GPU's, and the
// tolerances the CUDA tests allow the GPU hold for it too.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/error.h"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

float round_operand(float x, MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kBf16:
      return __bfloat162float(__float2bfloat16_rn(x));
    case MatmulPrecision::kFp16:
      return __half2float(__float2half_rn(x));
    case MatmulPrecision::kTf32: {
      if (!std::isfinite(x)) return x;
      uint32_t u = 0;
      std::memcpy(&u, &x, sizeof u);
      u = (u + 0x1000u) & ~0x1fffu;  // keep 10 of 23 mantissa bits, rounding half away from zero
      std::memcpy(&x, &u, sizeof x);
      return x;
    }
    case MatmulPrecision::kFp32:
      break;
  }
  return x;
}

void expect_gpu_memory(const void* p, int device, const char* what) {
  cudaPointerAttributes attr{};
  LOOM_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice || attr.device != device)
    fail("cuda::gemm: ", what, " is not memory of GPU cuda:", device);
}

// Element i of operand X as the tensor cores see it at `precision`: already-rounded 16-bit values
// widened, fp32 values rounded here.
float operand_value(const GemmOperand& X, int64_t i, MatmulPrecision precision) {
  switch (X.rounded_to) {
    case MatmulPrecision::kBf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(X.data)[i]);
    case MatmulPrecision::kFp16:
      return __half2float(static_cast<const __half*>(X.data)[i]);
    case MatmulPrecision::kTf32:
    case MatmulPrecision::kFp32:
      break;
  }
  return round_operand(static_cast<const float*>(X.data)[i], precision);
}

// Stores x in the 16-bit type of `precision` as element i of `out`; reads element i of such
// values back widened.
void store_rounded(void* out, int64_t i, float x, MatmulPrecision precision) {
  if (precision == MatmulPrecision::kBf16)
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
  else
    static_cast<__half*>(out)[i] = __float2half_rn(x);
}
float load_rounded(const void* in, int64_t i, MatmulPrecision precision) {
  return precision == MatmulPrecision::kBf16
             ? __bfloat162float(static_cast<const __nv_bfloat16*>(in)[i])
             : __half2float(static_cast<const __half*>(in)[i]);
}

// op(X) as a dense rows × cols row-major matrix of rounded values.
std::vector<float> dense_operand(const GemmOperand& X, int64_t offset, bool trans, int64_t rows,
                                 int64_t cols, int64_t ld, MatmulPrecision precision) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[static_cast<size_t>(r * cols + c)] =
          operand_value(X, offset + (trans ? c * ld + r : r * ld + c), precision);
  return out;
}

// D (and C) on the GPU, or with `into_accumulator` host memory standing for the fp32 accumulator
// of a GEMM whose epilogue writes 16 bits: a GPU holds it in registers, not in memory that the
// caching allocator counts.
void reference_gemm(MatmulPrecision precision, int device, bool trans_a, bool trans_b, int64_t M,
                    int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda, GemmOperand B,
                    int64_t ldb, float beta, const float* C, float* D, int64_t ldc,
                    const float* bias, GemmBatch batch, bool into_accumulator = false) {
  if (M < 0 || N < 0 || K < 0 || batch.count < 1)
    fail("cuda::gemm: bad sizes M=", M, " N=", N, " K=", K, " batch=", batch.count);
  if (M == 0 || N == 0) return;
  if (K == 0) fail("cuda::gemm: K = 0 is not supported (M=", M, " N=", N, ")");
  cuda_emu::note_kernel();  // one cuBLASLt call on a GPU
  if (bias != nullptr && batch.count > 1)
    fail("cuda::gemm: a bias is supported on unbatched GEMMs only");
  A.expect_usable_at(precision, "A");
  B.expect_usable_at(precision, "B");
  DeviceGuard guard(device);
  expect_gpu_memory(A.data, device, "A");
  expect_gpu_memory(B.data, device, "B");
  if (!into_accumulator) {
    expect_gpu_memory(C, device, "C");
    expect_gpu_memory(D, device, "D");
  }
  if (bias != nullptr) expect_gpu_memory(bias, device, "the bias");
  for (int64_t b = 0; b < batch.count; ++b) {
    // Rows of op(A) (M × K) and of op(B)ᵀ (N × K), so each output is a contiguous dot product.
    const std::vector<float> a =
        dense_operand(A, b * batch.stride_a, trans_a, M, K, lda, precision);
    const std::vector<float> bt =
        dense_operand(B, b * batch.stride_b, !trans_b, N, K, ldb, precision);
    const float* c = C + b * batch.stride_c;
    float* d = D + b * batch.stride_c;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        const float* ai = a.data() + i * K;
        const float* bj = bt.data() + j * K;
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(ai[k]) * bj[k];
        double value = static_cast<double>(alpha) * acc;
        if (beta != 0.0f) value += static_cast<double>(beta) * c[i * ldc + j];
        if (bias != nullptr) value += bias[j];
        d[i * ldc + j] = static_cast<float>(value);
      }
    }
  }
}

}  // namespace

void gemm(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc,
          const float* bias, GemmBatch batch) {
  reference_gemm(matmul_precision(), device, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta,
                 C, C, ldc, bias, batch);
}

void gemm_adding(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, const float* addend,
                 float* D, int64_t ldd, const float* bias) {
  reference_gemm(matmul_precision(), device, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 1.0f,
                 addend, D, ldd, bias, GemmBatch{});
}

GemmOperand gemm_rounded_output(int device, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                int64_t K, GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb,
                                void* C, int64_t ldc, const float* bias) {
  const MatmulPrecision precision = check_rounded_output_gemm(M, N, K, A, B);
  DeviceGuard guard(device);
  expect_gpu_memory(C, device, "C");
  if (bias != nullptr) expect_gpu_memory(bias, device, "the bias");
  if (M == 0 || N == 0) return GemmOperand(C, precision);
  // The fp32 result (what the GPU's fp32 accumulator holds, to its rounding), plus the bias as
  // cuBLASLt takes it for a 16-bit output (rounded to that type), then rounded.
  std::vector<float> full(static_cast<size_t>(M * N));
  reference_gemm(precision, device, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f,
                 full.data(), full.data(), N, nullptr, GemmBatch{}, true);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float x = full[static_cast<size_t>(i * N + j)];
      if (bias != nullptr) x += operand_value(GemmOperand(bias), j, precision);
      store_rounded(C, i * ldc + j, x, precision);
    }
  return GemmOperand(C, precision);
}

namespace {

// The GELU epilogues as cuBLASLt documents them: on the fp32 product (the accumulator), the bias
// rounded to the output's type as for gemm_rounded_output, outputs rounded once.
bool emulated_gemm_gelu(bool backward, int device, bool trans_a, bool trans_b, int64_t M, int64_t N,
                        int64_t K, GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D,
                        const void* pre_in, void* pre_out, const float* bias) {
  const MatmulPrecision precision = check_rounded_output_gemm(M, N, K, A, B);
  DeviceGuard guard(device);
  expect_gpu_memory(D, device, "D");
  expect_gpu_memory(backward ? pre_in : pre_out, device, "the GELU's input");
  if (bias != nullptr) expect_gpu_memory(bias, device, "the bias");
  if (M == 0 || N == 0) return true;
  std::vector<float> full(static_cast<size_t>(M * N));  // the accumulator, as above
  reference_gemm(precision, device, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f,
                 full.data(), full.data(), N, nullptr, GemmBatch{}, true);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const int64_t e = i * N + j;
      float x = full[static_cast<size_t>(e)];
      if (backward) {
        store_rounded(D, e, gelu_grad(load_rounded(pre_in, e, precision), x), precision);
        continue;
      }
      if (bias != nullptr) x += operand_value(GemmOperand(bias), j, precision);
      store_rounded(pre_out, e, x, precision);
      store_rounded(D, e, gelu(x), precision);
    }
  return true;
}

}  // namespace

bool gemm_gelu(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D, void* pre,
               const float* bias) {
  return emulated_gemm_gelu(false, device, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, nullptr,
                            pre, bias);
}

bool gemm_gelu_backward(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                        GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D,
                        const void* pre) {
  return emulated_gemm_gelu(true, device, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, pre,
                            nullptr, nullptr);
}

namespace {

// E4M3's value of a byte: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals below
// 2^-6, 0x7F / 0xFF NaN (no infinities).
float e4m3_value(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 7;
  float magnitude = 0;
  if (exponent == 0xF && mantissa == 7)
    magnitude = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  else
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return (bits & 0x80) != 0 ? -magnitude : magnitude;
}

// Row r of an fp8 operand (rows × K) dequantized: each byte's value times its block's scale.
void dequantize_row(const Fp8Operand& X, int64_t rows, int64_t K, int64_t r, double* out) {
  for (int64_t k = 0; k < K; ++k)
    out[k] = static_cast<double>(e4m3_value(X.data[r * K + k])) *
             X.scales[fp8_scale_index(rows, K, X.scaling, r, k)];
}

}  // namespace

void gemm_fp8(int device, int64_t M, int64_t N, int64_t K, const Fp8Operand& A, const Fp8Operand& B,
              float* C) {
  expect_fp8_gemm_shapes(M, N, K, A);
  if (M == 0 || N == 0) return;
  cuda_emu::note_kernel();  // one cuBLASLt call on a GPU
  DeviceGuard guard(device);
  for (const void* p : {static_cast<const void*>(A.data), static_cast<const void*>(A.scales),
                        static_cast<const void*>(B.data), static_cast<const void*>(B.scales),
                        static_cast<const void*>(C)})
    expect_gpu_memory(p, device, "an fp8 GEMM's operand, scales or output");
  // The products of the dequantized values are exact in double; their sums rounded once.
  std::vector<double> a(static_cast<size_t>(K)), b(static_cast<size_t>(N * K));
  for (int64_t j = 0; j < N; ++j) dequantize_row(B, N, K, j, b.data() + j * K);
  for (int64_t i = 0; i < M; ++i) {
    dequantize_row(A, M, K, i, a.data());
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += a[static_cast<size_t>(k)] * b[static_cast<size_t>(j * K + k)];
      C[i * N + j] = static_cast<float>(acc);
    }
  }
}

namespace {
// TFLOP/s of the best of `iters` wall-clock-timed runs of `gemm`, an n×n×n product.
template <typename Gemm>
double best_square_tflops(int64_t n, int iters, Gemm gemm) {
  double best = 0;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    gemm();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (best == 0 || s < best) best = s;
  }
  return 2.0 * static_cast<double>(n) * n * n / best / 1e12;
}
}  // namespace

// The emulator's own rate, for benchmarks run under it (n capped at 256: it is a loop nest).
double measure_gemm_tflops(int device, MatmulPrecision precision, int64_t n, int iters) {
  if (n < 1 || iters < 1) fail("measure_gemm_tflops: n and iters must be positive");
  n = std::min<int64_t>(n, 256);
  DeviceGuard guard(device);
  Scratch<float> a(device, n * n), b(device, n * n), c(device, n * n);
  LOOM_CUDA_CHECK(cudaMemsetAsync(a.get(), 0, static_cast<size_t>(n * n) * 4, nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(b.get(), 0, static_cast<size_t>(n * n) * 4, nullptr));
  return best_square_tflops(n, iters, [&] {
    reference_gemm(precision, device, false, false, n, n, n, 1.0f, a.get(), n, b.get(), n, 0.0f,
                   c.get(), c.get(), n, nullptr, GemmBatch{});
  });
}

double measure_fp8_gemm_tflops(int device, int64_t n, int iters) {
  if (n < 1 || iters < 1 || n % 128 != 0)
    fail("measure_fp8_gemm_tflops: n a positive multiple of 128 and iters positive");
  n = std::min<int64_t>(n, 256);
  DeviceGuard guard(device);
  Scratch<uint8_t> a(device, n * n), b(device, n * n);
  const int64_t a_scales = fp8_scale_count(n, n, Fp8Scaling::kVec128),
                b_scales = fp8_scale_count(n, n, Fp8Scaling::kBlock128);
  Scratch<float> sa(device, a_scales), sb(device, b_scales), c(device, n * n);
  LOOM_CUDA_CHECK(cudaMemsetAsync(a.get(), 0, static_cast<size_t>(n * n), nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(b.get(), 0, static_cast<size_t>(n * n), nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(sa.get(), 0, static_cast<size_t>(a_scales) * 4, nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(sb.get(), 0, static_cast<size_t>(b_scales) * 4, nullptr));
  return best_square_tflops(n, iters, [&] {
    gemm_fp8(device, n, n, n, {a.get(), sa.get(), Fp8Scaling::kVec128},
             {b.get(), sb.get(), Fp8Scaling::kBlock128}, c.get());
  });
}

}  // namespace loom::cuda
