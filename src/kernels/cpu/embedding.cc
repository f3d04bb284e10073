#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "base/error.h"

namespace loom::cpu {

template <typename Real>
void embedding_forward(ThreadPool& pool, Real* out, const int32_t* tokens, const Real* wte,
                       const Real* wpe, int64_t B, int64_t T, int64_t C, int64_t V) {
  // Validate on the calling thread: an exception must not escape a pool worker.
  for (int64_t i = 0; i < B * T; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V)
      fail("embedding: token id ", tokens[i], " at batch ", i / T, ", position ", i % T,
           " is outside the vocabulary [0, ", V, ")");
  }
  pool.parallel_for(B * T, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Real* te = wte + tokens[i] * C;
      Real* o = out + i * C;
      if (wpe == nullptr) {
        for (int64_t c = 0; c < C; ++c) o[c] = te[c];
        continue;
      }
      const Real* pe = wpe + (i % T) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = te[c] + pe[c];
    }
  });
}

template <typename Real>
void embedding_backward(ThreadPool& pool, Real* dwte, Real* dwpe, const Real* dout,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C) {
  // Slices of at least 16 channels keep each inner loop a full SIMD width or two.
  pool.parallel_for(C, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < B * T; ++i) {
      const Real* d = dout + i * C;
      Real* te = dwte + tokens[i] * C;
      if (dwpe == nullptr) {
        for (int64_t c = c0; c < c1; ++c) te[c] += d[c];
        continue;
      }
      Real* pe = dwpe + (i % T) * C;
      for (int64_t c = c0; c < c1; ++c) {
        te[c] += d[c];
        pe[c] += d[c];
      }
    }
  });
}

void document_positions(ThreadPool& pool, int32_t* ids, const int32_t* starts,
                        const int32_t* global, int64_t B, int64_t Tl, int64_t T) {
  pool.parallel_for(B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < Tl; ++i) {
        const int64_t g = global != nullptr ? global[i] : i;
        ids[b * Tl + i] = static_cast<int32_t>(g - starts[b * T + g]);
      }
  });
}

void window_starts(ThreadPool& pool, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window) {
  pool.parallel_for(B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t first = starts != nullptr ? starts[b * T + t] : 0;
        out[b * T + t] = static_cast<int32_t>(std::max(first, t - window + 1));
      }
  });
}

template <typename Real>
void add_rows_by_id(ThreadPool& pool, Real* out, const Real* table, const int32_t* ids, int64_t N,
                    int64_t C) {
  pool.parallel_for(N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Real* row = table + static_cast<int64_t>(ids[i]) * C;
      Real* o = out + i * C;
      for (int64_t c = 0; c < C; ++c) o[c] += row[c];
    }
  });
}

template void add_rows_by_id<float>(ThreadPool&, float*, const float*, const int32_t*, int64_t,
                                    int64_t);
template void add_rows_by_id<double>(ThreadPool&, double*, const double*, const int32_t*, int64_t,
                                     int64_t);
template void embedding_forward<float>(ThreadPool&, float*, const int32_t*, const float*,
                                       const float*, int64_t, int64_t, int64_t, int64_t);
template void embedding_forward<double>(ThreadPool&, double*, const int32_t*, const double*,
                                        const double*, int64_t, int64_t, int64_t, int64_t);
template void embedding_backward<float>(ThreadPool&, float*, float*, const float*, const int32_t*,
                                        int64_t, int64_t, int64_t);
template void embedding_backward<double>(ThreadPool&, double*, double*, const double*,
                                         const int32_t*, int64_t, int64_t, int64_t);

}  // namespace loom::cpu
