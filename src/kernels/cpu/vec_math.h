// Vectorised exp and tanh for float, for the kernels whose time went into scalar libm calls
// (GELU's tanh, the softmax exp of cross-entropy and attention).
//
// With AVX2 + FMA (the release build targets x86-64-v3) eight floats go through a Cephes-style
// evaluation: exp by range reduction x = n·ln2 + r, |r| <= ln2/2, a degree-6 polynomial for
// e^r and an exact scaling by 2^n; tanh by a small odd polynomial near 0 and 1 - 2/(e^2|x| + 1)
// elsewhere. Measured against std::exp / std::tanh in tests/kernels/vec_math_test.cc: a few
// 1e-7 relative error at most (a couple of ulps). Without AVX2 every function falls back to
// std::exp / std::tanh, chosen at compile time.
//
// Determinism: every element is computed by the same 8-wide code whatever its position — a
// tail shorter than 8 is copied into a padded vector rather than sent down a scalar path — so
// the bits of an element never depend on how a range was split between threads. Reductions
// (exp_sum) use a fixed lane order per call, like reduce.h.
//
// Only float is vectorised: the double paths are what the gradient checks use, and stay exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/cpu_features.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace loom::cpu::vmath {

#ifdef __AVX2__

inline constexpr bool kVectorised = true;

// e^x for 8 floats. NaN in, NaN out; +inf and x > ~88.72 give +inf (overflow), results below
// FLT_MIN come out as correctly scaled subnormals and x < ~-103.97 (or -inf) gives 0.
inline __m256 exp8(__m256 x) {
  // Clamp first so that n = round(x/ln2) stays within [-150, 128]; the constant goes first so
  // that a NaN x passes through max/min unchanged (they return the second operand on NaN).
  x = _mm256_min_ps(_mm256_set1_ps(88.8f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n·ln2 with ln2 split in two (C1 has 9 significant bits, so n·C1 is exact).
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  // Cephes expf minimax polynomial: e^r ≈ 1 + r + r²·P(r).
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 y = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n as two normal powers of two 2^a·2^b (a = n >> 1, b = n - a, both in [-75, 64]): one
  // factor 2^n would leave the exponent field for n = 128 or n < -126. The first product is
  // exact, so the result (subnormal or not) is rounded once.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i a = _mm256_srai_epi32(ni, 1);
  const __m256i b = _mm256_sub_epi32(ni, a);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, pa), pb);
}

// tanh x for 8 floats; NaN in, NaN out, ±inf give ±1.
inline __m256 tanh8(__m256 x) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign_mask, x);
  // |x| >= 0.625: 1 - 2/(e^{2|x|} + 1). No cancellation there (tanh >= 0.55), and for large |x|
  // e^{2|x|} overflows to inf, giving exactly 1.
  const __m256 e = exp8(_mm256_add_ps(ax, ax));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  // |x| < 0.625: Cephes tanhf odd polynomial x + x·z·P(z), z = x², where 1 - 2/(e+1) would
  // lose digits to cancellation.
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  // Evaluated on |x| and the sign put back afterwards, which also keeps tanh(-0) = -0.
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
  // NaN compares false, so it takes the `big` branch, which carries the NaN through exp8.
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_or_ps(_mm256_blendv_ps(big, small, is_small), _mm256_and_ps(sign_mask, x));
}

// The same two functions 16 floats at a time, for CPUs with AVX-512 F (callers check, e.g. with
// cpu_features.h): operation for operation what exp8 / tanh8 do, so every lane's bits are
// identical whichever width computed it.
// (The zero-masked forms with every lane live are the plain instructions; GCC 12 warns about an
// undefined source inside the unmasked intrinsics, a known false positive.)
constexpr __mmask16 kAllLanes = 0xFFFF;

__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_maskz_min_ps(kAllLanes, _mm512_set1_ps(88.8f),
                          _mm512_maskz_max_ps(kAllLanes, _mm512_set1_ps(-104.0f), x));
  const __m512 n =
      _mm512_maskz_roundscale_ps(kAllLanes, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i ni = _mm512_maskz_cvtps_epi32(kAllLanes, n);
  const __m512i a = _mm512_maskz_srai_epi32(kAllLanes, ni, 1);
  const __m512i b = _mm512_sub_epi32(ni, a);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 pa =
      _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, _mm512_add_epi32(a, bias), 23));
  const __m512 pb =
      _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, _mm512_add_epi32(b, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(y, pa), pb);
}

__attribute__((target("avx512f"))) inline __m512 tanh16(__m512 x) {
  const __m512i sign_mask = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 ax =
      _mm512_castsi512_ps(_mm512_maskz_andnot_epi32(kAllLanes, sign_mask, _mm512_castps_si512(x)));
  const __m512 e = exp16(_mm512_add_ps(ax, ax));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), ax, ax);
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  const __m512 chosen = _mm512_mask_blend_ps(is_small, big, small);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(chosen),
                                             _mm512_and_si512(sign_mask, _mm512_castps_si512(x))));
}

// Loads the n < 8 floats at x into a vector padded with `pad`; stores the first n lanes back.
inline __m256 load_partial(const float* x, int64_t n, float pad) {
  alignas(32) float buf[8];
  for (int k = 0; k < 8; ++k) buf[k] = k < n ? x[k] : pad;
  return _mm256_load_ps(buf);
}
inline void store_partial(float* y, __m256 v, int64_t n) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  for (int64_t k = 0; k < n; ++k) y[k] = buf[k];
}

// Sum of the 8 lanes of two 4-double accumulators in a fixed order.
inline double hsum(__m256d lo, __m256d hi) {
  alignas(32) double l[4], h[4];
  _mm256_store_pd(l, lo);
  _mm256_store_pd(h, hi);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((h[0] + h[1]) + (h[2] + h[3]));
}

#else

inline constexpr bool kVectorised = false;

#endif

#ifdef __AVX2__
// exp_shifted's and exp_sum's first n / 16 · 16 elements, 16 at a time: the same lanes in the
// same order as their 8-wide loops (the sum's eight double lanes take elements 0–7 and then
// 8–15 of each 16), so the results are bitwise theirs. Returns how many elements were done.
__attribute__((target("avx512f"))) inline int64_t exp_shifted16(float* y, const float* x,
                                                                float shift, float mul, int64_t n) {
  const __m512 s = _mm512_set1_ps(shift), m = _mm512_set1_ps(mul);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s)), m));
  return i;
}

__attribute__((target("avx512f"))) inline int64_t exp_sum16(float* y, const float* x, float shift,
                                                            int64_t n, __m256d& lo, __m256d& hi) {
  // Zero-masked forms with every lane live, as in exp16, for GCC 12's false warnings.
  constexpr __mmask8 k8 = 0xFF;
  constexpr __mmask8 k4 = 0x0F;
  const __m512 s = _mm512_set1_ps(shift);
  __m512d acc = _mm512_maskz_insertf64x4(k8, _mm512_castpd256_pd512(lo), hi, 1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    if (y) _mm512_storeu_ps(y + i, e);
    const __m256 first = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(k4, _mm512_castps_pd(e), 0));
    const __m256 second =
        _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(k4, _mm512_castps_pd(e), 1));
    acc = _mm512_add_pd(acc, _mm512_maskz_cvtps_pd(k8, first));
    acc = _mm512_add_pd(acc, _mm512_maskz_cvtps_pd(k8, second));
  }
  lo = _mm512_maskz_extractf64x4_pd(k4, acc, 0);
  hi = _mm512_maskz_extractf64x4_pd(k4, acc, 1);
  return i;
}
#endif

// y[i] = e^(x[i] - shift) · mul. y may be x.
inline void exp_shifted(float* y, const float* x, float shift, float mul, int64_t n) {
#ifdef __AVX2__
  const __m256 s = _mm256_set1_ps(shift), m = _mm256_set1_ps(mul);
  int64_t i = has_avx512f() ? exp_shifted16(y, x, shift, mul, n) : 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)), m));
  if (i < n)
    store_partial(y + i, _mm256_mul_ps(exp8(_mm256_sub_ps(load_partial(x + i, n - i, 0), s)), m),
                  n - i);
#else
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - shift) * mul;
#endif
}

// Σ e^(x[i] - shift), accumulated in double (V reaches 50k in a softmax row, where a float sum
// would drift). If y is not null, y[i] = e^(x[i] - shift) is stored too (y may be x).
inline double exp_sum(float* y, const float* x, float shift, int64_t n) {
#ifdef __AVX2__
  const __m256 s = _mm256_set1_ps(shift);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  auto step = [&](__m256 e) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  };
  int64_t i = has_avx512f() ? exp_sum16(y, x, shift, n, lo, hi) : 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    if (y) _mm256_storeu_ps(y + i, e);
    step(e);
  }
  if (i < n) {
    // Padding with -inf makes the unused lanes e^-inf = 0, which leaves the sum unchanged.
    const __m256 e =
        exp8(_mm256_sub_ps(load_partial(x + i, n - i, -std::numeric_limits<float>::infinity()), s));
    if (y) store_partial(y + i, e, n - i);
    step(e);
  }
  return hsum(lo, hi);
#else
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] - shift);
    if (y) y[i] = e;
    sum += static_cast<double>(e);
  }
  return sum;
#endif
}

// max x[i] (n >= 1). Max is exact, so the lane order does not change the result.
inline float max_value(const float* x, int64_t n) {
#ifdef __AVX2__
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    int64_t i = 8;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    alignas(32) float buf[8];
    _mm256_store_ps(buf, m);
    float r = buf[0];
    for (int k = 1; k < 8; ++k) r = buf[k] > r ? buf[k] : r;
    for (; i < n; ++i) r = x[i] > r ? x[i] : r;
    return r;
  }
#endif
  float r = x[0];
  for (int64_t i = 1; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// Elementwise tanh, for the accuracy tests and any caller without a fused loop. y may be x.
inline void tanh_array(float* y, const float* x, int64_t n) {
#ifdef __AVX2__
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, tanh8(_mm256_loadu_ps(x + i)));
  if (i < n) store_partial(y + i, tanh8(load_partial(x + i, n - i, 0)), n - i);
#else
  for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
#endif
}

}  // namespace loom::cpu::vmath
