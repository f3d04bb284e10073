#include "kernels/cpu/adamw.h"

#include <cmath>

#include "base/check.h"
#include "kernels/adamw_factors.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace loom::cpu {
namespace {

template <typename Real>
using Factors = AdamWFactors<Real>;

// a·b + c, fused (one rounding) where the build targets FMA, as the AVX2 loop below is; two
// roundings elsewhere, where a libm fma call would be slow.
template <typename Real>
inline Real mul_add(Real a, Real b, Real c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// One element; the operations (and their fusion) mirror the AVX2 loop below.
template <typename Real>
inline void update_one(const Factors<Real>& f, Real& param, Real grad, Real& m, Real& v) {
  const Real g = grad * f.grad_scale;
  const Real diff = g - m;
  const Real mi = f.lerp_from_m ? mul_add(diff, f.w1, m) : mul_add(-diff, f.one_minus_w1, g);
  const Real vi = mul_add(v, f.b2, (f.w2 * g) * g);
  const Real denom = std::sqrt(vi) / f.bc2_sqrt + f.eps;
  param = mul_add(param, f.decay, -((mi / denom) * f.step_size));
  m = mi;
  v = vi;
}

template <typename Real>
void update_range(const Factors<Real>& f, Real* param, const Real* grad, Real* m, Real* v,
                  int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) update_one(f, param[i], grad[i], m[i], v[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats at a time: memory-bound (4 streams in, 3 out), where the scalar loop was not.
void update_range(const Factors<float>& f, float* param, const float* grad, float* m, float* v,
                  int64_t i0, int64_t i1) {
  const __m256 decay = _mm256_set1_ps(f.decay), w1 = _mm256_set1_ps(f.w1);
  const __m256 one_minus_w1 = _mm256_set1_ps(f.one_minus_w1), b2 = _mm256_set1_ps(f.b2);
  const __m256 w2 = _mm256_set1_ps(f.w2), step_size = _mm256_set1_ps(f.step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(f.bc2_sqrt), eps = _mm256_set1_ps(f.eps);
  const __m256 grad_scale = _mm256_set1_ps(f.grad_scale);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), grad_scale);
    const __m256 mo = _mm256_loadu_ps(m + i);
    const __m256 diff = _mm256_sub_ps(g, mo);
    const __m256 mi = f.lerp_from_m ? _mm256_fmadd_ps(diff, w1, mo)
                                    : _mm256_fnmadd_ps(diff, one_minus_w1, g);
    const __m256 vi =
        _mm256_fmadd_ps(_mm256_loadu_ps(v + i), b2, _mm256_mul_ps(_mm256_mul_ps(w2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2_sqrt), eps);
    const __m256 u = _mm256_mul_ps(_mm256_div_ps(mi, denom), step_size);
    _mm256_storeu_ps(param + i, _mm256_fmsub_ps(_mm256_loadu_ps(param + i), decay, u));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  for (; i < i1; ++i) update_one(f, param[i], grad[i], m[i], v[i]);
}
#endif

}  // namespace

template <typename Real>
void adamw_update(ThreadPool& pool, Real* param, const Real* grad, Real* m, Real* v, int64_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  int64_t step, Real grad_scale) {
  const Factors<Real> f =
      adamw_factors<Real>(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  pool.parallel_for(n, 1 << 14, [&](int64_t i0, int64_t i1) {
    update_range(f, param, grad, m, v, i0, i1);
  });
}

template void adamw_update<float>(ThreadPool&, float*, const float*, float*, float*, int64_t,
                                  double, double, double, double, double, int64_t, float);
template void adamw_update<double>(ThreadPool&, double*, const double*, double*, double*, int64_t,
                                   double, double, double, double, double, int64_t, double);

}  // namespace loom::cpu
