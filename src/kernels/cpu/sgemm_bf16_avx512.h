// Loom's bf16 GEMM for CPUs with AVX-512: fp32 matrices in and out, the operands rounded to bf16
// as they are packed, their products summed in fp32 — the GEMM of PyTorch's bf16 autocast and of
// runtime.matmul_precision = "bf16". Two kernels (bf16_kernel() picks): vdpbf16ps, two bf16
// products added per lane and instruction — twice the FMAs' rate on AMD Zen 4 / 5
// (bench/README.md) — or, where that instruction is missing or slow (half the FMA rate on the
// Xeons we measured), sgemm_avx512's fp32 FMAs on operands rounded to bf16 while packed: the
// same rounding, fp32 speed.
//
// Rounding: each operand to the nearest bf16, ties to even (NaN stays NaN), as PyTorch and CUDA's
// __float2bfloat16_rn do. A bf16 product is exact in fp32. vdpbf16ps adds a pair of products,
// (k even, k odd), into the fp32 accumulator per instruction; the order of k is fixed, so as with
// sgemm_avx512 each element of C is one sequence of operations wherever it sits, and any split of
// C across threads gives the same bits. (vdpbf16ps treats bf16 subnormals, below 1.2e-38, as 0.)
// The two kernels add in different orders, so their results differ in the last bits.
#pragma once

#include <cstdint>

namespace loom::cpu {

// Whether this CPU has AVX512_BF16 (vdpbf16ps).
bool has_avx512_bf16();

enum class Bf16Kernel { kDotProduct, kFmaOnRounded };
// The kernel this process's bf16 GEMMs run: LOOM_CPU_BF16_KERNEL if set ("dot" | "fma"), else
// vdpbf16ps on AMD CPUs that have it and fp32 FMAs elsewhere — by vendor, not by a timing, so a
// run's bits never depend on a measurement. Throws loom::Error naming the variable on another
// value, or on "dot" without AVX512_BF16.
Bf16Kernel bf16_kernel();

// C(M×N) = alpha·bf16(op(A))·bf16(op(B)) + beta·C, row-major, op(X) = Xᵀ when trans_x; with a
// `bias` (N values, beta 0) added to every row as sgemm_avx512 does. Runs on the calling thread;
// packing buffers are per thread, allocated once. Throws std::runtime_error without AVX-512 F
// (or AVX512_BF16 for kDotProduct), or for M, N or K below 1.
void sgemm_bf16_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                       float* C, int64_t ldc, const float* bias = nullptr,
                       Bf16Kernel kernel = bf16_kernel());

// x rounded to bf16 as this kernel rounds its operands, back in fp32 (for references in tests).
float round_to_bf16(float x);

}  // namespace loom::cpu
