// Loom's own AVX-512 SGEMM (kernels/cpu/sgemm_avx512.h) against a double-precision reference,
// across its register tile (12 × 32) and cache blocks (depth 384, 480 columns, 3072 rows), and the
// property gemm() relies on: an element's bits do not depend on how C is split.
#include "kernels/cpu/sgemm_avx512.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

#define SKIP_WITHOUT_AVX512() \
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F"

// C = alpha·op(A)·op(B) + beta·C in double (ktest::naive_gemm), as a new vector.
std::vector<double> reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                              const std::vector<float>& A, int64_t lda, const std::vector<float>& B,
                              int64_t ldb, double beta, const std::vector<float>& C, int64_t ldc) {
  std::vector<double> out = convert<double>(C);
  ktest::naive_gemm(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, out.data(), ldc);
  return out;
}

struct Shape {
  int64_t M, N, K;
};

// Every transpose, strides padded past the row (the padding must come back untouched), and
// shapes one short of and one past each block: rows 12 / 3072, columns 32 / 480, depth 384; an
// untransposed A both read in place and packed.
TEST(SgemmAvx512, MatchesDoubleAcrossTilesAndBlocks) {
  SKIP_WITHOUT_AVX512();
  // N up to 1024 reads an untransposed A in place; wider products pack it (the 1100 and 1057).
  const Shape shapes[] = {{1, 1, 1},      {11, 31, 7},    {12, 32, 384}, {13, 33, 385},
                          {25, 481, 40},  {37, 95, 769},  {3073, 17, 9}, {5, 961, 3},
                          {13, 1100, 20}, {25, 1057, 390}};
  for (const Shape& s : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t lda = (ta ? s.M : s.K) + 3, a_rows = ta ? s.K : s.M;
        const int64_t ldb = (tb ? s.K : s.N) + 1, b_rows = tb ? s.N : s.K;
        const int64_t ldc = s.N + 2;
        const auto A = convert<float>(random_vector(a_rows * lda, 1));
        const auto B = convert<float>(random_vector(b_rows * ldb, 2));
        const auto C0 = convert<float>(random_vector(s.M * ldc, 3));
        const std::string what = "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) +
                                 " K=" + std::to_string(s.K) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb);
        const auto expected = reference(ta, tb, s.M, s.N, s.K, 0.7, A, lda, B, ldb, -0.3, C0, ldc);
        auto C = C0;
        sgemm_avx512(ta, tb, s.M, s.N, s.K, 0.7f, A.data(), lda, B.data(), ldb, -0.3f, C.data(),
                     ldc);
        // Relative to the largest |value|: float sums of up to 769 products of |x| < 1.
        ktest::expect_close(what, C, expected, 2e-6 * std::sqrt(double(s.K)));
      }
}

// beta == 0 must not read C, NaNs included (BLAS semantics), at every depth block, and
// beta == 1 over several depth blocks adds each block's sum once.
TEST(SgemmAvx512, BetaZeroNeverReadsCAndBetaOneAccumulates) {
  SKIP_WITHOUT_AVX512();
  const int64_t M = 14, N = 40, K = 800;  // three depth blocks
  const auto A = convert<float>(random_vector(M * K, 4));
  const auto B = convert<float>(random_vector(K * N, 5));
  auto C = convert<float>(ktest::nan_vector(M * N));
  sgemm_avx512(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
  const std::vector<float> zeros(M * N, 0.0f);
  ktest::expect_close("beta 0", C, reference(false, false, M, N, K, 1, A, K, B, N, 0, zeros, N),
                      1e-4);
  const auto before = C;
  sgemm_avx512(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 1.0f, C.data(), N);
  ktest::expect_close("beta 1", C, reference(false, false, M, N, K, 1, A, K, B, N, 1, before, N),
                      1e-4);
}

// Any block of C computed on its own gives the same bits as in the whole product: what lets
// gemm() split C across threads without changing the result.
TEST(SgemmAvx512, ABlockOfCIsBitwiseTheSameAsInTheWholeProduct) {
  SKIP_WITHOUT_AVX512();
  const int64_t M = 50, N = 70, K = 400;
  const auto A = convert<float>(random_vector(M * K, 6));
  const auto B = convert<float>(random_vector(N * K, 7));  // op(B) = Bᵀ, as a Linear's weight
  const auto C0 = convert<float>(random_vector(M * N, 8));
  auto whole = C0;
  sgemm_avx512(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, whole.data(), N);
  // Rows [5, 31) × columns [17, 60): neither edge on a tile boundary.
  const int64_t i0 = 5, i1 = 31, j0 = 17, j1 = 60;
  auto part = C0;
  sgemm_avx512(false, true, i1 - i0, j1 - j0, K, 1.0f, A.data() + i0 * K, K, B.data() + j0 * K, K,
               1.0f, part.data() + i0 * N + j0, N);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = j0; j < j1; ++j)
      ASSERT_EQ(std::memcmp(&part[i * N + j], &whole[i * N + j], sizeof(float)), 0)
          << "C(" << i << ", " << j << ")";
}

// Through gemm(): the pool size does not change a bit, since every split gives the same bits.
TEST(SgemmAvx512, GemmGivesTheSameBitsOnAnyPoolSize) {
  SKIP_WITHOUT_AVX512();
  if (cpu_gemm_backend() != CpuGemm::kLoomAvx512) GTEST_SKIP() << "LOOM_CPU_GEMM chose OpenBLAS";
  // Tall products split C's rows, wide ones its columns; the second has three depth blocks and
  // two column blocks.
  const Shape shapes[] = {{300, 200, 100}, {600, 500, 800}, {40, 700, 50}};
  for (const Shape& s : shapes)
    for (int tb = 0; tb < 2; ++tb) {
      const auto A = convert<float>(random_vector(s.M * s.K, 9));
      const auto B = convert<float>(random_vector(s.K * s.N, 10));
      const auto C0 = convert<float>(random_vector(s.M * s.N, 11));
      const int64_t ldb = tb ? s.K : s.N;
      std::vector<std::vector<float>> results;
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        auto C = C0;
        gemm<float>(pool, false, tb, s.M, s.N, s.K, 0.5f, A.data(), s.K, B.data(), ldb, 2.0f,
                    C.data(), s.N);
        results.push_back(C);
      }
      const std::string what = "M=" + std::to_string(s.M) + " tb=" + std::to_string(tb);
      EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), s.M * s.N * sizeof(float)), 0)
          << what << ", 2 threads";
      EXPECT_EQ(std::memcmp(results[0].data(), results[2].data(), s.M * s.N * sizeof(float)), 0)
          << what << ", 3 threads";
      ktest::expect_close(what, results[2],
                          reference(false, tb, s.M, s.N, s.K, 0.5, A, s.K, B, ldb, 2.0, C0, s.N),
                          1e-4);
    }
}

// A bias added as C is stored gives the bits of C filled with the bias and beta = 1 (what
// matmul_forward did before), through column edges, several depth blocks, both layouts of B, A
// read in place and packed, and through gemm() on 1-3 threads (each split takes its columns'
// part of the bias). With a bias, beta must be 0.
TEST(SgemmAvx512, BiasAsCIsStoredGivesTheBitsOfABroadcastAndBetaOne) {
  SKIP_WITHOUT_AVX512();
  if (cpu_gemm_backend() != CpuGemm::kLoomAvx512) GTEST_SKIP() << "LOOM_CPU_GEMM chose OpenBLAS";
  const Shape shapes[] = {{37, 45, 800}, {300, 1100, 100}, {600, 200, 390}};
  for (const Shape& s : shapes)
    for (int tb = 0; tb < 2; ++tb) {
      const auto A = convert<float>(random_vector(s.M * s.K, 12));
      const auto B = convert<float>(random_vector(s.K * s.N, 13));
      const auto bias = convert<float>(random_vector(s.N, 14));
      const int64_t ldb = tb ? s.K : s.N;
      std::vector<float> want(s.M * s.N);
      for (int64_t i = 0; i < s.M; ++i) std::copy(bias.begin(), bias.end(), want.begin() + i * s.N);
      sgemm_avx512(false, tb, s.M, s.N, s.K, 0.5f, A.data(), s.K, B.data(), ldb, 1.0f, want.data(),
                   s.N);
      const std::string what =
          "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) + " tb=" + std::to_string(tb);
      std::vector<float> got(s.M * s.N, std::nanf(""));  // never read
      sgemm_avx512(false, tb, s.M, s.N, s.K, 0.5f, A.data(), s.K, B.data(), ldb, 0.0f, got.data(),
                   s.N, bias.data());
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0) << what;
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        std::vector<float> C(s.M * s.N, std::nanf(""));
        gemm<float>(pool, false, tb, s.M, s.N, s.K, 0.5f, A.data(), s.K, B.data(), ldb, 0.0f,
                    C.data(), s.N, bias.data());
        EXPECT_EQ(std::memcmp(want.data(), C.data(), want.size() * sizeof(float)), 0)
            << what << ", gemm() on " << threads << " thread(s)";
      }
    }
  std::vector<float> C(4), one(4, 1.0f);
  EXPECT_THROW(sgemm_avx512(false, false, 2, 2, 2, 1.0f, one.data(), 2, one.data(), 2, 1.0f,
                            C.data(), 2, one.data()),
               std::runtime_error);
}

// LOOM_CPU_GEMM picks the library; a value it does not know is an error that names it.
TEST(CpuGemmChoice, EnvironmentPicksTheLibraryAndRefusesUnknownValues) {
  const char* old = std::getenv("LOOM_CPU_GEMM");
  const std::string saved = old ? old : "";
  setenv("LOOM_CPU_GEMM", "openblas", 1);
  EXPECT_EQ(cpu_gemm_backend(), CpuGemm::kOpenBlas);
  setenv("LOOM_CPU_GEMM", "mkl", 1);
  try {
    cpu_gemm_backend();
    ADD_FAILURE() << "LOOM_CPU_GEMM=mkl accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_CPU_GEMM='mkl'"), std::string::npos) << e.what();
  }
  setenv("LOOM_CPU_GEMM", "loom", 1);
  if (has_avx512f())
    EXPECT_EQ(cpu_gemm_backend(), CpuGemm::kLoomAvx512);
  else
    EXPECT_THROW(cpu_gemm_backend(), std::runtime_error);
  unsetenv("LOOM_CPU_GEMM");
  EXPECT_EQ(cpu_gemm_backend(), has_avx512f() ? CpuGemm::kLoomAvx512 : CpuGemm::kOpenBlas);
  if (old) setenv("LOOM_CPU_GEMM", saved.c_str(), 1);
}

}  // namespace
}  // namespace loom::cpu
