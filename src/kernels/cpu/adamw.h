// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), with exactly the
// operations, in the same order, of PyTorch's torch.optim.AdamW single-tensor path:
//   param *= 1 - lr·weight_decay
//   m = lerp(m, grad, 1 - beta1)                  (= beta1·m + (1 - beta1)·grad)
//   v = beta2·v + (1 - beta2)·grad²
//   param -= lr / (1 - beta1^step) · m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// Scalar factors are computed in double, like PyTorch's Python floats, then rounded to Real.
//
// `grad_scale` multiplies each gradient as it is read (grad·grad_scale rounded to Real, exactly
// what scaling the gradients in place first would store): gradient clipping folds its factor in
// here instead of making a pass of its own over all gradients.
//
// The float path runs 8 elements at a time with AVX2 + FMA where the build targets it, and the
// scalar path performs the same correctly rounded operations (fma where the vector code fuses),
// so within a build an element's bits do not depend on the path or the thread split. Builds
// without FMA (the sanitizer builds) round a·b + c twice, as before.
//
// n = number of elements.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// Updates param, m and v (n each) in place; step counts from 1 (bias correction).
template <typename Real>
void adamw_update(ThreadPool& pool, Real* param, const Real* grad, Real* m, Real* v, int64_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  int64_t step, Real grad_scale = Real(1));

}  // namespace loom::cpu
