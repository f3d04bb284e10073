#include "kernels/cpu/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

constexpr double kEps = 1e-5;

TEST(RmsNorm, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t N = 40, C = 12;
  // Rows of small values too (×1e-3): there eps is a sizeable part of the mean square.
  auto inp = random_vector(N * C, 1, -2, 2);
  for (int64_t i = 0; i < 5 * C; ++i) inp[i] *= 1e-3;
  const auto weight = random_vector(C, 2);
  std::vector<double> out(N * C), rstd(N);
  rmsnorm_forward(pool, out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  std::vector<double> expected(N * C), expected_rstd(N);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += inp[n * C + c] * inp[n * C + c] / C;
    expected_rstd[n] = 1 / std::sqrt(ms + kEps);
    for (int64_t c = 0; c < C; ++c)
      expected[n * C + c] = inp[n * C + c] * expected_rstd[n] * weight[c];
  }
  ktest::expect_close("out", out, expected, 1e-13);
  ktest::expect_close("rstd", rstd, expected_rstd, 1e-13);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 70, C = 8;  // 70 rows: three reduction chunks, the last one partial
  auto inp = random_vector(N * C, 1), weight = random_vector(C, 2);
  const auto R = random_vector(N * C, 4);
  std::vector<double> out(N * C), rstd(N);
  auto loss = [&] {
    rmsnorm_forward(pool, out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
    return ktest::weighted_sum(out, R);
  };
  loss();
  auto dinp = ktest::nan_vector(N * C);
  const auto dweight0 = random_vector(C, 5);
  auto dweight = dweight0;  // accumulated: the old values must stay in
  rmsnorm_backward(pool, dinp.data(), dweight.data(), R.data(), inp.data(), weight.data(),
                   rstd.data(), N, C);
  for (int64_t c = 0; c < C; ++c) dweight[c] -= dweight0[c];
  ktest::expect_gradient("dinp", inp, loss, dinp);
  ktest::expect_gradient("dweight", weight, loss, dweight);
}

// Runs forward and backward in Real; returns out, rstd, dinp, dweight in a row.
template <typename Real>
std::vector<Real> run_rmsnorm(ThreadPool& pool, int64_t N, int64_t C) {
  const auto inp = convert<Real>(random_vector(N * C, 1, -2, 2));
  const auto weight = convert<Real>(random_vector(C, 2));
  const auto dout = convert<Real>(random_vector(N * C, 4));
  std::vector<Real> out(N * C), rstd(N), dinp(N * C), dweight(C, 0);
  rmsnorm_forward(pool, out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  rmsnorm_backward(pool, dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(),
                   rstd.data(), N, C);
  for (const auto* v : {&rstd, &dinp, &dweight}) out.insert(out.end(), v->begin(), v->end());
  return out;
}

TEST(RmsNorm, FloatMatchesDouble) {
  ThreadPool pool(2);
  ktest::expect_close("all outputs", run_rmsnorm<float>(pool, 50, 32),
                      run_rmsnorm<double>(pool, 50, 32), 1e-5);
}

TEST(RmsNorm, BitwiseSameForAnyPoolSize) {
  auto runs = ktest::expect_reproducible(
      "rmsnorm", [](ThreadPool& pool) { return run_rmsnorm<float>(pool, 300, 48); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

// The op with the skip connection's gradient is, on the CPU, the backward then add_inplace: the
// same dweight and dinp + dresidual, bit for bit.
TEST(RmsNorm, BackwardAddingIsTheBackwardThenTheAdd) {
  ThreadPool pool(3);
  const Exec ex{&pool, Device::cpu()};
  const int64_t N = 45, C = 24;
  const auto inp = convert<float>(random_vector(N * C, 1, -2, 2));
  const auto weight = convert<float>(random_vector(C, 2));
  const auto dout = convert<float>(random_vector(N * C, 3));
  const auto dres = convert<float>(random_vector(N * C, 4, -50, 50));
  std::vector<float> out(N * C), rstd(N);
  ops::rmsnorm_forward<float>(ex, out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  std::vector<float> direct(out.size()), direct_dw = convert<float>(random_vector(C, 5));
  std::vector<float> fused(out.size()), fused_dw = direct_dw;
  rmsnorm_backward<float>(pool, direct.data(), direct_dw.data(), dout.data(), inp.data(),
                          weight.data(), rstd.data(), N, C);
  for (size_t i = 0; i < direct.size(); ++i) direct[i] += dres[i];
  ops::rmsnorm_backward_adding<float>(ex, fused.data(), fused_dw.data(), dout.data(), inp.data(),
                                      weight.data(), rstd.data(), dres.data(), N, C);
  EXPECT_TRUE(ktest::bitwise_equal(fused, direct)) << "dinp + dresidual";
  EXPECT_TRUE(ktest::bitwise_equal(fused_dw, direct_dw)) << "dweight";
}

// A row split over P ranks (OLMo 2's query/key norms under tp): each rank's partial sums, added
// up over the ranks as the group's all-reduce adds them, then each rank's columns of the forward
// and backward — together the whole row's RMSNorm: out, rstd, dinp and the weight's gradient
// (each rank's slice accumulated onto what it held) to rounding.
TEST(RmsNorm, RowsSplitOverRanksAreTheWholeRowsNorm) {
  ThreadPool pool(2);
  const int64_t N = 37, C = 48;
  auto inp = random_vector(N * C, 1, -2, 2);
  for (int64_t i = 0; i < 3 * C; ++i) inp[i] *= 1e-3;  // eps a sizeable part of these rows
  const auto weight = random_vector(C, 2), dout = random_vector(N * C, 3);
  const auto dweight0 = random_vector(C, 4);
  std::vector<double> out(N * C), rstd(N), dinp(N * C), dweight = dweight0;
  rmsnorm_forward(pool, out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  rmsnorm_backward(pool, dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(),
                   rstd.data(), N, C);
  for (const int64_t P : {1, 2, 3}) {
    const int64_t w = C / P;
    // Rank p's columns [p·w, (p + 1)·w) of a (N, C) matrix, as a (N, w) one.
    const auto columns = [&](const std::vector<double>& m, int64_t p) {
      std::vector<double> cols(N * w);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t c = 0; c < w; ++c) cols[r * w + c] = m[r * C + p * w + c];
      return cols;
    };
    std::vector<double> sums(N, 0), dots(N, 0), part(N);
    for (int64_t p = 0; p < P; ++p) {
      const auto x = columns(inp, p), dy = columns(dout, p);
      rmsnorm_partial_sums<double>(pool, part.data(), x.data(), x.data(), nullptr, N, w);
      for (int64_t r = 0; r < N; ++r) sums[r] += part[r];
      rmsnorm_partial_sums<double>(pool, part.data(), dy.data(), x.data(), weight.data() + p * w, N,
                                   w);
      for (int64_t r = 0; r < N; ++r) dots[r] += part[r];
    }
    for (int64_t p = 0; p < P; ++p) {
      const auto x = columns(inp, p), dy = columns(dout, p);
      std::vector<double> y(N * w), s(N), dx(N * w);
      std::vector<double> dw(dweight0.begin() + p * w, dweight0.begin() + (p + 1) * w);
      rmsnorm_forward_of_sums<double>(pool, y.data(), s.data(), sums.data(), x.data(),
                                      weight.data() + p * w, N, w, C, kEps);
      rmsnorm_backward_of_dots<double>(pool, dx.data(), dw.data(), dy.data(), x.data(),
                                       weight.data() + p * w, s.data(), dots.data(), N, w, C);
      const std::string rank = "P = " + std::to_string(P) + ", rank " + std::to_string(p) + ": ";
      ktest::expect_close(rank + "out", y, columns(out, p), 1e-12);
      ktest::expect_close(rank + "rstd", s, rstd, 1e-12);
      ktest::expect_close(rank + "dinp", dx, columns(dinp, p), 1e-12);
      ktest::expect_close(
          rank + "dweight", dw,
          std::vector<double>(dweight.begin() + p * w, dweight.begin() + (p + 1) * w), 1e-12);
    }
  }
}

}  // namespace
}  // namespace loom::cpu
