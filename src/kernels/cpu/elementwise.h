// Elementwise kernels and deterministic reductions over flat arrays of n elements: residual
// adds, gradient accumulation and scaling, and the sums behind gradient-norm clipping and
// loss averaging.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// out = a + b (the residual connection); out may alias a or b.
template <typename Real>
void add_forward(ThreadPool& pool, Real* out, const Real* a, const Real* b, int64_t n);

// acc += x (a residual's gradient flows into both branches).
template <typename Real>
void add_inplace(ThreadPool& pool, Real* acc, const Real* x, int64_t n);

// x *= s
template <typename Real>
void scale_inplace(ThreadPool& pool, Real* x, Real s, int64_t n);

// Σ x² and Σ x, accumulated in double over fixed chunks whose partial sums are added in chunk
// order: the result is bitwise the same for any pool size.
template <typename Real>
double sum_squares(ThreadPool& pool, const Real* x, int64_t n);
template <typename Real>
double sum(ThreadPool& pool, const Real* x, int64_t n);

// Gradients communicated in bf16 (parallel.grad_reduce_dtype): n floats rounded to bf16 (to
// nearest even, tensor/dtype.h's float_to_bf16) into `out`; widened back; widened and added
// into `acc`. `out` / `in` hold bf16 bits.
void round_to_bf16(ThreadPool& pool, uint16_t* out, const float* in, int64_t n);
void widen_bf16(ThreadPool& pool, float* out, const uint16_t* in, int64_t n);
void add_widened_bf16(ThreadPool& pool, float* acc, const uint16_t* in, int64_t n);

namespace detail {
// Σ x[i]², bit for bit detail::lane_dot<double>(x, x, n) (reduce.h), on a CPU with AVX-512 F
// (cpu_features.h: has_avx512f()): what sum_squares<float> runs on such CPUs.
double lane_sum_squares_avx512(const float* x, int64_t n);
}  // namespace detail

}  // namespace loom::cpu
