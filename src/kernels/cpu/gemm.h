// GEMM, and the Linear layer (matmul) built on it.
//
// float GEMMs run on our own AVX-512 kernel (sgemm_avx512.h) where the CPU has AVX-512 F, and on
// OpenBLAS otherwise; double GEMMs (gradient checks) always on OpenBLAS. At bf16 matmul precision
// (set_matmul_precision) every float GEMM rounds its operands to bf16 and sums in fp32 on our
// bf16 kernel (sgemm_bf16_avx512.h). `LOOM_CPU_GEMM=openblas`
// in the environment forces OpenBLAS (to compare the two), `LOOM_CPU_GEMM=loom` insists on ours.
//
// Both run single-threaded under us (see base/thread_pool.h for why): gemm() splits C into one
// block of rows, or of columns when C is wide, per pool thread, each block one serial call. The
// split is a pure function of (M, N, K, pool.size()), so results are bitwise reproducible run to
// run. Our kernel computes each element of C the same way wherever it sits, so its results do not
// depend on the pool size either; OpenBLAS's may differ in the last bits across pool sizes,
// because it handles edge tiles with different micro-kernels.
//
// All matrices are row-major. Legend: N = rows (B*T), C = input channels, OC = output channels.
#pragma once

#include <cstdint>
#include <string>

#include "base/thread_pool.h"

namespace loom::cpu {

enum class CpuGemm { kOpenBlas, kLoomAvx512 };

// Which library runs float GEMMs in this process: LOOM_CPU_GEMM if set ("loom" | "openblas"),
// else our kernel where the CPU has AVX-512 F. Throws loom::Error naming the variable on another
// value, or on "loom" without AVX-512.
CpuGemm cpu_gemm_backend();
// The same for reports: "loom-avx512", or "openblas-" + the kernel set OpenBLAS chose
// ("openblas-Haswell"); at bf16 precision "loom-avx512-bf16-dot" (vdpbf16ps) or
// "loom-avx512-bf16-fma" (fp32 FMAs on rounded operands; sgemm_bf16_avx512.h: bf16_kernel()).
std::string cpu_gemm_name();

// The precision of float GEMMs' operands in this process: kFp32, or kBf16 (rounded to bf16 as
// they are packed, products summed in fp32) — runtime.matmul_precision = "bf16" on CPU ranks
// (ops::set_matmul_precision). Process-wide like the GPUs' setting (kernels/cuda/kernels.h):
// the ranks of one process run one config. It covers every float GEMM: the Linears, the LM head
// and attention's two products, as PyTorch's autocast does; the other kernels stay fp32.
// Setting kBf16 throws loom::Error on a CPU without AVX-512 F.
// kFp8: the bf16 GEMMs, and the Linears' operands quantized to fp8 first (kernels/cpu/fp8.h;
// the Linears ask fp8_block()).
enum class CpuMatmulPrecision { kFp32, kBf16, kFp8 };
void set_matmul_precision(CpuMatmulPrecision precision);
CpuMatmulPrecision matmul_precision();
// At kFp8 the Linears' quantization block (runtime.fp8_block), else 0. set_fp8_block sets it for
// kFp8 (a positive block; throws otherwise).
int64_t fp8_block();
void set_fp8_block(int64_t block);
int64_t fp8_block_setting();  // what set_fp8_block set, whatever the precision

// Makes OpenBLAS single-threaded, once per process. gemm() calls it; call it before using cblas
// directly.
void blas_init_single_threaded();

// C(M×N) = alpha·op(A)·op(B) + beta·C with op(A) M×K and op(B) K×N; op(X) = Xᵀ when trans_x.
// lda/ldb/ldc are the row strides of A, B, C as stored. beta == 0 ignores C's old contents
// (NaN included), as BLAS does. With a `bias` (N values, beta 0): C = alpha·op(A)·op(B) + bias
// in every row — the bits of C filled with the bias and beta = 1; our AVX-512 kernel adds it as
// it stores C instead of in a pass of its own.
template <typename Real>
void gemm(ThreadPool& pool, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha,
          const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc,
          const Real* bias = nullptr);

// The same on the calling thread only, for code already running inside a pool task.
template <typename Real>
void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha,
                 const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C,
                 int64_t ldc, const Real* bias = nullptr);

// Linear layer, PyTorch layout: out = inp · weightᵀ + bias.
// out (N, OC), inp (N, C), weight (OC, C), bias (OC) or nullptr.
template <typename Real>
void matmul_forward(ThreadPool& pool, Real* out, const Real* inp, const Real* weight,
                    const Real* bias, int64_t N, int64_t C, int64_t OC);

// dinp (N, C) is overwritten (nullptr skips it, e.g. for the first layer); dweight (OC, C) and
// dbias (OC, or nullptr) are accumulated, so micro-batches add up without a copy.
template <typename Real>
void matmul_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* dbias, const Real* dout,
                     const Real* inp, const Real* weight, int64_t N, int64_t C, int64_t OC);

// dbias (OC) += the column sums of dout (N, OC): each thread a slice of the channels, its rows
// summed in order, so the result does not depend on the pool size (matmul_backward's bias).
template <typename Real>
void bias_backward(ThreadPool& pool, Real* dbias, const Real* dout, int64_t N, int64_t OC);

}  // namespace loom::cpu
