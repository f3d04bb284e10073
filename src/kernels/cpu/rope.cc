#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

namespace loom::cpu {
namespace {

// x (hd) rotated by the (c, s) pairs of one cos_sin row into y (hd). y does not alias x.
template <typename Real>
void rotate_head(Real* __restrict y, const Real* __restrict x, const Real* __restrict cs,
                 int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const Real c = cs[i], s = cs[half + i];
    y[i] = x[i] * c - x[i + half] * s;
    y[i + half] = x[i + half] * c + x[i] * s;
  }
}

// The transposed rotation: dx (hd) from dy (hd).
template <typename Real>
void rotate_head_back(Real* __restrict dx, const Real* __restrict dy, const Real* __restrict cs,
                      int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const Real c = cs[i], s = cs[half + i];
    dx[i] = dy[i] * c + dy[i + half] * s;
    dx[i + half] = dy[i + half] * c - dy[i] * s;
  }
}

// acc (hd) = Σ over the `group` heads of dy (stride hd apart), in ascending head.
template <typename Real>
void sum_heads(Real* __restrict acc, const Real* __restrict dy, int64_t group, int64_t hd) {
  for (int64_t i = 0; i < hd; ++i) acc[i] = dy[i];
  for (int64_t j = 1; j < group; ++j)
    for (int64_t i = 0; i < hd; ++i) acc[i] += dy[j * hd + i];
}

}  // namespace

double RopeFrequencies::frequency(int64_t i, int64_t hd) const {
  const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
  if (scaling_factor <= 0) return inv_freq;
  if (linear) return inv_freq / scaling_factor;
  const double pi = 3.14159265358979323846;
  const double wavelength = 2 * pi / inv_freq;
  if (wavelength < original_max_seq_len / high_freq_factor) return inv_freq;  // high: kept
  if (wavelength > original_max_seq_len / low_freq_factor) return inv_freq / scaling_factor;
  const double s = (original_max_seq_len / wavelength - low_freq_factor) /
                   (high_freq_factor - low_freq_factor);
  return (1 - s) * inv_freq / scaling_factor + s * inv_freq;
}

template <typename Real>
void rope_table(Real* cos_sin, int64_t T, int64_t hd, const RopeFrequencies& frequencies) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = frequencies.frequency(i, hd);
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(t) * inv_freq;
      cos_sin[t * hd + i] = static_cast<Real>(std::cos(angle));
      cos_sin[t * hd + half + i] = static_cast<Real>(std::sin(angle));
    }
  }
}

template <typename Real>
void rope_gqa_forward(ThreadPool& pool, Real* out, const Real* qkv, const Real* cos_sin, int64_t B,
                      int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  check_rope_gqa_shape("rope_gqa_forward", NH, KV, hd);
  const int64_t group = NH / KV, in_row = (NH + 2 * KV) * hd, out_row = 3 * NH * hd;
  pool.parallel_for(B * T, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* cs = cos_sin + (r % T) * hd;
      const Real* q = qkv + r * in_row;
      const Real* k = q + NH * hd;
      const Real* v = k + KV * hd;
      Real* oq = out + r * out_row;
      Real* ok = oq + NH * hd;
      Real* ov = ok + NH * hd;
      for (int64_t h = 0; h < NH; ++h) {
        rotate_head(oq + h * hd, q + h * hd, cs, hd);
        rotate_head(ok + h * hd, k + (h / group) * hd, cs, hd);
        for (int64_t i = 0; i < hd; ++i) ov[h * hd + i] = v[(h / group) * hd + i];
      }
    }
  });
}

template <typename Real>
void rope_gqa_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* cos_sin,
                       int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  check_rope_gqa_shape("rope_gqa_backward", NH, KV, hd);
  const int64_t group = NH / KV, in_row = (NH + 2 * KV) * hd, out_row = 3 * NH * hd;
  pool.parallel_for(B * T, 4, [&](int64_t r0, int64_t r1) {
    std::vector<Real> acc(hd);
    for (int64_t r = r0; r < r1; ++r) {
      const Real* cs = cos_sin + (r % T) * hd;
      const Real* dq = dout + r * out_row;
      const Real* dk = dq + NH * hd;
      const Real* dv = dk + NH * hd;
      Real* gq = dqkv + r * in_row;
      Real* gk = gq + NH * hd;
      Real* gv = gk + KV * hd;
      for (int64_t h = 0; h < NH; ++h) rotate_head_back(gq + h * hd, dq + h * hd, cs, hd);
      for (int64_t kv = 0; kv < KV; ++kv) {
        sum_heads(acc.data(), dk + kv * group * hd, group, hd);
        rotate_head_back(gk + kv * hd, acc.data(), cs, hd);
        sum_heads(gv + kv * hd, dv + kv * group * hd, group, hd);
      }
    }
  });
}

// The query and key heads of each (b, t) row of the compact layout turned in place, through a
// copy of the head (rotate_head's operands do not alias).
template <typename Real, typename Turn>
void rotate_rows_in_place(ThreadPool& pool, Real* qkv, const Real* cos_sin, int64_t B, int64_t T,
                          int64_t NH, int64_t KV, int64_t hd, const Turn& turn) {
  const int64_t row = (NH + 2 * KV) * hd;
  pool.parallel_for(B * T, 4, [&](int64_t r0, int64_t r1) {
    std::vector<Real> head(static_cast<size_t>(hd));
    for (int64_t r = r0; r < r1; ++r) {
      const Real* cs = cos_sin + (r % T) * hd;
      for (int64_t h = 0; h < NH + KV; ++h) {  // the query heads, then the key heads
        Real* x = qkv + r * row + h * hd;
        std::copy(x, x + hd, head.data());
        turn(x, head.data(), cs, hd);
      }
    }
  });
}

template <typename Real>
void rope_forward(ThreadPool& pool, Real* qkv, const Real* cos_sin, int64_t B, int64_t T,
                  int64_t NH, int64_t KV, int64_t hd) {
  check_rope_gqa_shape("rope_forward", NH, KV, hd);
  rotate_rows_in_place(pool, qkv, cos_sin, B, T, NH, KV, hd, rotate_head<Real>);
}

template <typename Real>
void rope_backward(ThreadPool& pool, Real* dqkv, const Real* cos_sin, int64_t B, int64_t T,
                   int64_t NH, int64_t KV, int64_t hd) {
  check_rope_gqa_shape("rope_backward", NH, KV, hd);
  rotate_rows_in_place(pool, dqkv, cos_sin, B, T, NH, KV, hd, rotate_head_back<Real>);
}

#define LOOM_INSTANTIATE(Real)                                                                 \
  template void rope_table<Real>(Real*, int64_t, int64_t, const RopeFrequencies&);                             \
  template void rope_gqa_forward<Real>(ThreadPool&, Real*, const Real*, const Real*, int64_t,  \
                                       int64_t, int64_t, int64_t, int64_t);                    \
  template void rope_gqa_backward<Real>(ThreadPool&, Real*, const Real*, const Real*, int64_t, \
                                        int64_t, int64_t, int64_t, int64_t);                   \
  template void rope_forward<Real>(ThreadPool&, Real*, const Real*, int64_t, int64_t, int64_t, \
                                   int64_t, int64_t);                                          \
  template void rope_backward<Real>(ThreadPool&, Real*, const Real*, int64_t, int64_t, int64_t,\
                                    int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
