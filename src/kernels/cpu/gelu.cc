#include "kernels/cpu/gelu.h"

#include <cmath>
#include <type_traits>

#include "kernels/cpu/vec_math.h"

namespace loom::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/π)
constexpr double kCubic = 0.044715;
constexpr int64_t kGrain = 1 << 14;

template <typename Real>
Real gelu_scalar(Real x) {
  const Real u = Real(kSqrt2OverPi) * (x + Real(kCubic) * x * x * x);
  return Real(0.5) * x * (Real(1) + std::tanh(u));
}

// d/dx = (1 + tanh u)/2 + x/2 · (1 - tanh² u) · du/dx,  du/dx = sqrt(2/π)·(1 + 3·0.044715·x²)
template <typename Real>
Real gelu_grad_scalar(Real x, Real dout) {
  const Real u = Real(kSqrt2OverPi) * (x + Real(kCubic) * x * x * x);
  const Real th = std::tanh(u);
  const Real du = Real(kSqrt2OverPi) * (Real(1) + Real(3 * kCubic) * x * x);
  const Real grad = Real(0.5) * (Real(1) + th) + Real(0.5) * x * (Real(1) - th * th) * du;
  return grad * dout;
}

#ifdef __AVX2__
// Float GELU, 8 at a time: std::tanh was most of GELU's time. Same formulas as the generic
// loops below; a tail shorter than 8 is padded into one vector so that every element goes
// through identical code wherever the thread split falls.
inline __m256 gelu_u8(__m256 x) {
  const __m256 x2 = _mm256_mul_ps(x, x);
  const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(float(kCubic)), x2), x, x);
  return _mm256_mul_ps(_mm256_set1_ps(float(kSqrt2OverPi)), inner);
}

inline __m256 gelu_forward8(__m256 x) {
  const __m256 th = vmath::tanh8(gelu_u8(x));
  const __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
  return _mm256_fmadd_ps(half_x, th, half_x);
}

inline __m256 gelu_backward8(__m256 x, __m256 dout) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 th = vmath::tanh8(gelu_u8(x));
  const __m256 x2 = _mm256_mul_ps(x, x);
  const __m256 du = _mm256_mul_ps(_mm256_set1_ps(float(kSqrt2OverPi)),
                                  _mm256_fmadd_ps(_mm256_set1_ps(float(3 * kCubic)), x2, one));
  const __m256 sech2 = _mm256_fnmadd_ps(th, th, one);  // 1 - tanh²
  const __m256 grad = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), sech2), du,
                                      _mm256_mul_ps(half, _mm256_add_ps(one, th)));
  return _mm256_mul_ps(grad, dout);
}
// The same 16 at a time where the CPU has AVX-512: operation for operation the code above, so
// the bits do not depend on the width (Gelu.SixteenLanesGiveTheBitsOfEight). Tails go through
// one masked vector.
__attribute__((target("avx512f"))) inline __m512 gelu_u16(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(float(kCubic)), x2), x, x);
  return _mm512_mul_ps(_mm512_set1_ps(float(kSqrt2OverPi)), inner);
}

__attribute__((target("avx512f"))) inline __m512 gelu_forward16(__m512 x) {
  const __m512 th = vmath::tanh16(gelu_u16(x));
  const __m512 half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
  return _mm512_fmadd_ps(half_x, th, half_x);
}

__attribute__((target("avx512f"))) inline __m512 gelu_backward16(__m512 x, __m512 dout) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  const __m512 th = vmath::tanh16(gelu_u16(x));
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 du = _mm512_mul_ps(_mm512_set1_ps(float(kSqrt2OverPi)),
                                  _mm512_fmadd_ps(_mm512_set1_ps(float(3 * kCubic)), x2, one));
  const __m512 sech2 = _mm512_fnmadd_ps(th, th, one);
  const __m512 grad = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(half, x), sech2), du,
                                      _mm512_mul_ps(half, _mm512_add_ps(one, th)));
  return _mm512_mul_ps(grad, dout);
}

__attribute__((target("avx512f"))) void gelu_forward16_chunk(float* out, const float* inp,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gelu_forward16(_mm512_loadu_ps(inp + i)));
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, live, gelu_forward16(_mm512_maskz_loadu_ps(live, inp + i)));
  }
}

__attribute__((target("avx512f"))) void gelu_backward16_chunk(float* dinp, const float* inp,
                                                              const float* dout, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dinp + i,
                     gelu_backward16(_mm512_loadu_ps(inp + i), _mm512_loadu_ps(dout + i)));
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dinp + i, live,
                          gelu_backward16(_mm512_maskz_loadu_ps(live, inp + i),
                                          _mm512_maskz_loadu_ps(live, dout + i)));
  }
}

void gelu_forward8_chunk(float* out, const float* inp, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, gelu_forward8(_mm256_loadu_ps(inp + i)));
  if (i < n)
    vmath::store_partial(out + i, gelu_forward8(vmath::load_partial(inp + i, n - i, 0)), n - i);
}

void gelu_backward8_chunk(float* dinp, const float* inp, const float* dout, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dinp + i, gelu_backward8(_mm256_loadu_ps(inp + i), _mm256_loadu_ps(dout + i)));
  if (i < n)
    vmath::store_partial(dinp + i,
                         gelu_backward8(vmath::load_partial(inp + i, n - i, 0),
                                        vmath::load_partial(dout + i, n - i, 0)),
                         n - i);
}
#endif

}  // namespace

namespace detail {

void gelu_forward_chunk(float* out, const float* inp, int64_t n, bool sixteen_lanes) {
#ifdef __AVX2__
  if (sixteen_lanes && has_avx512f())
    gelu_forward16_chunk(out, inp, n);
  else
    gelu_forward8_chunk(out, inp, n);
#else
  (void)sixteen_lanes;
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_scalar(inp[i]);
#endif
}

void gelu_backward_chunk(float* dinp, const float* inp, const float* dout, int64_t n,
                         bool sixteen_lanes) {
#ifdef __AVX2__
  if (sixteen_lanes && has_avx512f())
    gelu_backward16_chunk(dinp, inp, dout, n);
  else
    gelu_backward8_chunk(dinp, inp, dout, n);
#else
  (void)sixteen_lanes;
  for (int64_t i = 0; i < n; ++i) dinp[i] = gelu_grad_scalar(inp[i], dout[i]);
#endif
}

template <typename Real>
void gelu_forward_row(Real* out, const Real* inp, int64_t n) {
  if constexpr (std::is_same_v<Real, float>)
    gelu_forward_chunk(out, inp, n, true);
  else
    for (int64_t i = 0; i < n; ++i) out[i] = gelu_scalar(inp[i]);
}

template <typename Real>
void gelu_backward_row(Real* dinp, const Real* inp, const Real* dout, int64_t n) {
  if constexpr (std::is_same_v<Real, float>)
    gelu_backward_chunk(dinp, inp, dout, n, true);
  else
    for (int64_t i = 0; i < n; ++i) dinp[i] = gelu_grad_scalar(inp[i], dout[i]);
}

template void gelu_forward_row<float>(float*, const float*, int64_t);
template void gelu_forward_row<double>(double*, const double*, int64_t);
template void gelu_backward_row<float>(float*, const float*, const float*, int64_t);
template void gelu_backward_row<double>(double*, const double*, const double*, int64_t);

}  // namespace detail

template <typename Real>
void gelu_forward(ThreadPool& pool, Real* out, const Real* inp, int64_t n) {
  if constexpr (std::is_same_v<Real, float>) {
    pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
      detail::gelu_forward_chunk(out + i0, inp + i0, i1 - i0, true);
    });
    return;
  }
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = gelu_scalar(inp[i]);
  });
}

template <typename Real>
void gelu_backward(ThreadPool& pool, Real* dinp, const Real* inp, const Real* dout, int64_t n) {
  if constexpr (std::is_same_v<Real, float>) {
    pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
      detail::gelu_backward_chunk(dinp + i0, inp + i0, dout + i0, i1 - i0, true);
    });
    return;
  }
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dinp[i] = gelu_grad_scalar(inp[i], dout[i]);
  });
}

template void gelu_forward<float>(ThreadPool&, float*, const float*, int64_t);
template void gelu_forward<double>(ThreadPool&, double*, const double*, int64_t);
template void gelu_backward<float>(ThreadPool&, float*, const float*, const float*, int64_t);
template void gelu_backward<double>(ThreadPool&, double*, const double*, const double*, int64_t);

}  // namespace loom::cpu
