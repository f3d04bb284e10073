// fp8 GEMM operands on CPU ranks (runtime.matmul_precision = "fp8"): the block-scaled recipe of
// DeepSeek-V3, emulated. Every Linear's GEMM operands are rounded to fp8 E4M3 (OCP "E4M3FN": 3
// mantissa bits, largest ±448, no infinities), each block of them scaled first so that its largest
// |value| fits: activations and output gradients in 1 × b blocks along the contraction (the row
// of a token, b channels), weights in b × b blocks — so one quantized weight serves the forward
// GEMM and the input-gradient GEMM — and, for the weight gradient, whose contraction runs over
// tokens, the output gradient and the input in b × 1 blocks (b tokens of one channel).
//
// Scales are powers of two, so an fp8 value divided by its scale is exact in fp32 and in bf16:
// the quantized operands are handed to the bf16 GEMM (sgemm_bf16_avx512.h), whose rounding then
// changes nothing, and the products are exact and summed in fp32 — what an fp8 tensor-core GEMM
// with per-block scales computes, up to the order of the fp32 sums. Speed is the bf16 GEMM's
// plus the quantization passes; no CPU multiplies fp8 faster.
//
// Why blocks: a block never straddles a tensor-parallel shard when b divides every shard's width
// (config validation), and a block's scale depends on its own values only, so every layout
// quantizes exactly as one device does.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

inline constexpr float kE4m3Max = 448.0f;

// x rounded to the nearest E4M3 value, ties to even; beyond ±448 saturated to ±448 (E4M3FN has
// no infinity); NaN stays NaN; below 2^-6 the subnormal steps of 2^-9.
float round_to_e4m3(float x);

// Each block_rows × block_cols block of the rows × cols matrix `in` (row stride ld_in; edge
// blocks smaller) quantized: with s = 2^floor(log2(448 / amax)), amax its largest |value|,
// out = round_to_e4m3(x · s) / s. A block of zeros stays zeros; a block holding an infinity or a
// NaN is copied as it is (so an overflow still reaches the loss scaler). out may not alias in.
void quantize_fp8_blocks(ThreadPool& pool, float* out, int64_t ld_out, const float* in,
                         int64_t ld_in, int64_t rows, int64_t cols, int64_t block_rows,
                         int64_t block_cols);

// The Linear (matmul_forward / matmul_backward of gemm.h) with its GEMM operands quantized in
// blocks of `block` as above, on the bf16 GEMM: forward inp (1 × block) · weight (block × block);
// backward dinp = dout (1 × block) · weight (block × block), dweight += dout (block × 1)ᵀ · inp
// (block × 1). The bias and its gradient stay fp32. Scratch buffers are per thread, reused.
void matmul_forward_fp8(ThreadPool& pool, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC, int64_t block);
void matmul_backward_fp8(ThreadPool& pool, float* dinp, float* dweight, float* dbias,
                         const float* dout, const float* inp, const float* weight, int64_t N,
                         int64_t C, int64_t OC, int64_t block);

}  // namespace loom::cpu
