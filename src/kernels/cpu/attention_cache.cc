#include "kernels/cpu/attention_cache.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::cpu {

template <typename Real>
void attention_with_cache(ThreadPool& pool, Real* out, const Real* q, int64_t q_stride,
                          const Real* k, const Real* v, int64_t first, int64_t n, int64_t C,
                          int64_t NH, int64_t window) {
  const int64_t hd = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  pool.parallel_for(n * NH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<double> scores(static_cast<size_t>(first + n)), acc(static_cast<size_t>(hd));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t r = task / NH, h = task % NH, keys = first + r + 1;
      const int64_t j0 = window > 0 && keys > window ? keys - window : 0;  // the window's first
      const Real* qr = q + r * q_stride + h * hd;
      double mx = -INFINITY;
      for (int64_t j = j0; j < keys; ++j) {
        const Real* kj = k + j * C + h * hd;
        double s = 0;
        for (int64_t d = 0; d < hd; ++d) s += static_cast<double>(qr[d]) * static_cast<double>(kj[d]);
        scores[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, s * scale);
      }
      double total = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = j0; j < keys; ++j) {
        const double p = std::exp(scores[static_cast<size_t>(j)] - mx);
        total += p;
        const Real* vj = v + j * C + h * hd;
        for (int64_t d = 0; d < hd; ++d) acc[static_cast<size_t>(d)] += p * static_cast<double>(vj[d]);
      }
      Real* o = out + r * C + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<Real>(acc[static_cast<size_t>(d)] / total);
    }
  });
}

template void attention_with_cache<float>(ThreadPool&, float*, const float*, int64_t, const float*,
                                          const float*, int64_t, int64_t, int64_t, int64_t,
                                          int64_t);
template void attention_with_cache<double>(ThreadPool&, double*, const double*, int64_t,
                                           const double*, const double*, int64_t, int64_t, int64_t,
                                           int64_t, int64_t);

}  // namespace loom::cpu
