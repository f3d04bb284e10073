#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/sgemm_avx512.h"
#include "kernels/cpu/sgemm_bf16_avx512.h"

namespace loom::cpu {
namespace {

// Below this many multiply-adds, waking the pool costs more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 18;
// Blocks of C are whole multiples of this many rows/columns, so every BLAS call but the last
// runs full-width SIMD tiles.
constexpr int64_t kTile = 16;

CBLAS_TRANSPOSE cblas_trans(bool t) {
  return t ? CblasTrans : CblasNoTrans;
}

void blas(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), M, N, K, alpha, A, lda, B, ldb, beta,
              C, ldc);
}

void blas(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
          const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), M, N, K, alpha, A, lda, B, ldb, beta,
              C, ldc);
}

// Set for a run by the trainer (ops::MatmulPrecisionScope), read by every GEMM and Linear on any
// thread: relaxed atomic reads cost nothing and keep the (rare) change race-free.
std::atomic<CpuMatmulPrecision> g_precision{CpuMatmulPrecision::kFp32};
std::atomic<int64_t> g_fp8_block{128};

bool floats_in_bf16() {  // kFp8's GEMMs are bf16 GEMMs on fp8-grid operands
  return g_precision.load(std::memory_order_relaxed) != CpuMatmulPrecision::kFp32;
}

// Whether float GEMMs go through our AVX-512 kernel instead of OpenBLAS (decided once).
bool floats_on_our_kernel() {
  static const bool ours = cpu_gemm_backend() == CpuGemm::kLoomAvx512;
  return ours;
}

// Whether gemm() gives each thread a band of C's rows (else a band of its columns). Every thread
// packs all of the operand that is not split and its share of the other, so split where the
// packing per thread is least: the longer side of C, as a rule (what OpenBLAS packs). Our AVX-512
// kernel reads op(A) in place for narrow products, though, and then only B is packed: a column
// split halves that, where a row split would have each thread pack all of B (for the products
// into a 768-wide C, such as the LM head's dinp, the larger part of their packing).
template <typename Real>
bool split_rows_of_c(int threads, bool trans_a, int64_t M, int64_t N, int64_t K) {
  double a_rows_packed = 1, a_cols_packed = 1;  // op(A) packed (1) or read in place (0)
  if constexpr (std::is_same_v<Real, float>) {
    // (The bf16 kernel packs, and rounds, both operands always.)
    if (floats_on_our_kernel() && !floats_in_bf16()) {
      a_rows_packed = sgemm_avx512_reads_a_in_place(trans_a, N) ? 0 : 1;
      a_cols_packed = sgemm_avx512_reads_a_in_place(trans_a, (N + threads - 1) / threads) ? 0 : 1;
    }
  }
  const double t = threads, m = static_cast<double>(M), n = static_cast<double>(N);
  const double k = static_cast<double>(K);
  const double rows = k * n + a_rows_packed * m / t * k;  // all of B, a share of A
  const double cols = k * n / t + a_cols_packed * m * k;  // a share of B, all of A
  return rows == cols ? M >= N : rows < cols;
}

}  // namespace

CpuGemm cpu_gemm_backend() {
  const char* env = std::getenv("LOOM_CPU_GEMM");
  const std::string choice = env == nullptr ? "" : env;
  if (choice == "openblas") return CpuGemm::kOpenBlas;
  if (choice == "loom") {
    if (!has_avx512f())
      fail(
          "LOOM_CPU_GEMM=loom: Loom's own GEMM kernel needs AVX-512 F, which this CPU lacks; "
          "unset LOOM_CPU_GEMM or set it to openblas");
    return CpuGemm::kLoomAvx512;
  }
  if (!choice.empty())
    fail("LOOM_CPU_GEMM='", choice, "': expected 'loom' (our AVX-512 kernel) or 'openblas'");
  return has_avx512f() ? CpuGemm::kLoomAvx512 : CpuGemm::kOpenBlas;
}

void set_matmul_precision(CpuMatmulPrecision precision) {
  if (precision != CpuMatmulPrecision::kFp32 && !has_avx512f())
    fail(
        "bf16 and fp8 matmul precision on CPU ranks need AVX-512 F (Loom's bf16 GEMM kernel), "
        "which this CPU lacks; use runtime.matmul_precision = \"fp32\"");
  if (precision != CpuMatmulPrecision::kFp32)
    bf16_kernel();  // a bad LOOM_CPU_BF16_KERNEL fails now
  g_precision.store(precision, std::memory_order_relaxed);
}

CpuMatmulPrecision matmul_precision() {
  return g_precision.load(std::memory_order_relaxed);
}

int64_t fp8_block() {
  return matmul_precision() == CpuMatmulPrecision::kFp8
             ? g_fp8_block.load(std::memory_order_relaxed)
             : 0;
}

int64_t fp8_block_setting() {
  return g_fp8_block.load(std::memory_order_relaxed);
}

void set_fp8_block(int64_t block) {
  if (block < 1) fail("fp8 block ", block, ": must be at least 1");
  g_fp8_block.store(block, std::memory_order_relaxed);
}

std::string cpu_gemm_name() {
  if (floats_in_bf16())
    return bf16_kernel() == Bf16Kernel::kDotProduct ? "loom-avx512-bf16-dot"
                                                    : "loom-avx512-bf16-fma";
  if (cpu_gemm_backend() == CpuGemm::kLoomAvx512) return "loom-avx512";
  return std::string("openblas-") + openblas_get_corename();
}

void blas_init_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

template <typename Real>
void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha,
                 const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C,
                 int64_t ldc, const Real* bias) {
  LOOM_CHECK(M >= 0 && N >= 0 && K >= 0);
  LOOM_CHECK_MSG(bias == nullptr || beta == Real(0), "gemm: a bias needs beta == 0");
  if (M == 0 || N == 0) return;
  LOOM_CHECK(ldc >= N);
  if (K == 0) {  // BLAS rejects the zero leading dimensions such a call may carry
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = bias != nullptr   ? bias[j]
                         : beta == Real(0) ? Real(0)
                                           : beta * C[i * ldc + j];
    return;
  }
  // Row-major strides must cover a stored row (BLAS would only print a complaint and return).
  LOOM_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N));
  if constexpr (std::is_same_v<Real, float>) {
    if (floats_in_bf16()) {
      sgemm_bf16_avx512(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias);
      return;
    }
    if (floats_on_our_kernel()) {
      sgemm_avx512(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias);
      return;
    }
  }
  if (bias != nullptr) {  // BLAS has no bias: C filled with it, then added onto
    for (int64_t i = 0; i < M; ++i) std::copy(bias, bias + N, C + i * ldc);
    beta = 1;
  }
  // The LP64 OpenBLAS interface takes int.
  LOOM_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
             ldc <= INT_MAX);
  blas_init_single_threaded();
  blas(trans_a, trans_b, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
       static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

template <typename Real>
void gemm(ThreadPool& pool, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha,
          const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc,
          const Real* bias) {
  if (pool.size() == 1 || M * N * K < kParallelWork) {
    gemm_serial(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias);
    return;
  }
  if (split_rows_of_c<Real>(pool.size(), trans_a, M, N, K)) {
    pool.parallel_for((M + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
      const int64_t m0 = t0 * kTile, m1 = std::min(M, t1 * kTile);
      const Real* A0 =
          trans_a ? A + m0 : A + m0 * lda;  // op(A) row m is A's column m if transposed
      gemm_serial(trans_a, trans_b, m1 - m0, N, K, alpha, A0, lda, B, ldb, beta, C + m0 * ldc, ldc,
                  bias);
    });
  } else {
    pool.parallel_for((N + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * kTile, n1 = std::min(N, t1 * kTile);
      const Real* B0 = trans_b ? B + n0 * ldb : B + n0;
      gemm_serial(trans_a, trans_b, M, n1 - n0, K, alpha, A, lda, B0, ldb, beta, C + n0, ldc,
                  bias == nullptr ? nullptr : bias + n0);
    });
  }
}

template <typename Real>
void matmul_forward(ThreadPool& pool, Real* out, const Real* inp, const Real* weight,
                    const Real* bias, int64_t N, int64_t C, int64_t OC) {
  gemm<Real>(pool, false, true, N, OC, C, 1, inp, C, weight, C, 0, out, OC, bias);
}

template <typename Real>
void matmul_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* dbias, const Real* dout,
                     const Real* inp, const Real* weight, int64_t N, int64_t C, int64_t OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  if (dinp != nullptr) gemm<Real>(pool, false, false, N, C, OC, 1, dout, OC, weight, C, 0, dinp, C);
  // dweight (OC, C) += doutᵀ (OC, N) · inp (N, C)
  if (dweight != nullptr)
    gemm<Real>(pool, true, false, OC, C, N, 1, dout, OC, inp, C, 1, dweight, C);
  if (dbias != nullptr) bias_backward(pool, dbias, dout, N, OC);
}

template <typename Real>
void bias_backward(ThreadPool& pool, Real* dbias, const Real* dout, int64_t N, int64_t OC) {
  // Each thread owns a slice of the output channels and sums all rows in order, so the result
  // does not depend on the pool size and no partial buffers are needed.
  pool.parallel_for(OC, 64, [&](int64_t o0, int64_t o1) {
    std::vector<Real> acc(o1 - o0, Real(0));
    for (int64_t n = 0; n < N; ++n) {
      const Real* row = dout + n * OC + o0;
      for (int64_t o = 0; o < o1 - o0; ++o) acc[o] += row[o];
    }
    for (int64_t o = 0; o < o1 - o0; ++o) dbias[o0 + o] += acc[o];
  });
}

#define LOOM_INSTANTIATE(Real)                                                                    \
  template void gemm<Real>(ThreadPool&, bool, bool, int64_t, int64_t, int64_t, Real, const Real*, \
                           int64_t, const Real*, int64_t, Real, Real*, int64_t, const Real*);     \
  template void gemm_serial<Real>(bool, bool, int64_t, int64_t, int64_t, Real, const Real*,       \
                                  int64_t, const Real*, int64_t, Real, Real*, int64_t,            \
                                  const Real*);                                                   \
  template void matmul_forward<Real>(ThreadPool&, Real*, const Real*, const Real*, const Real*,   \
                                     int64_t, int64_t, int64_t);                                  \
  template void matmul_backward<Real>(ThreadPool&, Real*, Real*, Real*, const Real*, const Real*, \
                                      const Real*, int64_t, int64_t, int64_t);                    \
  template void bias_backward<Real>(ThreadPool&, Real*, const Real*, int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
