// Loom's bf16 GEMM (kernels/cpu/sgemm_bf16_avx512.h): the rounding of one operand, then the
// product against a double-precision reference of the rounded operands across the register tile
// (12 × 32) and cache blocks (depth 768, 480 columns, 3072 rows), with vdpbf16ps and with fp32
// FMAs on rounded operands; an element's bits independent of how C is split; gemm() at bf16
// matmul precision (cpu::set_matmul_precision); the choice of kernel.
#include "kernels/cpu/sgemm_bf16_avx512.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "base/error.h"
#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

#define SKIP_WITHOUT_AVX512() \
  if (!has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 F"

// Sets this process's CPU matmul precision for a scope.
struct PrecisionScope {
  explicit PrecisionScope(CpuMatmulPrecision p) { set_matmul_precision(p); }
  ~PrecisionScope() { set_matmul_precision(CpuMatmulPrecision::kFp32); }
};

uint32_t bits(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = round_to_bf16(v[i]);
  return out;
}

// C = alpha·bf16(op(A))·bf16(op(B)) + beta·C in double.
std::vector<double> reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                              const std::vector<float>& A, int64_t lda, const std::vector<float>& B,
                              int64_t ldb, double beta, const std::vector<float>& C, int64_t ldc) {
  std::vector<double> out = convert<double>(C);
  const auto a = rounded(A), b = rounded(B);
  ktest::naive_gemm(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, out.data(), ldc);
  return out;
}

struct Shape {
  int64_t M, N, K;
};

TEST(RoundToBf16, NearestTiesToEvenAndSpecialValues) {
  EXPECT_EQ(round_to_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-9f), 1.0f);            // below half an ulp (2^-7)
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f), 1.0f);            // a tie: to the even 1.0
  EXPECT_EQ(round_to_bf16(1.0f + 0x3p-8f), 1.0f + 0x1p-6f);  // a tie: to the even 1 + 2^-6
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);  // past the tie
  EXPECT_EQ(round_to_bf16(-3.0f), -3.0f);
  EXPECT_EQ(bits(round_to_bf16(-0.0f)), bits(-0.0f));
  EXPECT_EQ(round_to_bf16(std::numeric_limits<float>::max()),
            std::numeric_limits<float>::infinity());  // rounds up past bf16's largest
  EXPECT_EQ(round_to_bf16(-std::numeric_limits<float>::infinity()),
            -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN whose payload sits in the low bits stays a NaN, not an infinity.
  float snan = 0;
  const uint32_t snan_bits = 0x7F800001u;
  std::memcpy(&snan, &snan_bits, sizeof snan);
  EXPECT_TRUE(std::isnan(round_to_bf16(snan)));
  EXPECT_EQ(round_to_bf16(0x1.8p-130f), 0x1.8p-130f);  // a subnormal with few bits stays
}

// Every transpose, strides padded past the row, shapes one short of and one past each block
// (rows 12 / 3072, columns 32 / 480, depth 768), odd depths, and both kernels.
TEST(SgemmBf16Avx512, MatchesDoubleOfTheRoundedOperandsAcrossTilesAndBlocks) {
  SKIP_WITHOUT_AVX512();
  const Shape shapes[] = {{1, 1, 1},      {11, 31, 7},    {12, 32, 768}, {13, 33, 769},
                          {25, 481, 40},  {37, 95, 1537}, {3073, 17, 9}, {5, 961, 3},
                          {13, 1100, 20}, {25, 1057, 390}};
  for (const Bf16Kernel kernel : {Bf16Kernel::kDotProduct, Bf16Kernel::kFmaOnRounded}) {
    if (kernel == Bf16Kernel::kDotProduct && !has_avx512_bf16()) continue;
    const bool fma = kernel == Bf16Kernel::kFmaOnRounded;
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
                                   " tb=" + std::to_string(tb) + (fma ? " fma" : " dot");
          auto C = C0;
          sgemm_bf16_avx512(ta, tb, s.M, s.N, s.K, 0.7f, A.data(), lda, B.data(), ldb, -0.3f,
                            C.data(), ldc, nullptr, kernel);
          // fp32 sums of exact products: as close as sgemm_avx512's. Unrounded operands would
          // be ~1e-3 away (bf16's 8 bits), far outside this.
          ktest::expect_close(what, C,
                              reference(ta, tb, s.M, s.N, s.K, 0.7, A, lda, B, ldb, -0.3, C0, ldc),
                              2e-6 * std::sqrt(double(s.K)));
          // The row padding past each row of C is never written.
          for (int64_t i = 0; i < s.M; ++i)
            for (int64_t j = s.N; j < ldc; ++j)
              ASSERT_EQ(bits(C[i * ldc + j]), bits(C0[i * ldc + j])) << what << " padding";
        }
  }
}

// beta == 0 never reads C (NaN included) at any depth block; beta == 1 accumulates; a bias is
// the bits of C filled with it and beta = 1; a NaN operand reaches its row of C.
TEST(SgemmBf16Avx512, BetaBiasAndNaN) {
  SKIP_WITHOUT_AVX512();
  const int64_t M = 14, N = 40, K = 1700;  // three depth blocks
  const auto A = convert<float>(random_vector(M * K, 4));
  const auto B = convert<float>(random_vector(K * N, 5));
  auto C = convert<float>(ktest::nan_vector(M * N));
  sgemm_bf16_avx512(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
  const std::vector<float> zeros(M * N, 0.0f);
  ktest::expect_close("beta 0", C, reference(false, false, M, N, K, 1, A, K, B, N, 0, zeros, N),
                      1e-4);
  const auto before = C;
  sgemm_bf16_avx512(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 1.0f, C.data(), N);
  ktest::expect_close("beta 1", C, reference(false, false, M, N, K, 1, A, K, B, N, 1, before, N),
                      1e-4);

  const auto bias = convert<float>(random_vector(N, 6));
  std::vector<float> want(M * N);
  for (int64_t i = 0; i < M; ++i) std::copy(bias.begin(), bias.end(), want.begin() + i * N);
  sgemm_bf16_avx512(false, true, M, N, K, 0.5f, A.data(), K, B.data(), K, 1.0f, want.data(), N);
  std::vector<float> got(M * N, std::nanf(""));
  sgemm_bf16_avx512(false, true, M, N, K, 0.5f, A.data(), K, B.data(), K, 0.0f, got.data(), N,
                    bias.data());
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
  EXPECT_THROW(sgemm_bf16_avx512(false, true, M, N, K, 0.5f, A.data(), K, B.data(), K, 1.0f,
                                 got.data(), N, bias.data()),
               std::runtime_error);

  auto with_nan = A;
  with_nan[3 * K + 1000] = std::nanf("");  // row 3, in the second depth block
  sgemm_bf16_avx512(false, false, M, N, K, 1.0f, with_nan.data(), K, B.data(), N, 0.0f, C.data(),
                    N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      ASSERT_EQ(std::isnan(C[i * N + j]), i == 3) << "C(" << i << ", " << j << ")";
}

// Any block of C computed on its own gives the same bits as in the whole product, so gemm()'s
// splits across threads change nothing; and through gemm() at bf16 precision the pool size does
// not change a bit either, and the bits are the kernel's.
TEST(SgemmBf16Avx512, SplitsOfCAndPoolSizesGiveTheSameBits) {
  SKIP_WITHOUT_AVX512();
  for (const Bf16Kernel kernel : {Bf16Kernel::kDotProduct, Bf16Kernel::kFmaOnRounded}) {
    if (kernel == Bf16Kernel::kDotProduct && !has_avx512_bf16()) continue;
    const int64_t M = 50, N = 70, K = 900;
    const auto A = convert<float>(random_vector(M * K, 6));
    const auto B = convert<float>(random_vector(N * K, 7));
    const auto C0 = convert<float>(random_vector(M * N, 8));
    auto whole = C0;
    sgemm_bf16_avx512(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, whole.data(), N,
                      nullptr, kernel);
    const int64_t i0 = 5, i1 = 31, j0 = 17, j1 = 60;
    auto part = C0;
    sgemm_bf16_avx512(false, true, i1 - i0, j1 - j0, K, 1.0f, A.data() + i0 * K, K,
                      B.data() + j0 * K, K, 1.0f, part.data() + i0 * N + j0, N, nullptr, kernel);
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t j = j0; j < j1; ++j)
        ASSERT_EQ(bits(part[i * N + j]), bits(whole[i * N + j])) << "C(" << i << ", " << j << ")";
  }
  const PrecisionScope bf16(CpuMatmulPrecision::kBf16);
  EXPECT_EQ(matmul_precision(), CpuMatmulPrecision::kBf16);
  EXPECT_NE(cpu_gemm_name().find("bf16"), std::string::npos) << cpu_gemm_name();
  const Shape shapes[] = {{300, 200, 100}, {600, 500, 1600}, {40, 700, 50}};
  for (const Shape& s : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t lda = ta ? s.M : s.K, ldb = tb ? s.K : s.N;
        const auto A = convert<float>(random_vector(s.M * s.K, 9));
        const auto B = convert<float>(random_vector(s.K * s.N, 10));
        const auto C0 = convert<float>(random_vector(s.M * s.N, 11));
        auto direct = C0;
        sgemm_bf16_avx512(ta, tb, s.M, s.N, s.K, 0.5f, A.data(), lda, B.data(), ldb, 2.0f,
                          direct.data(), s.N);
        const std::string what =
            "M=" + std::to_string(s.M) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
        for (int threads : {1, 2, 3}) {
          ThreadPool pool(threads);
          auto C = C0;
          gemm<float>(pool, ta, tb, s.M, s.N, s.K, 0.5f, A.data(), lda, B.data(), ldb, 2.0f,
                      C.data(), s.N);
          EXPECT_EQ(std::memcmp(direct.data(), C.data(), C.size() * sizeof(float)), 0)
              << what << ", gemm() on " << threads << " thread(s)";
        }
      }
}

// The precision is the process's: back at fp32, gemm() gives sgemm's unrounded products again.
TEST(SgemmBf16Avx512, Fp32PrecisionLeavesOperandsUnrounded) {
  SKIP_WITHOUT_AVX512();
  const int64_t M = 20, N = 30, K = 40;
  const auto A = convert<float>(random_vector(M * K, 12));
  const auto B = convert<float>(random_vector(K * N, 13));
  const std::vector<float> zeros(M * N, 0.0f);
  ThreadPool pool(1);
  std::vector<float> at_bf16(M * N), at_fp32(M * N);
  {
    const PrecisionScope bf16(CpuMatmulPrecision::kBf16);
    gemm<float>(pool, false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, at_bf16.data(),
                N);
  }
  EXPECT_EQ(matmul_precision(), CpuMatmulPrecision::kFp32);
  gemm<float>(pool, false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, at_fp32.data(), N);
  std::vector<double> exact(M * N, 0.0);
  ktest::naive_gemm(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, exact.data(), N);
  ktest::expect_close("fp32", at_fp32, exact, 1e-5);
  ktest::expect_close("bf16", at_bf16, reference(false, false, M, N, K, 1, A, K, B, N, 0, zeros, N),
                      1e-5);
  double worst = 0;
  for (int64_t i = 0; i < M * N; ++i) worst = std::max(worst, std::abs(at_bf16[i] - exact[i]));
  EXPECT_GT(worst, 1e-3) << "bf16 operands should be visibly rounded";
}

// LOOM_CPU_BF16_KERNEL picks the kernel; without it, vdpbf16ps on AMD CPUs that have it. A value
// it does not know is an error naming it; the GEMM's report names the kernel.
TEST(SgemmBf16Avx512, EnvironmentPicksTheKernel) {
  SKIP_WITHOUT_AVX512();
  const char* old = std::getenv("LOOM_CPU_BF16_KERNEL");
  const std::string saved = old ? old : "";
  setenv("LOOM_CPU_BF16_KERNEL", "fma", 1);
  EXPECT_EQ(bf16_kernel(), Bf16Kernel::kFmaOnRounded);
  {
    const PrecisionScope bf16(CpuMatmulPrecision::kBf16);
    EXPECT_EQ(cpu_gemm_name(), "loom-avx512-bf16-fma");
  }
  setenv("LOOM_CPU_BF16_KERNEL", "dot", 1);
  if (has_avx512_bf16())
    EXPECT_EQ(bf16_kernel(), Bf16Kernel::kDotProduct);
  else
    EXPECT_THROW(bf16_kernel(), Error);
  setenv("LOOM_CPU_BF16_KERNEL", "amx", 1);
  try {
    bf16_kernel();
    ADD_FAILURE() << "LOOM_CPU_BF16_KERNEL=amx accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_CPU_BF16_KERNEL='amx'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(set_matmul_precision(CpuMatmulPrecision::kBf16), Error);
  EXPECT_EQ(matmul_precision(), CpuMatmulPrecision::kFp32);
  unsetenv("LOOM_CPU_BF16_KERNEL");
  __builtin_cpu_init();
  EXPECT_EQ(bf16_kernel(), has_avx512_bf16() && __builtin_cpu_is("amd")
                               ? Bf16Kernel::kDotProduct
                               : Bf16Kernel::kFmaOnRounded);
  if (old) setenv("LOOM_CPU_BF16_KERNEL", saved.c_str(), 1);
}

}  // namespace
}  // namespace loom::cpu
