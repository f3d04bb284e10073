// Loom's own single-precision GEMM for CPUs with AVX-512: a BLIS-style blocked kernel (packed
// operands, a 12 × 32 register tile of fused multiply-adds).
//
// Why our own: OpenBLAS picks its kernels by CPU model at load time, and the Debian build (0.3.21)
// does not know recent Xeons — on one it falls back to its SSE3 "Prescott" kernels, a fifth of
// the machine's speed, unless OPENBLAS_CORETYPE names another CPU in the environment. This kernel
// asks the CPU what it has (cpuid), so the GEMMs run at AVX-512 speed whatever the environment
// says. bench/gemm/compare_libraries.sh measures it against OpenBLAS at its best.
//
// Each element of C is one fixed sequence of operations: the products over k in order, summed by
// FMA into a zeroed accumulator per depth block of kKC, each block's sum then added to C as
// C = beta_here·C + alpha·sum (beta_here = beta for the first block, 1 after; beta == 0 never
// reads C). Nothing depends on where the element sits in a tile or on how the caller split C, so
// any split across threads gives the same bits.
#pragma once

#include <cstdint>

namespace loom::cpu {

// C(M×N) = alpha·op(A)·op(B) + beta·C, row-major, as cblas_sgemm(CblasRowMajor, …); op(X) = Xᵀ
// when trans_x. Runs on the calling thread; packing buffers are per thread, allocated once.
// Throws std::runtime_error on a CPU without AVX-512 F (cpu_features.h: has_avx512f()).
void sgemm_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc);
// With a `bias` (N values, or nullptr; beta must then be 0): C = alpha·op(A)·op(B) + bias in
// every row, added as the first depth block is stored — the bits of C filled with the bias and
// beta = 1, without that pass over C.
// `round_operands_to_bf16`: op(A) and op(B) rounded to bf16 as they are packed (A is then always
// packed), still multiplied by fp32 FMAs — sgemm_bf16_avx512's kernel on CPUs whose vdpbf16ps
// is no faster than their FMAs.
void sgemm_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, const float* bias, bool round_operands_to_bf16 = false);

// Whether sgemm_avx512 reads op(A) in place for a product of these columns (no packing of A):
// gemm() weighs it when choosing how to split C between threads.
bool sgemm_avx512_reads_a_in_place(bool trans_a, int64_t N);

}  // namespace loom::cpu
