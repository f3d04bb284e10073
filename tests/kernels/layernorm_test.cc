#include "kernels/cpu/layernorm.h"

#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

TEST(LayerNorm, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t N = 40, C = 12;
  // An offset far larger than the spread: a one-pass variance would lose digits here.
  auto inp = random_vector(N * C, 1);
  for (double& x : inp) x += 1000.0;
  const auto weight = random_vector(C, 2), bias = random_vector(C, 3);
  std::vector<double> out(N * C), mean(N), rstd(N);
  layernorm_forward(pool, out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                    bias.data(), N, C);
  std::vector<double> expected(N * C), expected_mean(N), expected_rstd(N);
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) m += inp[n * C + c] / C;
    for (int64_t c = 0; c < C; ++c) var += (inp[n * C + c] - m) * (inp[n * C + c] - m) / C;
    expected_mean[n] = m;
    expected_rstd[n] = 1 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < C; ++c)
      expected[n * C + c] = (inp[n * C + c] - m) * expected_rstd[n] * weight[c] + bias[c];
  }
  ktest::expect_close("out", out, expected, 1e-11);
  ktest::expect_close("mean", mean, expected_mean, 1e-14);
  ktest::expect_close("rstd", rstd, expected_rstd, 1e-11);
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 70, C = 8;  // 70 rows: three reduction chunks, the last one partial
  auto inp = random_vector(N * C, 1), weight = random_vector(C, 2), bias = random_vector(C, 3);
  const auto R = random_vector(N * C, 4);
  std::vector<double> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    layernorm_forward(pool, out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                      bias.data(), N, C);
    return ktest::weighted_sum(out, R);
  };
  loss();
  auto dinp = ktest::nan_vector(N * C);
  const auto dweight0 = random_vector(C, 5), dbias0 = random_vector(C, 6);
  auto dweight = dweight0, dbias = dbias0;
  layernorm_backward(pool, dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);
  for (int64_t c = 0; c < C; ++c) {
    dweight[c] -= dweight0[c];
    dbias[c] -= dbias0[c];
  }
  ktest::expect_gradient("dinp", inp, loss, dinp);
  ktest::expect_gradient("dweight", weight, loss, dweight);
  ktest::expect_gradient("dbias", bias, loss, dbias);
}

// Runs forward and backward in Real; returns out, mean, rstd, dinp, dweight, dbias in a row.
template <typename Real>
std::vector<Real> run_layernorm(ThreadPool& pool, int64_t N, int64_t C) {
  const auto inp = convert<Real>(random_vector(N * C, 1, -2, 2));
  const auto weight = convert<Real>(random_vector(C, 2)), bias = convert<Real>(random_vector(C, 3));
  const auto dout = convert<Real>(random_vector(N * C, 4));
  std::vector<Real> out(N * C), mean(N), rstd(N), dinp(N * C), dweight(C, 0), dbias(C, 0);
  layernorm_forward(pool, out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                    bias.data(), N, C);
  layernorm_backward(pool, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                     weight.data(), mean.data(), rstd.data(), N, C);
  for (const auto* v : {&mean, &rstd, &dinp, &dweight, &dbias})
    out.insert(out.end(), v->begin(), v->end());
  return out;
}

TEST(LayerNorm, FloatMatchesDouble) {
  ThreadPool pool(2);
  ktest::expect_close("all outputs", run_layernorm<float>(pool, 50, 32),
                      run_layernorm<double>(pool, 50, 32), 1e-5);
}

TEST(LayerNorm, BitwiseSameForAnyPoolSize) {
  auto runs = ktest::expect_reproducible(
      "layernorm", [](ThreadPool& pool) { return run_layernorm<float>(pool, 300, 48); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

}  // namespace
}  // namespace loom::cpu
