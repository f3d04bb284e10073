// Row reductions in a fixed order that the compiler can still vectorise.
//
// Without -ffast-math a plain `s += x[i]` loop is a serial dependency chain: IEEE addition is
// not associative, so the compiler may not reorder it. Summing into kLanes independent
// accumulators (lane k takes i ≡ k mod kLanes) and combining them in a fixed order fixes one
// evaluation order ourselves, which maps onto SIMD registers and stays bitwise reproducible.
#pragma once

#include <cstdint>

namespace loom::cpu::detail {

inline constexpr int kLanes = 8;

template <typename Acc>
Acc combine_lanes(const Acc (&lane)[kLanes]) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Σ x[i], accumulated in Acc.
template <typename Acc, typename Real>
Acc lane_sum(const Real* x, int64_t n) {
  Acc lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += static_cast<Acc>(x[i + k]);
  for (int k = 0; i < n; ++i, ++k) lane[k] += static_cast<Acc>(x[i]);
  return combine_lanes(lane);
}

// Σ x[i]·y[i], accumulated in Acc.
template <typename Acc, typename Real>
Acc lane_dot(const Real* x, const Real* y, int64_t n) {
  Acc lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k)
      lane[k] += static_cast<Acc>(x[i + k]) * static_cast<Acc>(y[i + k]);
  for (int k = 0; i < n; ++i, ++k) lane[k] += static_cast<Acc>(x[i]) * static_cast<Acc>(y[i]);
  return combine_lanes(lane);
}

}  // namespace loom::cpu::detail
