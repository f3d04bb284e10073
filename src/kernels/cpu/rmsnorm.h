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

}  // namespace loom::cpu
