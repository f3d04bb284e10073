#include "kernels/cpu/elementwise.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/reduce.h"

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

template <typename Real>
void scale_inplace(ThreadPool& pool, Real* x, Real s, int64_t n) {
  pool.parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] *= s;
  });
}

template <typename Real>
double sum_squares(ThreadPool& pool, const Real* x, int64_t n) {
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
