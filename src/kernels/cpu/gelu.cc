#include "kernels/cpu/gelu.h"

#include <cmath>

namespace loom::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/π)
constexpr double kCubic = 0.044715;
constexpr int64_t kGrain = 1 << 14;

}  // namespace

template <typename Real>
void gelu_forward(ThreadPool& pool, Real* out, const Real* inp, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Real x = inp[i];
      const Real u = Real(kSqrt2OverPi) * (x + Real(kCubic) * x * x * x);
      out[i] = Real(0.5) * x * (Real(1) + std::tanh(u));
    }
  });
}

// d/dx = (1 + tanh u)/2 + x/2 · (1 - tanh² u) · du/dx,  du/dx = sqrt(2/π)·(1 + 3·0.044715·x²)
template <typename Real>
void gelu_backward(ThreadPool& pool, Real* dinp, const Real* inp, const Real* dout, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Real x = inp[i];
      const Real u = Real(kSqrt2OverPi) * (x + Real(kCubic) * x * x * x);
      const Real th = std::tanh(u);
      const Real du = Real(kSqrt2OverPi) * (Real(1) + Real(3 * kCubic) * x * x);
      const Real grad = Real(0.5) * (Real(1) + th) + Real(0.5) * x * (Real(1) - th * th) * du;
      dinp[i] = grad * dout[i];
    }
  });
}

template void gelu_forward<float>(ThreadPool&, float*, const float*, int64_t);
template void gelu_forward<double>(ThreadPool&, double*, const double*, int64_t);
template void gelu_backward<float>(ThreadPool&, float*, const float*, const float*, int64_t);
template void gelu_backward<double>(ThreadPool&, double*, const double*, const double*, int64_t);

}  // namespace loom::cpu
