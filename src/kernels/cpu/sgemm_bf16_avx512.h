// Loom's bf16 GEMM for CPUs with AVX-512: fp32 matrices in and out, the operands rounded to bf16
// as they are packed, their products summed in fp32 — the GEMM of PyTorch's bf16 autocast and of
// runtime.matmul_precision = "bf16". With AVX512_BF16 the kernel's inner loop is vdpbf16ps, which
// does twice the multiply-adds of an fp32 FMA per instruction (bench/README.md); without it a
// slower kernel widens the bf16 pairs back to fp32 for FMAs, with the same rounding of inputs.
//
// Rounding: each operand to the nearest bf16, ties to even (NaN stays NaN), as PyTorch and CUDA's
// __float2bfloat16_rn do. A bf16 product is exact in fp32. vdpbf16ps adds a pair of products,
// (k even, k odd), into the fp32 accumulator per instruction; the order of k is fixed, so as with
// sgemm_avx512 each element of C is one sequence of operations wherever it sits, and any split of
// C across threads gives the same bits. (vdpbf16ps treats bf16 subnormals, below 1.2e-38, as 0.)
#pragma once

#include <cstdint>

namespace loom::cpu {

// Whether this CPU has AVX512_BF16 (vdpbf16ps).
bool has_avx512_bf16();

// C(M×N) = alpha·bf16(op(A))·bf16(op(B)) + beta·C, row-major, op(X) = Xᵀ when trans_x; with a
// `bias` (N values, beta 0) added to every row as sgemm_avx512 does. Runs on the calling thread;
// packing buffers are per thread, allocated once. Throws std::runtime_error without AVX-512 F
// or for M, N or K below 1. `force_widening` runs the kernel without vdpbf16ps even where the CPU
// has it (tests compare the two).
void sgemm_bf16_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                       float* C, int64_t ldc, const float* bias = nullptr,
                       bool force_widening = false);

// x rounded to bf16 as this kernel rounds its operands, back in fp32 (for references in tests).
float round_to_bf16(float x);

}  // namespace loom::cpu
