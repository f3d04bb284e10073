#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/reduce.h"

namespace loom::cpu {
namespace {

// Rows per chunk of the dweight/dbias reduction. Fixed, not derived from pool.size(), so the
// summation order (and every bit of the result) is the same for any number of threads; the
// partial buffers cost 2·C per chunk, small next to the 32·C·3 values a chunk reads.
constexpr int64_t kRowsPerChunk = 32;

// One row of the backward's first pass: n = (x - m)·s and g = w ∘ dy for the row's gradient,
// and the row's dy·n and dy added to its chunk's partial dweight and dbias. A function of its
// own so that its pointers can say they never overlap (__restrict on parameters, which GCC
// honours): without that GCC checks them against each other at run time and runs its scalar
// loop, 3× slower.
template <typename Real>
void layernorm_backward_row(const Real* __restrict x, const Real* __restrict dy,
                            const Real* __restrict w, Real m, Real s, Real* __restrict n,
                            Real* __restrict g, Real* __restrict pw, Real* __restrict pb,
                            int64_t C) {
  for (int64_t c = 0; c < C; ++c) {
    n[c] = (x[c] - m) * s;
    g[c] = w[c] * dy[c];
    pw[c] += dy[c] * n[c];
    pb[c] += dy[c];
  }
}

}  // namespace

template <typename Real>
void layernorm_forward(ThreadPool& pool, Real* out, Real* mean, Real* rstd, const Real* inp,
                       const Real* weight, const Real* bias, int64_t N, int64_t C) {
  pool.parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* x = inp + r * C;
      Real* y = out + r * C;
      // Two passes (mean, then squared deviations) rather than E[x²] - E[x]², which cancels
      // catastrophically when |mean| >> std.
      const Real m = detail::lane_sum<Real>(x, C) / Real(C);
      for (int64_t c = 0; c < C; ++c) y[c] = x[c] - m;  // y holds the deviations for now
      const Real var = detail::lane_dot<Real>(y, y, C) / Real(C);
      const Real s = Real(1) / std::sqrt(var + Real(kLayerNormEps));
      for (int64_t c = 0; c < C; ++c) y[c] = y[c] * s * weight[c] + bias[c];
      mean[r] = m;
      rstd[r] = s;
    }
  });
}

// With n = (x - mean)·rstd and g = weight ∘ dout, the row gradient is
//   dinp = rstd · (g - mean(g) - n · mean(g ∘ n))
// (the two means come from mean and rstd depending on every x of the row).
template <typename Real>
void layernorm_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* dbias, const Real* dout,
                        const Real* inp, const Real* weight, const Real* mean, const Real* rstd,
                        int64_t N, int64_t C) {
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  // partial[k] holds chunk k's Σ dout·n (first C) and Σ dout (next C).
  std::vector<Real> partial(chunks * 2 * C, Real(0));
  pool.parallel_for(chunks, 1, [&](int64_t k0, int64_t k1) {
    std::vector<Real> g(C), n(C);
    for (int64_t k = k0; k < k1; ++k) {
      Real* pw = partial.data() + k * 2 * C;
      Real* pb = pw + C;
      const int64_t r1 = std::min(N, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < r1; ++r) {
        const Real* x = inp + r * C;
        const Real* dy = dout + r * C;
        const Real m = mean[r], s = rstd[r];
        layernorm_backward_row(x, dy, weight, m, s, n.data(), g.data(), pw, pb, C);
        const Real g_mean = detail::lane_sum<Real>(g.data(), C) / Real(C);
        const Real gn_mean = detail::lane_dot<Real>(g.data(), n.data(), C) / Real(C);
        Real* dx = dinp + r * C;
        for (int64_t c = 0; c < C; ++c) dx[c] = s * (g[c] - g_mean - n[c] * gn_mean);
      }
    }
  });
  // Add the chunks in order, each thread owning a slice of the channels.
  pool.parallel_for(C, 64, [&](int64_t c0, int64_t c1) {
    std::vector<Real> sw(c1 - c0, Real(0)), sb(c1 - c0, Real(0));
    for (int64_t k = 0; k < chunks; ++k) {
      const Real* pw = partial.data() + k * 2 * C + c0;
      const Real* pb = pw + C;
      for (int64_t c = 0; c < c1 - c0; ++c) {
        sw[c] += pw[c];
        sb[c] += pb[c];
      }
    }
    for (int64_t c = 0; c < c1 - c0; ++c) {
      dweight[c0 + c] += sw[c];
      dbias[c0 + c] += sb[c];
    }
  });
}

#define LOOM_INSTANTIATE(Real)                                                               \
  template void layernorm_forward<Real>(ThreadPool&, Real*, Real*, Real*, const Real*,       \
                                        const Real*, const Real*, int64_t, int64_t);         \
  template void layernorm_backward<Real>(ThreadPool&, Real*, Real*, Real*, const Real*,      \
                                         const Real*, const Real*, const Real*, const Real*, \
                                         int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
