#include "kernels/cpu/swiglu.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gelu.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {
namespace {

// Elements per parallel range: rows are split between threads whole, at least this many
// elements at a time.
constexpr int64_t kGrain = 1 << 14;

template <typename Real>
Real sigmoid_scalar(Real a) {
  return Real(1) / (Real(1) + std::exp(-a));
}

template <typename Real>
void swiglu_forward_row(Real* out, const Real* gate, const Real* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid_scalar(gate[i]) * up[i];
}

// silu'(a) = s + a·s·(1 − s) = s·(1 + a·(1 − s)).
template <typename Real>
void swiglu_backward_row(Real* dgate, Real* dup, const Real* dout, const Real* gate, const Real* up,
                         int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const Real a = gate[i], s = sigmoid_scalar(a);
    const Real dsilu = s * (Real(1) + a * (Real(1) - s));
    const Real dy = dout[i];
    dgate[i] = dy * up[i] * dsilu;
    dup[i] = dy * (a * s);
  }
}

#ifdef __AVX2__
// Float SwiGLU, 8 at a time: the exp of the sigmoid would otherwise be a scalar libm call per
// element, most of the op's time. sigmoid(a) = 1/(1 + e^(0 − a)) through vmath::exp8, whose
// clamping gives exactly 0 and 1 far out. A tail shorter than 8 is padded into one vector, so
// every element goes through identical code wherever a row or thread split falls.
inline __m256 sigmoid8(__m256 a) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, vmath::exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
}

inline __m256 swiglu_forward8(__m256 gate, __m256 up) {
  return _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid8(gate)), up);
}

inline void swiglu_backward8(__m256 dout, __m256 gate, __m256 up, __m256& dgate, __m256& dup) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 s = sigmoid8(gate);
  const __m256 dsilu = _mm256_mul_ps(s, _mm256_fmadd_ps(gate, _mm256_sub_ps(one, s), one));
  dgate = _mm256_mul_ps(_mm256_mul_ps(dout, up), dsilu);
  dup = _mm256_mul_ps(dout, _mm256_mul_ps(gate, s));
}

// The same 16 at a time where the CPU has AVX-512: operation for operation the code above (and
// vmath::exp16 exp8's), so the bits do not depend on the width
// (SwiGlu.SixteenLanesGiveTheBitsOfEight). Tails go through one masked vector.
__attribute__((target("avx512f"))) inline __m512 sigmoid16(__m512 a) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one,
                       _mm512_add_ps(one, vmath::exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
}

__attribute__((target("avx512f"))) inline __m512 swiglu_forward16(__m512 gate, __m512 up) {
  return _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid16(gate)), up);
}

__attribute__((target("avx512f"))) inline void swiglu_backward16(__m512 dout, __m512 gate,
                                                                 __m512 up, __m512& dgate,
                                                                 __m512& dup) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 s = sigmoid16(gate);
  const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(gate, _mm512_sub_ps(one, s), one));
  dgate = _mm512_mul_ps(_mm512_mul_ps(dout, up), dsilu);
  dup = _mm512_mul_ps(dout, _mm512_mul_ps(gate, s));
}

__attribute__((target("avx512f"))) void swiglu_forward16_chunk(float* out, const float* gate,
                                                               const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, swiglu_forward16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, live,
                          swiglu_forward16(_mm512_maskz_loadu_ps(live, gate + i),
                                           _mm512_maskz_loadu_ps(live, up + i)));
  }
}

__attribute__((target("avx512f"))) void swiglu_backward16_chunk(float* dgate, float* dup,
                                                                const float* dout,
                                                                const float* gate, const float* up,
                                                                int64_t n) {
  int64_t i = 0;
  __m512 dg, du;
  for (; i + 16 <= n; i += 16) {
    swiglu_backward16(_mm512_loadu_ps(dout + i), _mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i),
                      dg, du);
    _mm512_storeu_ps(dgate + i, dg);
    _mm512_storeu_ps(dup + i, du);
  }
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    swiglu_backward16(_mm512_maskz_loadu_ps(live, dout + i), _mm512_maskz_loadu_ps(live, gate + i),
                      _mm512_maskz_loadu_ps(live, up + i), dg, du);
    _mm512_mask_storeu_ps(dgate + i, live, dg);
    _mm512_mask_storeu_ps(dup + i, live, du);
  }
}

void swiglu_forward8_chunk(float* out, const float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, swiglu_forward8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n)
    vmath::store_partial(out + i,
                         swiglu_forward8(vmath::load_partial(gate + i, n - i, 0),
                                         vmath::load_partial(up + i, n - i, 0)),
                         n - i);
}

void swiglu_backward8_chunk(float* dgate, float* dup, const float* dout, const float* gate,
                            const float* up, int64_t n) {
  int64_t i = 0;
  __m256 dg, du;
  for (; i + 8 <= n; i += 8) {
    swiglu_backward8(_mm256_loadu_ps(dout + i), _mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i),
                     dg, du);
    _mm256_storeu_ps(dgate + i, dg);
    _mm256_storeu_ps(dup + i, du);
  }
  if (i < n) {
    swiglu_backward8(vmath::load_partial(dout + i, n - i, 0),
                     vmath::load_partial(gate + i, n - i, 0), vmath::load_partial(up + i, n - i, 0),
                     dg, du);
    vmath::store_partial(dgate + i, dg, n - i);
    vmath::store_partial(dup + i, du, n - i);
  }
}
#endif

}  // namespace

namespace detail {

void swiglu_forward_chunk(float* out, const float* gate, const float* up, int64_t n,
                          bool sixteen_lanes) {
#ifdef __AVX2__
  if (sixteen_lanes && has_avx512f())
    swiglu_forward16_chunk(out, gate, up, n);
  else
    swiglu_forward8_chunk(out, gate, up, n);
#else
  (void)sixteen_lanes;
  swiglu_forward_row(out, gate, up, n);
#endif
}

void swiglu_backward_chunk(float* dgate, float* dup, const float* dout, const float* gate,
                           const float* up, int64_t n, bool sixteen_lanes) {
#ifdef __AVX2__
  if (sixteen_lanes && has_avx512f())
    swiglu_backward16_chunk(dgate, dup, dout, gate, up, n);
  else
    swiglu_backward8_chunk(dgate, dup, dout, gate, up, n);
#else
  (void)sixteen_lanes;
  swiglu_backward_row(dgate, dup, dout, gate, up, n);
#endif
}

}  // namespace detail

namespace {
// GeGLU's rows: the tanh GELU of the gate through gelu.h's row kernels, times up; the backward
// as the GELU's with dout ⊙ up for its dout. `scratch` holds n values.
template <typename Real>
void geglu_forward_row(Real* out, const Real* gate, const Real* up, int64_t n, Real* scratch) {
  detail::gelu_forward_row(scratch, gate, n);
  for (int64_t i = 0; i < n; ++i) out[i] = scratch[i] * up[i];
}
template <typename Real>
void geglu_backward_row(Real* dgate, Real* dup, const Real* dout, const Real* gate, const Real* up,
                        int64_t n, Real* scratch) {
  detail::gelu_forward_row(scratch, gate, n);
  for (int64_t i = 0; i < n; ++i) dup[i] = dout[i] * scratch[i];
  for (int64_t i = 0; i < n; ++i) scratch[i] = dout[i] * up[i];
  detail::gelu_backward_row(dgate, gate, scratch, n);  // dgate may not alias: scratch is apart
}
}  // namespace

template <typename Real>
void swiglu_forward(ThreadPool& pool, Real* out, const Real* h, int64_t N, int64_t H,
                    GatedActivation act) {
  pool.parallel_for(N, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)),
                    [&](int64_t r0, int64_t r1) {
                      std::vector<Real> scratch(act == GatedActivation::kGeluTanh ? H : 0);
                      for (int64_t r = r0; r < r1; ++r) {
                        const Real* gate = h + r * 2 * H;
                        if (act == GatedActivation::kGeluTanh)
                          geglu_forward_row(out + r * H, gate, gate + H, H, scratch.data());
                        else if constexpr (std::is_same_v<Real, float>)
                          detail::swiglu_forward_chunk(out + r * H, gate, gate + H, H, true);
                        else
                          swiglu_forward_row(out + r * H, gate, gate + H, H);
                      }
                    });
}

template <typename Real>
void swiglu_backward(ThreadPool& pool, Real* dh, const Real* dout, const Real* h, int64_t N,
                     int64_t H, GatedActivation act) {
  pool.parallel_for(
      N, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
        std::vector<Real> scratch(act == GatedActivation::kGeluTanh ? H : 0);
        for (int64_t r = r0; r < r1; ++r) {
          const Real* gate = h + r * 2 * H;
          Real* dgate = dh + r * 2 * H;
          if (act == GatedActivation::kGeluTanh)
            geglu_backward_row(dgate, dgate + H, dout + r * H, gate, gate + H, H, scratch.data());
          else if constexpr (std::is_same_v<Real, float>)
            detail::swiglu_backward_chunk(dgate, dgate + H, dout + r * H, gate, gate + H, H, true);
          else
            swiglu_backward_row(dgate, dgate + H, dout + r * H, gate, gate + H, H);
        }
      });
}

template void swiglu_forward<float>(ThreadPool&, float*, const float*, int64_t, int64_t,
                                    GatedActivation);
template void swiglu_forward<double>(ThreadPool&, double*, const double*, int64_t, int64_t,
                                     GatedActivation);
template void swiglu_backward<float>(ThreadPool&, float*, const float*, const float*, int64_t,
                                     int64_t, GatedActivation);
template void swiglu_backward<double>(ThreadPool&, double*, const double*, const double*, int64_t,
                                      int64_t, GatedActivation);

}  // namespace loom::cpu
