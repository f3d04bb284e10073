// RMSNorm over the last dimension (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"; Llama's norm, HF LlamaRMSNorm): LayerNorm without the mean subtraction and the
// bias, x scaled by the reciprocal of its root mean square.
//
// Legend: N = rows (B*T), C = channels.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// out (N, C) = inp · rstd · weight, with rstd (N) = 1/sqrt(mean(inp²) + eps) saved for the
// backward. weight (C).
template <typename Real>
void rmsnorm_forward(ThreadPool& pool, Real* out, Real* rstd, const Real* inp, const Real* weight,
                     int64_t N, int64_t C, double eps);

// dinp (N, C) is overwritten; dweight (C) is accumulated. The result does not depend on
// pool.size(): rows are reduced in fixed chunks whose partial sums are added in chunk order (as
// layernorm_backward).
template <typename Real>
void rmsnorm_backward(ThreadPool& pool, Real* dinp, Real* dweight, const Real* dout,
                      const Real* inp, const Real* weight, const Real* rstd, int64_t N, int64_t C);

// An RMSNorm whose rows a tensor-parallel group splits (OLMo 2's query/key norms over all the
// heads, parallel/tensor_parallel_block.h): each rank holds C of a row's C_full columns, so the
// row's Σx² (forward) and Σ weight·dout·x (backward) are partial sums that the group adds up
// (one value a row) before the rest of the kernel runs on the rank's columns.
//
// sums (N) = Σ_c a[r,c] · b[r,c] · (weight ? weight[c] : 1), in kernels/cpu/reduce.h's order:
// the forward's part (a = b = inp, weight null) or the backward's (a = dout, b = inp).
template <typename Real>
void rmsnorm_partial_sums(ThreadPool& pool, Real* sums, const Real* a, const Real* b,
                          const Real* weight, int64_t N, int64_t C);
// rmsnorm_forward on C columns given the whole rows' Σx² (`sums`): rstd = 1/sqrt(sums/C_full +
// eps). weight is the rank's C columns of it.
template <typename Real>
void rmsnorm_forward_of_sums(ThreadPool& pool, Real* out, Real* rstd, const Real* sums,
                             const Real* inp, const Real* weight, int64_t N, int64_t C,
                             int64_t C_full, double eps);
// rmsnorm_backward on C columns given the whole rows' Σ weight·dout·inp (`dots`): mean(g ∘ n) =
// rstd · dots / C_full. dweight (the rank's C columns) accumulated as rmsnorm_backward's.
template <typename Real>
void rmsnorm_backward_of_dots(ThreadPool& pool, Real* dinp, Real* dweight, const Real* dout,
                              const Real* inp, const Real* weight, const Real* rstd,
                              const Real* dots, int64_t N, int64_t C, int64_t C_full);

}  // namespace loom::cpu
