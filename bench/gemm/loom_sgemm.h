// An experiment, not part of the build: our own single-threaded fp32 GEMM for AVX2 + FMA CPUs,
// measured against the BLAS libraries by compare_libraries.sh (results in bench/README.md).
// BLIS-style: op(B) packed in KC × NC
// blocks of 16-column micro-panels, op(A) in MC × KC blocks of 6-row micro-panels, and a 6 × 16
// micro-kernel holding C's tile in 12 ymm registers. Row-major, same contract as loom::cpu::gemm_serial.
// Bitwise deterministic: the blocking is fixed, so a product's summation order depends only on
// (M, N, K) and the call's position in C.
#pragma once

#include <cstdint>

namespace loom::cpu {

// True when this build has the AVX2 + FMA kernel and the CPU runs it.
bool sgemm_avx2_available();

// C(M×N) = alpha·op(A)·op(B) + beta·C; beta == 0 ignores C's old contents. Throws when
// sgemm_avx2_available() is false.
void sgemm_avx2(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc);

}  // namespace loom::cpu
