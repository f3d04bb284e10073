#include "kernels/cpu/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/reduce.h"

namespace loom::cpu {
namespace {

// Rows per chunk of the dweight reduction: fixed, not derived from pool.size(), so the summation
// order (and every bit of the result) is the same for any number of threads (layernorm.cc).
constexpr int64_t kRowsPerChunk = 32;

// One row of the backward's first pass: n = x·s and g = w ∘ dy for the row's gradient, and the
// row's dy·n added to its chunk's partial dweight. __restrict so that GCC vectorises without run
// time overlap checks (layernorm_backward_row).
template <typename Real>
void rmsnorm_backward_row(const Real* __restrict x, const Real* __restrict dy,
                          const Real* __restrict w, Real s, Real* __restrict n, Real* __restrict g,
                          Real* __restrict pw, int64_t C) {
  for (int64_t c = 0; c < C; ++c) {
    n[c] = x[c] * s;
    g[c] = w[c] * dy[c];
    pw[c] += dy[c] * n[c];
  }
}

// The forward; with `sums` (the split rows' Σx² over their C_full columns) given, not taken here.
template <typename Real>
void forward_rows(ThreadPool& pool, Real* out, Real* rstd, const Real* sums, const Real* inp,
                  const Real* weight, int64_t N, int64_t C, int64_t C_full, double eps) {
  pool.parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* x = inp + r * C;
      Real* y = out + r * C;
      const Real ms =
          sums != nullptr ? sums[r] / Real(C_full) : detail::lane_dot<Real>(x, x, C) / Real(C);
      const Real s = Real(1) / std::sqrt(ms + Real(eps));
      for (int64_t c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
      rstd[r] = s;
    }
  });
}

// With n = x·rstd and g = weight ∘ dout, the row gradient is
//   dinp = rstd · (g - n · mean(g ∘ n))
// (the mean from rstd depending on every x of the row). With `dots` (the split rows' Σ g ∘ x
// over their C_full columns) given, mean(g ∘ n) = rstd · dots / C_full.
template <typename Real>
void backward_rows(ThreadPool& pool, Real* dinp, Real* dweight, const Real* dout, const Real* inp,
                   const Real* weight, const Real* rstd, const Real* dots, int64_t N, int64_t C,
                   int64_t C_full) {
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  // partial[k] holds chunk k's Σ dout·n.
  std::vector<Real> partial(chunks * C, Real(0));
  pool.parallel_for(chunks, 1, [&](int64_t k0, int64_t k1) {
    std::vector<Real> g(C), n(C);
    for (int64_t k = k0; k < k1; ++k) {
      Real* pw = partial.data() + k * C;
      const int64_t r1 = std::min(N, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < r1; ++r) {
        const Real s = rstd[r];
        rmsnorm_backward_row(inp + r * C, dout + r * C, weight, s, n.data(), g.data(), pw, C);
        const Real gn_mean = dots != nullptr
                                 ? s * dots[r] / Real(C_full)
                                 : detail::lane_dot<Real>(g.data(), n.data(), C) / Real(C);
        Real* dx = dinp + r * C;
        for (int64_t c = 0; c < C; ++c) dx[c] = s * (g[c] - n[c] * gn_mean);
      }
    }
  });
  // Add the chunks in order, each thread owning a slice of the channels.
  pool.parallel_for(C, 64, [&](int64_t c0, int64_t c1) {
    std::vector<Real> sw(c1 - c0, Real(0));
    for (int64_t k = 0; k < chunks; ++k) {
      const Real* pw = partial.data() + k * C + c0;
      for (int64_t c = 0; c < c1 - c0; ++c) sw[c] += pw[c];
    }
    for (int64_t c = 0; c < c1 - c0; ++c) dweight[c0 + c] += sw[c];
  });
}

}  // namespace

template <typename Real>
void rmsnorm_forward(ThreadPool& pool, Real* out, Real* rstd, const Real* inp, const Real* weight,
                     int64_t N, int64_t C, double eps) {
  forward_rows(pool, out, rstd, static_cast<const Real*>(nullptr), inp, weight, N, C, C, eps);
}

template <typename Real>
void rmsnorm_backward(ThreadPool& pool, Real* dinp, Real* dweight, const Real* dout,
                      const Real* inp, const Real* weight, const Real* rstd, int64_t N, int64_t C) {
  backward_rows(pool, dinp, dweight, dout, inp, weight, rstd, static_cast<const Real*>(nullptr), N,
                C, C);
}

template <typename Real>
void rmsnorm_partial_sums(ThreadPool& pool, Real* sums, const Real* a, const Real* b,
                          const Real* weight, int64_t N, int64_t C) {
  pool.parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
    std::vector<Real> wa(weight != nullptr ? C : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const Real* ar = a + r * C;
      if (weight != nullptr) {
        for (int64_t c = 0; c < C; ++c) wa[c] = weight[c] * ar[c];
        ar = wa.data();
      }
      sums[r] = detail::lane_dot<Real>(ar, b + r * C, C);
    }
  });
}

template <typename Real>
void rmsnorm_forward_of_sums(ThreadPool& pool, Real* out, Real* rstd, const Real* sums,
                             const Real* inp, const Real* weight, int64_t N, int64_t C,
                             int64_t C_full, double eps) {
  forward_rows(pool, out, rstd, sums, inp, weight, N, C, C_full, eps);
}

template <typename Real>
void rmsnorm_backward_of_dots(ThreadPool& pool, Real* dinp, Real* dweight, const Real* dout,
                              const Real* inp, const Real* weight, const Real* rstd,
                              const Real* dots, int64_t N, int64_t C, int64_t C_full) {
  backward_rows(pool, dinp, dweight, dout, inp, weight, rstd, dots, N, C, C_full);
}

#define LOOM_INSTANTIATE(Real)                                                                     \
  template void rmsnorm_forward<Real>(ThreadPool&, Real*, Real*, const Real*, const Real*,         \
                                      int64_t, int64_t, double);                                   \
  template void rmsnorm_backward<Real>(ThreadPool&, Real*, Real*, const Real*, const Real*,        \
                                       const Real*, const Real*, int64_t, int64_t);                \
  template void rmsnorm_partial_sums<Real>(ThreadPool&, Real*, const Real*, const Real*,           \
                                           const Real*, int64_t, int64_t);                         \
  template void rmsnorm_forward_of_sums<Real>(ThreadPool&, Real*, Real*, const Real*, const Real*, \
                                              const Real*, int64_t, int64_t, int64_t, double);     \
  template void rmsnorm_backward_of_dots<Real>(ThreadPool&, Real*, Real*, const Real*,             \
                                               const Real*, const Real*, const Real*, const Real*, \
                                               int64_t, int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
