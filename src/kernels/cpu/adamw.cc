#include "kernels/cpu/adamw.h"

#include <cmath>

#include "base/check.h"

namespace loom::cpu {
namespace {

// ATen's lerp: the formula is chosen by the weight so that lerp(a, b, 1) is exactly b.
template <typename Real>
Real lerp(Real a, Real b, Real w) {
  return w < Real(0.5) ? a + w * (b - a) : b - (b - a) * (Real(1) - w);
}

}  // namespace

template <typename Real>
void adamw_update(ThreadPool& pool, Real* param, const Real* grad, Real* m, Real* v, int64_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  int64_t step) {
  LOOM_CHECK_MSG(step >= 1, "AdamW steps count from 1");
  const double step_d = static_cast<double>(step);
  const Real decay = static_cast<Real>(1 - lr * weight_decay);
  const Real w1 = static_cast<Real>(1 - beta1);
  const Real b2 = static_cast<Real>(beta2);
  const Real w2 = static_cast<Real>(1 - beta2);
  const Real step_size = static_cast<Real>(lr / (1 - std::pow(beta1, step_d)));
  const Real bc2_sqrt = static_cast<Real>(std::sqrt(1 - std::pow(beta2, step_d)));
  const Real eps_r = static_cast<Real>(eps);
  pool.parallel_for(n, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Real g = grad[i];
      const Real mi = lerp(m[i], g, w1);
      const Real vi = v[i] * b2 + w2 * g * g;
      const Real denom = std::sqrt(vi) / bc2_sqrt + eps_r;
      param[i] = param[i] * decay - step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
    }
  });
}

template void adamw_update<float>(ThreadPool&, float*, const float*, float*, float*, int64_t,
                                  double, double, double, double, double, int64_t);
template void adamw_update<double>(ThreadPool&, double*, const double*, double*, double*, int64_t,
                                   double, double, double, double, double, int64_t);

}  // namespace loom::cpu
