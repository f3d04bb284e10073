#include "kernels/cpu/elementwise.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reduce.h"
#include "tensor/dtype.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom::cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;
// Elements per partial sum of a reduction; fixed so the summation order never changes.
constexpr int64_t kChunk = 1 << 14;

// Σ over chunks of chunk_sum(begin, count), chunks computed in parallel and added in order.
template <typename ChunkSum>
double chunked_sum(ThreadPool& pool, int64_t n, const ChunkSum& chunk_sum) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks);
  pool.parallel_for(chunks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      partial[k] = chunk_sum(k * kChunk, std::min(kChunk, n - k * kChunk));
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

template <typename Real>
void add_forward(ThreadPool& pool, Real* out, const Real* a, const Real* b, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

template <typename Real>
void add_inplace(ThreadPool& pool, Real* acc, const Real* x, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) acc[i] += x[i];
  });
}

void round_to_bf16(ThreadPool& pool, uint16_t* out, const float* in, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = float_to_bf16(in[i]);
  });
}

void widen_bf16(ThreadPool& pool, float* out, const uint16_t* in, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = bf16_to_float(in[i]);
  });
}

void add_widened_bf16(ThreadPool& pool, float* acc, const uint16_t* in, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) acc[i] += bf16_to_float(in[i]);
  });
}

template <typename Real>
void scale_inplace(ThreadPool& pool, Real* x, Real s, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] *= s;
  });
}

namespace detail {

#if defined(__x86_64__)
// The eight double lanes of lane_dot are one zmm register: lane k still takes i ≡ k mod 8 and
// adds its squares in order, and the lanes combine as combine_lanes does. A float's square is
// exact in double, so whether the compiler fuses the multiply into the add changes nothing
// either. The portable loop runs at ~6 GB/s from memory (converting 4 floats a register, and the
// loads waiting on each other's misses); this one at ~11, with the data fetched 4 KB ahead.
__attribute__((target("avx512f"))) double lane_sum_squares_avx512(const float* x, int64_t n) {
  constexpr int64_t kAhead = 1024;  // floats; a prefetch past the end is harmless (a hint)
  __m512d acc = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(x + i + kAhead), _MM_HINT_T0);
    const __m512d lo = _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(x + i));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
    const __m512d hi = _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(x + i + 8));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(hi, hi));
  }
  for (; i + 8 <= n; i += 8) {
    const __m512d v = _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(x + i));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));
  }
  alignas(64) double lane[kLanes];
  _mm512_store_pd(lane, acc);
  for (int k = 0; i < n; ++i, ++k) lane[k] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return combine_lanes(lane);
}
#else
double lane_sum_squares_avx512(const float*, int64_t) {
  throw std::runtime_error("lane_sum_squares_avx512: not an x86-64 build");
}
#endif

}  // namespace detail

template <typename Real>
double sum_squares(ThreadPool& pool, const Real* x, int64_t n) {
  if constexpr (std::is_same_v<Real, float>) {
    if (has_avx512f())
      return chunked_sum(pool, n, [&](int64_t begin, int64_t count) {
        return detail::lane_sum_squares_avx512(x + begin, count);
      });
  }
  return chunked_sum(pool, n, [&](int64_t begin, int64_t count) {
    return detail::lane_dot<double>(x + begin, x + begin, count);
  });
}

template <typename Real>
double sum(ThreadPool& pool, const Real* x, int64_t n) {
  return chunked_sum(pool, n, [&](int64_t begin, int64_t count) {
    return detail::lane_sum<double>(x + begin, count);
  });
}

#define LOOM_INSTANTIATE(Real)                                                            \
  template void add_forward<Real>(ThreadPool&, Real*, const Real*, const Real*, int64_t); \
  template void add_inplace<Real>(ThreadPool&, Real*, const Real*, int64_t);              \
  template void scale_inplace<Real>(ThreadPool&, Real*, Real, int64_t);                   \
  template double sum_squares<Real>(ThreadPool&, const Real*, int64_t);                   \
  template double sum<Real>(ThreadPool&, const Real*, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
