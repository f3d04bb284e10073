// GELU, tanh approximation (GPT-2; PyTorch nn.GELU(approximate="tanh")):
//   gelu(x) = x/2 · (1 + tanh(sqrt(2/π) · (x + 0.044715·x³)))
//
// n = number of elements.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// out may alias inp.
template <typename Real>
void gelu_forward(ThreadPool& pool, Real* out, const Real* inp, int64_t n);

// dinp is overwritten and may alias dout.
template <typename Real>
void gelu_backward(ThreadPool& pool, Real* dinp, const Real* inp, const Real* dout, int64_t n);

}  // namespace loom::cpu
