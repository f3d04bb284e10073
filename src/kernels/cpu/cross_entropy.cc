#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "base/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/targets.h"

namespace loom::cpu {
namespace {

// On the calling thread: an exception must not escape a pool worker.
void check_targets(const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    if (!is_valid_target(targets[i], V))
      fail("cross_entropy: target ", targets[i], " in row ", i, " is outside the vocabulary [0, ",
           V, ") and not the ignored target ", kIgnoredTarget);
  }
}

}  // namespace

template <typename Real>
void cross_entropy_forward(ThreadPool& pool, Real* losses, Real* lse, const Real* logits,
                           const int32_t* targets, int64_t N, int64_t V) {
  check_targets(targets, N, V);
  pool.parallel_for(N, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* x = logits + r * V;
      // Shifting by the max keeps exp() <= 1. The sum is kept in double: V is large (50257 for
      // GPT-2), and a float sum would drift by ~sqrt(V) ulps.
      Real mx;
      double sum = 0;
      if constexpr (std::is_same_v<Real, float>) {
        // Vectorised exp (vec_math.h): the scalar exp loop dominated this kernel.
        mx = vmath::max_value(x, V);
        sum = vmath::exp_sum(nullptr, x, mx, V);
      } else {
        mx = *std::max_element(x, x + V);
        for (int64_t v = 0; v < V; ++v) sum += static_cast<double>(std::exp(x[v] - mx));
      }
      lse[r] = mx + static_cast<Real>(std::log(sum));
      losses[r] = targets[r] == kIgnoredTarget ? Real(0) : lse[r] - x[targets[r]];
    }
  });
}

template <typename Real>
void cross_entropy_backward(ThreadPool& pool, Real* dlogits, const Real* logits, const Real* lse,
                            const int32_t* targets, Real dloss, int64_t N, int64_t V,
                            float z_loss) {
  check_targets(targets, N, V);
  pool.parallel_for(N, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* x = logits + r * V;
      Real* dx = dlogits + r * V;  // may be x: each element is read before it is written
      if (targets[r] == kIgnoredTarget) {
        std::fill(dx, dx + V, Real(0));
        continue;
      }
      const Real l = lse[r];
      // d(z · lse²)/d logit = 2 · z · lse · softmax: the softmax's factor (exactly dloss at 0).
      const Real softmax_factor = dloss * (Real(1) + Real(2) * static_cast<Real>(z_loss) * l);
      if constexpr (std::is_same_v<Real, float>)
        vmath::exp_shifted(dx, x, l, softmax_factor, V);
      else
        for (int64_t v = 0; v < V; ++v) dx[v] = std::exp(x[v] - l) * softmax_factor;
      dx[targets[r]] -= dloss;
    }
  });
}

template <typename Real>
void lm_head_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* logits, const Real* lse,
                      const int32_t* targets, Real dloss, const Real* inp, const Real* weight,
                      int64_t N, int64_t C, int64_t V, float z_loss) {
  cross_entropy_backward(pool, logits, logits, lse, targets, dloss, N, V, z_loss);
  matmul_backward<Real>(pool, dinp, dweight, nullptr, logits, inp, weight, N, C, V);
}

void lse_square_sum(ThreadPool&, double* result, const float* lse, const float* sum,
                    const int32_t* targets, int64_t N) {
  double total = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoredTarget) continue;
    const double l = sum != nullptr ? lse[i] + std::log(static_cast<double>(sum[i])) : lse[i];
    total += l * l;
  }
  *result = total;
}

template void cross_entropy_forward<float>(ThreadPool&, float*, float*, const float*,
                                           const int32_t*, int64_t, int64_t);
template void cross_entropy_forward<double>(ThreadPool&, double*, double*, const double*,
                                            const int32_t*, int64_t, int64_t);
template void cross_entropy_backward<float>(ThreadPool&, float*, const float*, const float*,
                                            const int32_t*, float, int64_t, int64_t, float);
template void cross_entropy_backward<double>(ThreadPool&, double*, const double*, const double*,
                                             const int32_t*, double, int64_t, int64_t, float);
template void lm_head_backward<float>(ThreadPool&, float*, float*, float*, const float*,
                                      const int32_t*, float, const float*, const float*, int64_t,
                                      int64_t, int64_t, float);
template void lm_head_backward<double>(ThreadPool&, double*, double*, double*, const double*,
                                       const int32_t*, double, const double*, const double*,
                                       int64_t, int64_t, int64_t, float);

}  // namespace loom::cpu
