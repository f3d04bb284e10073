#include "kernels/cpu/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

double naive_silu(double a) {
  return a / (1 + std::exp(-a));
}

TEST(SwiGlu, ForwardMatchesFormula) {
  ThreadPool pool(3);
  const int64_t N = 7, H = 30;
  const auto h = random_vector(N * 2 * H, 1, -8, 8);
  std::vector<double> out = ktest::nan_vector(N * H);
  swiglu_forward(pool, out.data(), h.data(), N, H);
  std::vector<double> expected(N * H);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j)
      expected[r * H + j] = naive_silu(h[r * 2 * H + j]) * h[r * 2 * H + H + j];
  ktest::expect_close("out", out, expected, 1e-15);
}

TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 5, H = 12;
  auto h = random_vector(N * 2 * H, 2, -5, 5);
  const auto R = random_vector(N * H, 3);
  auto loss = [&] {
    std::vector<double> out(N * H);
    swiglu_forward(pool, out.data(), h.data(), N, H);
    return ktest::weighted_sum(out, R);
  };
  auto dh = ktest::nan_vector(h.size());
  swiglu_backward(pool, dh.data(), R.data(), h.data(), N, H);
  ktest::expect_gradient("dh", h, loss, dh);
}

// GeGLU (act = GatedActivation::kGeluTanh, Gemma's): out = gelu_tanh(gate) ⊙ up against the
// formula, the backward against finite differences, float against double over gates far into
// both tails (where tanh saturates: gelu is 0 and a), and bit for bit whatever the pool's size.
double naive_gelu_tanh(double a) {
  return 0.5 * a * (1 + std::tanh(std::sqrt(2 / M_PI) * (a + 0.044715 * a * a * a)));
}

TEST(GeGlu, ForwardMatchesFormulaAndBackwardFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 7, H = 30;
  auto h = random_vector(N * 2 * H, 11, -6, 6);
  std::vector<double> out = ktest::nan_vector(N * H);
  swiglu_forward(pool, out.data(), h.data(), N, H, GatedActivation::kGeluTanh);
  std::vector<double> expected(N * H);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < H; ++j)
      expected[r * H + j] = naive_gelu_tanh(h[r * 2 * H + j]) * h[r * 2 * H + H + j];
  ktest::expect_close("out", out, expected, 1e-14);
  const auto R = random_vector(N * H, 12);
  auto loss = [&] {
    std::vector<double> o(N * H);
    swiglu_forward(pool, o.data(), h.data(), N, H, GatedActivation::kGeluTanh);
    return ktest::weighted_sum(o, R);
  };
  auto dh = ktest::nan_vector(h.size());
  swiglu_backward(pool, dh.data(), R.data(), h.data(), N, H, GatedActivation::kGeluTanh);
  ktest::expect_gradient("dh", h, loss, dh);
}

TEST(GeGlu, FloatMatchesDoubleAndIsBitwiseSameForAnyPoolSize) {
  const int64_t N = 300, H = 100;
  const auto run = [&]<typename Real>(ThreadPool& pool, Real) {
    auto h = convert<Real>(random_vector(N * 2 * H, 14, -10, 10));
    h[0] = Real(-100), h[1] = Real(100), h[2] = Real(0);
    const auto dout = convert<Real>(random_vector(N * H, 15));
    std::vector<Real> out(N * H), dh(N * 2 * H);
    swiglu_forward(pool, out.data(), h.data(), N, H, GatedActivation::kGeluTanh);
    swiglu_backward(pool, dh.data(), dout.data(), h.data(), N, H, GatedActivation::kGeluTanh);
    out.insert(out.end(), dh.begin(), dh.end());
    return out;
  };
  auto runs =
      ktest::expect_reproducible("geglu", [&](ThreadPool& pool) { return run(pool, 0.0f); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
  ThreadPool pool(2);
  const std::vector<double> d = run(pool, 0.0);
  int failures = 0;
  for (size_t i = 0; i < d.size(); ++i)
    if (!(std::abs(runs[0][i] - d[i]) <= 1e-5 * std::max(1.0, std::abs(d[i]))) && ++failures <= 5)
      ADD_FAILURE() << "[" << i << "]: " << runs[0][i] << " vs " << d[i];
  EXPECT_EQ(runs[0][0], 0.0f) << "gelu(-100)";
  EXPECT_EQ(runs[0][2], 0.0f) << "gelu(0)";
  // Not SwiGLU's numbers.
  std::vector<float> silu(N * H);
  const auto h = convert<float>(random_vector(N * 2 * H, 14, -10, 10));
  swiglu_forward(pool, silu.data(), h.data(), N, H);
  EXPECT_NE(silu[5], runs[0][5]);
}

// Forward and backward in Real, out and dh in a row. H = 100: rows that end in a tail of either
// vector width.
template <typename Real>
std::vector<Real> run_swiglu(ThreadPool& pool, int64_t N, int64_t H) {
  auto h = convert<Real>(random_vector(N * 2 * H, 4, -10, 10));
  // Gates far out, where exp(−a) overflows or vanishes: silu is 0 and a there, its slope 0 and 1.
  h[0] = Real(-100), h[1] = Real(100), h[2] = Real(-1000), h[3] = Real(0);
  const auto dout = convert<Real>(random_vector(N * H, 5));
  std::vector<Real> out(N * H), dh(N * 2 * H);
  swiglu_forward(pool, out.data(), h.data(), N, H);
  swiglu_backward(pool, dh.data(), dout.data(), h.data(), N, H);
  out.insert(out.end(), dh.begin(), dh.end());
  return out;
}

TEST(SwiGlu, FloatMatchesDoubleAndIsBitwiseSameForAnyPoolSize) {
  const int64_t N = 300, H = 100;  // several parallel ranges
  auto runs = ktest::expect_reproducible(
      "swiglu", [&](ThreadPool& pool) { return run_swiglu<float>(pool, N, H); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
  ThreadPool pool(2);
  const std::vector<double> d = run_swiglu<double>(pool, N, H);
  // Relative to each value: the vectorised exp is accurate to a few ulps.
  int failures = 0;
  for (size_t i = 0; i < d.size(); ++i)
    if (!(std::abs(runs[0][i] - d[i]) <= 1e-6 * std::max(1.0, std::abs(d[i]))) && ++failures <= 5)
      ADD_FAILURE() << "[" << i << "]: " << runs[0][i] << " vs " << d[i];
  const std::vector<float>& f = runs[0];
  EXPECT_EQ(f[0], 0.0f) << "silu(-100)";
  EXPECT_EQ(f[2], 0.0f) << "silu(-1000)";
  EXPECT_EQ(f[3], 0.0f) << "silu(0)";
}

// Where the CPU has AVX-512, float SwiGLU runs 16 lanes at a time; those lanes must give exactly
// the bits of the 8-lane code (and so of any other split), tails included.
TEST(SwiGlu, SixteenLanesGiveTheBitsOfEight) {
#ifndef __AVX2__
  GTEST_SKIP() << "no vectorised SwiGLU in this build";
#else
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F";
  const int64_t n = 4096 + 13;  // a tail shorter than either width
  const auto gate = convert<float>(random_vector(n, 21, -20.0, 20.0));
  const auto up = convert<float>(random_vector(n, 22)), dout = convert<float>(random_vector(n, 23));
  std::vector<float> y8(n), y16(n), dg8(n), dg16(n), du8(n), du16(n);
  detail::swiglu_forward_chunk(y8.data(), gate.data(), up.data(), n, false);
  detail::swiglu_forward_chunk(y16.data(), gate.data(), up.data(), n, true);
  detail::swiglu_backward_chunk(dg8.data(), du8.data(), dout.data(), gate.data(), up.data(), n,
                                false);
  detail::swiglu_backward_chunk(dg16.data(), du16.data(), dout.data(), gate.data(), up.data(), n,
                                true);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&y8[i], &y16[i], sizeof(float)), 0) << "forward, [" << i << "]";
    ASSERT_EQ(std::memcmp(&dg8[i], &dg16[i], sizeof(float)), 0) << "dgate, [" << i << "]";
    ASSERT_EQ(std::memcmp(&du8[i], &du16[i], sizeof(float)), 0) << "dup, [" << i << "]";
  }
#endif
}

}  // namespace
}  // namespace loom::cpu
