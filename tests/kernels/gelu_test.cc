#include "kernels/cpu/gelu.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kernel_test_util.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

double naive_gelu(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(Gelu, ForwardMatchesFormula) {
  ThreadPool pool(3);
  const auto inp = random_vector(1000, 1, -6, 6);
  std::vector<double> out(inp.size());
  gelu_forward(pool, out.data(), inp.data(), static_cast<int64_t>(inp.size()));
  std::vector<double> expected(inp.size());
  for (size_t i = 0; i < inp.size(); ++i) expected[i] = naive_gelu(inp[i]);
  ktest::expect_close("out", out, expected, 1e-15);
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t n = 200;
  auto inp = random_vector(n, 1, -4, 4);
  const auto R = random_vector(n, 2);
  auto loss = [&] {
    std::vector<double> out(n);
    gelu_forward(pool, out.data(), inp.data(), n);
    return ktest::weighted_sum(out, R);
  };
  auto dinp = ktest::nan_vector(n);
  gelu_backward(pool, dinp.data(), inp.data(), R.data(), n);
  ktest::expect_gradient("dinp", inp, loss, dinp);
}

TEST(Gelu, InPlaceAndFloatMatchDouble) {
  ThreadPool pool(2);
  const int64_t n = 5000;
  const auto inp = random_vector(n, 1, -5, 5), dout = random_vector(n, 2);
  std::vector<double> out(n), dinp(n);
  gelu_forward(pool, out.data(), inp.data(), n);
  gelu_backward(pool, dinp.data(), inp.data(), dout.data(), n);
  auto x = convert<float>(inp);
  auto d = convert<float>(dout);
  std::vector<float> out_f(n);
  gelu_forward(pool, out_f.data(), x.data(), n);
  gelu_backward(pool, d.data(), x.data(), d.data(), n);  // dinp aliasing dout
  gelu_forward(pool, x.data(), x.data(), n);             // out aliasing inp
  ktest::expect_close("out", out_f, out, 1e-6);
  ktest::expect_close("out in place", x, out, 1e-6);
  ktest::expect_close("dinp in place", d, dinp, 1e-6);
}

TEST(Gelu, BitwiseSameForAnyPoolSize) {
  const int64_t n = 100000;  // several parallel ranges
  const auto inp = convert<float>(random_vector(n, 1, -5, 5));
  const auto dout = convert<float>(random_vector(n, 2));
  auto runs = ktest::expect_reproducible("gelu", [&](ThreadPool& pool) {
    std::vector<float> out(n), dinp(n);
    gelu_forward(pool, out.data(), inp.data(), n);
    gelu_backward(pool, dinp.data(), inp.data(), dout.data(), n);
    out.insert(out.end(), dinp.begin(), dinp.end());
    return out;
  });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

// Where the CPU has AVX-512, float GELU runs 16 lanes at a time; those lanes must give exactly
// the bits of the 8-lane code (and so of any other split), tails included.
TEST(Gelu, SixteenLanesGiveTheBitsOfEight) {
#ifndef __AVX2__
  GTEST_SKIP() << "no vectorised GELU in this build";
#else
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F";
  const int64_t n = 4096 + 13;  // a tail shorter than either width
  auto x = ktest::convert<float>(ktest::random_vector(n, 21, -12.0, 12.0));
  for (int64_t i = 0; i < 64; ++i) x[i] *= 1e-3f;  // the small-|u| branch of tanh
  const auto dout = ktest::convert<float>(ktest::random_vector(n, 22));
  std::vector<float> y8(n), y16(n), d8(n), d16(n);
  detail::gelu_forward_chunk(y8.data(), x.data(), n, false);
  detail::gelu_forward_chunk(y16.data(), x.data(), n, true);
  detail::gelu_backward_chunk(d8.data(), x.data(), dout.data(), n, false);
  detail::gelu_backward_chunk(d16.data(), x.data(), dout.data(), n, true);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&y8[i], &y16[i], sizeof(float)), 0) << "forward, x[" << i << "]";
    ASSERT_EQ(std::memcmp(&d8[i], &d16[i], sizeof(float)), 0) << "backward, x[" << i << "]";
  }
#endif
}

}  // namespace
}  // namespace loom::cpu
