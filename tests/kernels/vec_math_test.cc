#include "kernels/cpu/vec_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

namespace loom::cpu {
namespace {

// Every float from lo to hi at a fixed stride (dense: ~2M points), plus both ends.
std::vector<float> dense_range(float lo, float hi, int64_t points = 1 << 21) {
  std::vector<float> x;
  x.reserve(points + 1);
  const double step = (static_cast<double>(hi) - lo) / points;
  for (int64_t i = 0; i < points; ++i) x.push_back(static_cast<float>(lo + i * step));
  x.push_back(hi);
  return x;
}

// Distance in ulps between two finite floats of the same sign (the reference is taken in double
// and rounded, so a correctly rounded result scores 0).
double ulps(float got, double want) {
  const float w = static_cast<float>(want);
  if (got == w) return 0;
  const double ulp =
      std::nextafter(std::fabs(w), std::numeric_limits<float>::infinity()) - std::fabs(w);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

struct ErrorStats {
  double max_rel = 0;
  double max_ulps = 0;
  float worst_x = 0;
};

template <typename F, typename Ref>
ErrorStats measure(const std::vector<float>& x, F f, Ref ref) {
  std::vector<float> y(x.size());
  f(y.data(), x.data(), static_cast<int64_t>(x.size()));
  ErrorStats s;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = ref(static_cast<double>(x[i]));
    const double rel = want == 0 ? std::fabs(y[i]) : std::fabs(y[i] - want) / std::fabs(want);
    if (rel > s.max_rel) {
      s.max_rel = rel;
      s.worst_x = x[i];
    }
    s.max_ulps = std::max(s.max_ulps, ulps(y[i], want));
  }
  return s;
}

void exp_array(float* y, const float* x, int64_t n) {
  vmath::exp_shifted(y, x, 0.0f, 1.0f, n);
}

TEST(VecMath, ExpAccuracyOverNormalRange) {
  // Softmax arguments are <= 0 after the max shift; cover the whole normal output range anyway.
  const auto s =
      measure(dense_range(-87.0f, 88.5f), exp_array, [](double x) { return std::exp(x); });
  std::printf("exp: max relative error %.3g (%.2f ulp) at x = %.9g; vectorised: %d\n", s.max_rel,
              s.max_ulps, s.worst_x, vmath::kVectorised);
  EXPECT_LT(s.max_rel, 2.5e-7);
  EXPECT_LE(s.max_ulps, 2.0);
}

TEST(VecMath, ExpAccuracyNearZero) {
  const auto s = measure(dense_range(-1.0f, 1.0f), exp_array, [](double x) { return std::exp(x); });
  EXPECT_LT(s.max_rel, 2.5e-7) << "at x = " << s.worst_x;
  EXPECT_LE(s.max_ulps, 2.0);
}

TEST(VecMath, ExpSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {0.0f, -0.0f, -inf, inf, nan, 89.0f, -110.0f, -100.0f, -88.0f, 1.0f};
  std::vector<float> y(x.size());
  vmath::exp_shifted(y.data(), x.data(), 0.0f, 1.0f, static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], inf);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_EQ(y[5], inf);
  EXPECT_EQ(y[6], 0.0f);
  // Subnormal and near-FLT_MIN results keep their magnitude (absolute error below FLT_MIN·ulp).
  EXPECT_NEAR(y[7], std::exp(-100.0), 1e-45);
  EXPECT_NEAR(y[8] / std::exp(-88.0), 1.0, 1e-6);
  EXPECT_NEAR(y[9] / std::exp(1.0), 1.0, 2.5e-7);
}

TEST(VecMath, TanhAccuracy) {
  auto ref = [](double x) { return std::tanh(x); };
  // Both branches (|x| < 0.625 polynomial, 1 - 2/(e^2|x| + 1) beyond) and the switch between.
  const auto wide = measure(dense_range(-12.0f, 12.0f), vmath::tanh_array, ref);
  const auto near0 = measure(dense_range(-0.7f, 0.7f), vmath::tanh_array, ref);
  const auto tiny = measure(dense_range(-1e-3f, 1e-3f, 1 << 16), vmath::tanh_array, ref);
  std::printf(
      "tanh: max relative error %.3g (%.2f ulp) on [-12, 12], %.3g (%.2f ulp) on "
      "[-0.7, 0.7], %.3g on [-1e-3, 1e-3]\n",
      wide.max_rel, wide.max_ulps, near0.max_rel, near0.max_ulps, tiny.max_rel);
  for (const auto& s : {wide, near0, tiny}) {
    EXPECT_LT(s.max_rel, 3e-7) << "at x = " << s.worst_x;
    EXPECT_LE(s.max_ulps, 3.0) << "at x = " << s.worst_x;
  }
}

TEST(VecMath, TanhSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {0.0f,  -0.0f,  inf,   -inf, std::numeric_limits<float>::quiet_NaN(),
                          50.0f, -50.0f, 1e-30f};
  std::vector<float> y(x.size());
  vmath::tanh_array(y.data(), x.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_TRUE(std::signbit(y[1]));
  EXPECT_EQ(y[2], 1.0f);
  EXPECT_EQ(y[3], -1.0f);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_EQ(y[5], 1.0f);
  EXPECT_EQ(y[6], -1.0f);
  EXPECT_EQ(y[7], 1e-30f);
}

TEST(VecMath, ExpSumMatchesDoubleReference) {
  // A softmax row as cross-entropy sees it: the sum of e^(x - max), accumulated in double.
  for (int64_t n : {1, 7, 8, 9, 255, 50304}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::sin(0.37 * i) * 9);
    const float mx = vmath::max_value(x.data(), n);
    double want_max = x[0], want = 0;
    for (float v : x) want_max = std::max<double>(want_max, v);
    for (float v : x) want += std::exp(static_cast<double>(v) - mx);
    EXPECT_EQ(mx, static_cast<float>(want_max));
    std::vector<float> e(n);
    const double got = vmath::exp_sum(e.data(), x.data(), mx, n);
    EXPECT_NEAR(got / want, 1.0, 3e-7) << "n = " << n;
    for (int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(e[i], std::exp(static_cast<double>(x[i]) - mx), 3e-7) << "n = " << n;
    EXPECT_EQ(vmath::exp_sum(nullptr, x.data(), mx, n), got);
  }
}

TEST(VecMath, ElementBitsDoNotDependOnPosition) {
  // An element must come out the same whether it lands in a full vector or a padded tail, so
  // that splitting a range differently between threads cannot change any result.
  const auto x = dense_range(-10.0f, 10.0f, 999);
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> whole_exp(n), whole_tanh(n);
  exp_array(whole_exp.data(), x.data(), n);
  vmath::tanh_array(whole_tanh.data(), x.data(), n);
  for (int64_t start = 0; start < 9; ++start) {
    for (int64_t len : {1, 3, 8, 13}) {
      if (start + len > n) continue;
      std::vector<float> e(len), t(len);
      exp_array(e.data(), x.data() + start, len);
      vmath::tanh_array(t.data(), x.data() + start, len);
      for (int64_t i = 0; i < len; ++i) {
        ASSERT_EQ(std::memcmp(&e[i], &whole_exp[start + i], sizeof(float)), 0);
        ASSERT_EQ(std::memcmp(&t[i], &whole_tanh[start + i], sizeof(float)), 0);
      }
    }
  }
}

#ifdef __AVX2__
// On AVX-512 CPUs exp_shifted and exp_sum run 16 lanes at a time; they must give exactly what
// their 8-lane loops give: every element's bits, and the sum's, lane order included.
TEST(VecMath, SixteenLaneExpGivesTheBitsOfEight) {
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F";
  for (int64_t n : {5, 16, 24, 37, 50304}) {
    std::vector<float> x(n);
    // e^(x - max) over 35 orders of magnitude, so that the double sum rounds: a different
    // order of additions would show.
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::sin(0.37 * i) * 40);
    const float shift = vmath::max_value(x.data(), n);
    // The 8-lane loops, as vec_math.h ran them before it had 16.
    std::vector<float> want(n), want_scaled(n);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; i += 8) {
      const int64_t m = std::min<int64_t>(8, n - i);
      const __m256 e = vmath::exp8(_mm256_sub_ps(
          vmath::load_partial(x.data() + i, m, -std::numeric_limits<float>::infinity()),
          _mm256_set1_ps(shift)));
      vmath::store_partial(want.data() + i, e, m);
      const __m256 scaled =
          _mm256_mul_ps(vmath::exp8(_mm256_sub_ps(vmath::load_partial(x.data() + i, m, 0),
                                                  _mm256_set1_ps(shift))),
                        _mm256_set1_ps(0.25f));
      vmath::store_partial(want_scaled.data() + i, scaled, m);
      lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    const double want_sum = vmath::hsum(lo, hi);
    std::vector<float> got(n), got_scaled(n);
    const double got_sum = vmath::exp_sum(got.data(), x.data(), shift, n);
    vmath::exp_shifted(got_scaled.data(), x.data(), shift, 0.25f, n);
    EXPECT_EQ(std::memcmp(&got_sum, &want_sum, sizeof(double)), 0) << "sum, n = " << n;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0) << "n = " << n << ", i = " << i;
      ASSERT_EQ(std::memcmp(&got_scaled[i], &want_scaled[i], sizeof(float)), 0)
          << "n = " << n << ", i = " << i;
    }
  }
}
#endif

}  // namespace
}  // namespace loom::cpu
