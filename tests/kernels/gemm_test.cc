#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::naive_gemm;
using ktest::random_vector;

struct GemmCase {
  int64_t M, N, K;
};

// Small (serial), tall (split along M) and wide (split along N) products, every transpose
// combination, strides padded beyond the row length, beta != 0.
TEST(Gemm, MatchesNaiveForAllTransposesAndSplits) {
  for (GemmCase g : {GemmCase{7, 5, 6}, GemmCase{200, 40, 40}, GemmCase{8, 400, 100}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (int threads : {1, 3}) {
          ThreadPool pool(threads);
          const int64_t lda = (ta ? g.M : g.K) + 3, a_rows = ta ? g.K : g.M;
          const int64_t ldb = (tb ? g.K : g.N) + 2, b_rows = tb ? g.N : g.K;
          const int64_t ldc = g.N + 5;
          const auto A = random_vector(a_rows * lda, 1);
          const auto B = random_vector(b_rows * ldb, 2);
          const auto C0 = random_vector(g.M * ldc, 3);
          const std::string what = "M=" + std::to_string(g.M) + " N=" + std::to_string(g.N) +
                                   " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                                   " threads=" + std::to_string(threads);
          auto expected = C0;
          naive_gemm<double>(ta, tb, g.M, g.N, g.K, 0.7, A.data(), lda, B.data(), ldb, -0.3,
                             expected.data(), ldc);
          auto C = C0;  // padding columns must come back untouched: compared too
          gemm<double>(pool, ta, tb, g.M, g.N, g.K, 0.7, A.data(), lda, B.data(), ldb, -0.3,
                       C.data(), ldc);
          ktest::expect_close("double " + what, C, expected, 1e-12);
          auto Cf = convert<float>(C0);
          const auto Af = convert<float>(A), Bf = convert<float>(B);
          gemm<float>(pool, ta, tb, g.M, g.N, g.K, 0.7f, Af.data(), lda, Bf.data(), ldb, -0.3f,
                      Cf.data(), ldc);
          ktest::expect_close("float " + what, Cf, expected, 1e-5);
        }
  }
}

TEST(Gemm, BetaZeroIgnoresOldContents) {
  ThreadPool pool(2);
  const auto A = random_vector(4 * 3, 1), B = random_vector(3 * 5, 2);
  auto C = ktest::nan_vector(4 * 5);
  std::vector<double> expected(4 * 5, 0.0);
  naive_gemm<double>(false, false, 4, 5, 3, 1.0, A.data(), 3, B.data(), 5, 0.0, expected.data(), 5);
  gemm<double>(pool, false, false, 4, 5, 3, 1.0, A.data(), 3, B.data(), 5, 0.0, C.data(), 5);
  ktest::expect_close("C", C, expected, 1e-14);
}

TEST(Gemm, EmptyInnerDimensionScalesC) {
  ThreadPool pool(1);
  std::vector<double> C{1, 2, 3, 4};
  gemm<double>(pool, false, false, 2, 2, 0, 1.0, nullptr, 0, nullptr, 0, 0.5, C.data(), 2);
  EXPECT_EQ(C, (std::vector<double>{0.5, 1, 1.5, 2}));
}

// out = inp · weightᵀ + bias, directly from the definition.
std::vector<double> naive_matmul(const std::vector<double>& inp, const std::vector<double>& weight,
                                 const double* bias, int64_t N, int64_t C, int64_t OC) {
  std::vector<double> out(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = bias ? bias[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) acc += inp[n * C + c] * weight[o * C + c];
      out[n * OC + o] = acc;
    }
  return out;
}

TEST(Matmul, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t N = 9, C = 7, OC = 5;
  const auto inp = random_vector(N * C, 1), weight = random_vector(OC * C, 2);
  const auto bias = random_vector(OC, 3);
  for (const double* b : {bias.data(), static_cast<const double*>(nullptr)}) {
    auto out = ktest::nan_vector(N * OC);
    matmul_forward(pool, out.data(), inp.data(), weight.data(), b, N, C, OC);
    ktest::expect_close(b ? "with bias" : "without bias", out,
                        naive_matmul(inp, weight, b, N, C, OC), 1e-14);
  }
}

TEST(Matmul, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 6, C = 5, OC = 4;
  auto inp = random_vector(N * C, 1), weight = random_vector(OC * C, 2),
       bias = random_vector(OC, 3);
  const auto R = random_vector(N * OC, 4);
  auto loss = [&] {
    std::vector<double> out(N * OC);
    matmul_forward(pool, out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    return ktest::weighted_sum(out, R);
  };
  // Activation gradients are overwritten (NaN must vanish), parameter gradients accumulate.
  auto dinp = ktest::nan_vector(N * C);
  const auto dweight0 = random_vector(OC * C, 5), dbias0 = random_vector(OC, 6);
  auto dweight = dweight0, dbias = dbias0;
  matmul_backward(pool, dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(),
                  weight.data(), N, C, OC);
  for (size_t i = 0; i < dweight.size(); ++i) dweight[i] -= dweight0[i];
  for (size_t i = 0; i < dbias.size(); ++i) dbias[i] -= dbias0[i];
  ktest::expect_gradient("dinp", inp, loss, dinp);
  ktest::expect_gradient("dweight", weight, loss, dweight);
  ktest::expect_gradient("dbias", bias, loss, dbias);

  // Skipping dinp and dbias leaves dweight as it was.
  std::vector<double> dweight_only(OC * C, 0.0);
  matmul_backward<double>(pool, nullptr, dweight_only.data(), nullptr, R.data(), inp.data(),
                          weight.data(), N, C, OC);
  ktest::expect_close("dweight without dinp", dweight_only, dweight, 1e-14);
}

TEST(Matmul, FloatMatchesDouble) {
  ThreadPool pool(2);
  const int64_t N = 33, C = 24, OC = 40;
  const auto inp = random_vector(N * C, 1), weight = random_vector(OC * C, 2);
  const auto bias = random_vector(OC, 3), dout = random_vector(N * OC, 4);
  std::vector<double> out(N * OC), dinp(N * C), dweight(OC * C, 0.0), dbias(OC, 0.0);
  matmul_forward(pool, out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  matmul_backward(pool, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                  weight.data(), N, C, OC);
  const auto inp_f = convert<float>(inp), weight_f = convert<float>(weight);
  const auto bias_f = convert<float>(bias), dout_f = convert<float>(dout);
  std::vector<float> out_f(N * OC), dinp_f(N * C), dweight_f(OC * C, 0.f), dbias_f(OC, 0.f);
  matmul_forward(pool, out_f.data(), inp_f.data(), weight_f.data(), bias_f.data(), N, C, OC);
  matmul_backward(pool, dinp_f.data(), dweight_f.data(), dbias_f.data(), dout_f.data(),
                  inp_f.data(), weight_f.data(), N, C, OC);
  ktest::expect_close("out", out_f, out, 1e-5);
  ktest::expect_close("dinp", dinp_f, dinp, 1e-5);
  ktest::expect_close("dweight", dweight_f, dweight, 1e-5);
  ktest::expect_close("dbias", dbias_f, dbias, 1e-5);
}

TEST(Matmul, ReproducibleForAPoolSize) {
  const int64_t N = 256, C = 64, OC = 96;  // large enough for gemm() to split
  const auto inp = convert<float>(random_vector(N * C, 1));
  const auto weight = convert<float>(random_vector(OC * C, 2));
  const auto bias = convert<float>(random_vector(OC, 3));
  const auto dout = convert<float>(random_vector(N * OC, 4));
  auto runs = ktest::expect_reproducible("matmul", [&](ThreadPool& pool) {
    std::vector<float> out(N * OC), dinp(N * C), dweight(OC * C, 0.f), dbias(OC, 0.f);
    matmul_forward(pool, out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    matmul_backward(pool, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                    weight.data(), N, C, OC);
    out.insert(out.end(), dinp.begin(), dinp.end());
    out.insert(out.end(), dweight.begin(), dweight.end());
    out.insert(out.end(), dbias.begin(), dbias.end());
    return out;
  });
  ktest::expect_close("1 vs 3 threads", runs[1], runs[0], 1e-6);
}

}  // namespace
}  // namespace loom::cpu
