// LayerNorm over the last dimension (PyTorch nn.LayerNorm: biased variance, eps = 1e-5).
//
// Legend: N = rows (B*T), C = channels.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

inline constexpr double kLayerNormEps = 1e-5;

// out (N, C) = (inp - mean) · rstd · weight + bias; mean (N) and rstd (N) = 1/sqrt(var + eps)
// are saved for the backward. weight, bias (C).
template <typename Real>
void layernorm_forward(ThreadPool& pool, Real* out, Real* mean, Real* rstd, const Real* inp,
                       const Real* weight, const Real* bias, int64_t N, int64_t C);

// dinp (N, C) is overwritten; dweight, dbias (C) are accumulated. The result does not depend on
// pool.size(): rows are reduced in fixed chunks whose partial sums are added in chunk order.
template <typename Real>
void layernorm_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* dbias, const Real* dout,
                        const Real* inp, const Real* weight, const Real* mean, const Real* rstd,
                        int64_t N, int64_t C);

}  // namespace loom::cpu
