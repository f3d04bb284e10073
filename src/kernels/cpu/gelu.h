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

namespace detail {
// One range of float GELU on the calling thread: 16 lanes at a time where sixteen_lanes and the
// CPU has AVX-512, else 8 (AVX2 builds; scalar otherwise). The two widths give the same bits;
// exposed so that the tests can check that.
void gelu_forward_chunk(float* out, const float* inp, int64_t n, bool sixteen_lanes);
void gelu_backward_chunk(float* dinp, const float* inp, const float* dout, int64_t n,
                         bool sixteen_lanes);
// n elements on the calling thread in any Real, as gelu_forward / gelu_backward compute them
// (GeGLU's rows, cpu/swiglu.h).
template <typename Real>
void gelu_forward_row(Real* out, const Real* inp, int64_t n);
template <typename Real>
void gelu_backward_row(Real* dinp, const Real* inp, const Real* dout, int64_t n);
}  // namespace detail

}  // namespace loom::cpu
