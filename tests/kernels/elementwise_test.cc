#include "kernels/cpu/elementwise.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reduce.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

TEST(Elementwise, AddScaleMatchNaive) {
  ThreadPool pool(3);
  const int64_t n = 100001;  // several parallel ranges, odd length
  const auto a = random_vector(n, 1), b = random_vector(n, 2);
  std::vector<double> out(n);
  add_forward(pool, out.data(), a.data(), b.data(), n);
  auto in_place = a;
  add_forward(pool, in_place.data(), in_place.data(), b.data(), n);  // out aliasing a
  auto acc = a;
  add_inplace(pool, acc.data(), b.data(), n);
  auto scaled = a;
  scale_inplace(pool, scaled.data(), -0.25, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], a[i] + b[i]) << i;
    ASSERT_EQ(in_place[i], a[i] + b[i]) << i;
    ASSERT_EQ(acc[i], a[i] + b[i]) << i;
    ASSERT_EQ(scaled[i], a[i] * -0.25) << i;
  }
}

TEST(Elementwise, SumsMatchLongDouble) {
  ThreadPool pool(3);
  for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{100001}}) {
    const auto x = random_vector(n, 3, -2, 2);
    long double s = 0, ss = 0;
    for (double v : x) {
      s += v;
      ss += static_cast<long double>(v) * v;
    }
    // A double sum of n terms is within ~sqrt(n) ulps of the exact one.
    const double tol = 1e-13 * static_cast<double>(ss) + 1e-14;
    EXPECT_NEAR(sum(pool, x.data(), n), static_cast<double>(s), tol) << n;
    EXPECT_NEAR(sum_squares(pool, x.data(), n), static_cast<double>(ss), tol) << n;
    // float input, double accumulation: only the inputs' rounding differs.
    const auto xf = convert<float>(x);
    long double sf = 0;
    for (float v : xf) sf += static_cast<long double>(v) * v;
    EXPECT_NEAR(sum_squares(pool, xf.data(), n), static_cast<double>(sf), tol) << n;
  }
}

// The AVX-512 sum of squares (sum_squares<float> on such CPUs) is the portable eight-lane loop
// bit for bit, at every length (tails of 0-15 past its 16-float steps) and over magnitudes where
// a different order of additions would show.
TEST(Elementwise, SixteenFloatSumSquaresGivesTheBitsOfTheLanes) {
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F";
  auto x = convert<float>(random_vector(100003, 5, -3, 3));
  for (size_t i = 0; i < x.size(); i += 7) x[i] *= 1e4f;  // wide range: order matters
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 1000, 16384, 16391, 100003}) {
    const double want = detail::lane_dot<double>(x.data(), x.data(), n);
    const double got = detail::lane_sum_squares_avx512(x.data(), n);
    EXPECT_EQ(std::memcmp(&want, &got, sizeof want), 0) << n << ": " << want << " vs " << got;
  }
  // And sum_squares itself: the floats' squares are exact in double, so the double kernel (the
  // portable loop) on the same values gives the bits the float one must.
  ThreadPool pool(2);
  const int64_t n = static_cast<int64_t>(x.size());
  const std::vector<double> xd(x.begin(), x.end());
  const double want = sum_squares(pool, xd.data(), n), got = sum_squares(pool, x.data(), n);
  EXPECT_EQ(std::memcmp(&want, &got, sizeof want), 0) << want << " vs " << got;
}

TEST(Elementwise, SumsAreBitwiseSameForAnyPoolSize) {
  const int64_t n = 200003;
  const auto x = convert<float>(random_vector(n, 4));
  auto runs = ktest::expect_reproducible("sums", [&](ThreadPool& pool) {
    return std::vector<double>{sum(pool, x.data(), n), sum_squares(pool, x.data(), n)};
  });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

}  // namespace
}  // namespace loom::cpu
