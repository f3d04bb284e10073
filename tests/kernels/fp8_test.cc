// fp8 GEMM operands on CPU ranks (kernels/cpu/fp8.h): E4M3 rounding, block quantization (power-of-
// two scales, blocks independent of each other, exact in bf16), and the Linear's fp8 forward and
// backward against double-precision GEMMs of the quantized operands.
#include "kernels/cpu/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/sgemm_bf16_avx512.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

uint32_t bits(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

TEST(RoundToE4m3, NearestTiesToEvenSaturatingAndSubnormal) {
  EXPECT_EQ(round_to_e4m3(1.0f), 1.0f);
  EXPECT_EQ(round_to_e4m3(1.0625f), 1.0f);   // a tie (1 + 2^-4): to the even 1.0
  EXPECT_EQ(round_to_e4m3(1.1875f), 1.25f);  // a tie between 1.125 (odd) and 1.25
  EXPECT_EQ(round_to_e4m3(1.07f), 1.125f);   // past the tie
  EXPECT_EQ(round_to_e4m3(-3.3f), -3.25f);
  EXPECT_EQ(round_to_e4m3(448.0f), 448.0f);  // the largest
  EXPECT_EQ(round_to_e4m3(460.0f), 448.0f);  // saturated, never 480 (E4M3FN has no 480)
  EXPECT_EQ(round_to_e4m3(-1e6f), -448.0f);
  EXPECT_EQ(round_to_e4m3(std::numeric_limits<float>::infinity()), 448.0f);
  EXPECT_EQ(round_to_e4m3(0x1p-6f), 0x1p-6f);   // the smallest normal
  EXPECT_EQ(round_to_e4m3(0x1p-9f), 0x1p-9f);   // the smallest subnormal
  EXPECT_EQ(round_to_e4m3(0x1p-10f), 0.0f);     // a tie: to the even 0
  EXPECT_EQ(round_to_e4m3(0x3p-10f), 0x1p-8f);  // a tie between 2^-9 (odd) and 2^-8
  EXPECT_EQ(round_to_e4m3(0x5p-9f), 0x5p-9f);   // subnormals are multiples of 2^-9
  EXPECT_EQ(bits(round_to_e4m3(-0.0f)), bits(-0.0f));
  EXPECT_TRUE(std::isnan(round_to_e4m3(std::nanf(""))));
}

// Every block's values are E4M3 values over one power-of-two scale that brings the block's largest
// |value| into (224, 448]; each value is within half an E4M3 step of its input; the output is
// exact in bf16; blocks of zeros stay zeros and a block with an infinity is copied.
TEST(QuantizeFp8Blocks, PowerOfTwoScalesPerBlock) {
  const int64_t rows = 37, cols = 50, br = 8, bc = 16;
  std::vector<float> in = convert<float>(random_vector(rows * cols, 21));
  // Blocks of very different magnitudes, and one of zeros, one with an infinity.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      in[r * cols + c] *= std::ldexp(1.0f, int((r / br) * 5 - (c / bc) * 7));
  for (int64_t r = 8; r < 16; ++r)
    for (int64_t c = 16; c < 32; ++c) in[r * cols + c] = 0;
  in[20 * cols + 40] = std::numeric_limits<float>::infinity();
  ThreadPool pool(3);
  std::vector<float> out(rows * cols);
  quantize_fp8_blocks(pool, out.data(), cols, in.data(), cols, rows, cols, br, bc);
  for (int64_t r0 = 0; r0 < rows; r0 += br)
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t r1 = std::min(rows, r0 + br), c1 = std::min(cols, c0 + bc);
      float amax = 0;
      bool finite = true;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          amax = std::max(amax, std::fabs(in[r * cols + c]));
          finite = finite && std::isfinite(in[r * cols + c]);
        }
      const std::string where = "block (" + std::to_string(r0) + ", " + std::to_string(c0) + ")";
      if (!finite || amax == 0) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c)
            ASSERT_EQ(bits(out[r * cols + c]), bits(in[r * cols + c])) << where;
        continue;
      }
      const float s = std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(448.0 / amax))));
      ASSERT_GT(amax * s, 224.0f) << where;
      ASSERT_LE(amax * s, 448.0f) << where;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float x = in[r * cols + c], q = out[r * cols + c];
          ASSERT_EQ(round_to_e4m3(q * s), q * s) << where << " is not an E4M3 value over " << s;
          ASSERT_EQ(q, round_to_e4m3(x * s) / s) << where;
          ASSERT_EQ(round_to_bf16(q), q) << where << ": not exact in bf16";
          if (std::fabs(x * s) >= 0x1p-6f) {
            ASSERT_LE(std::fabs(q - x), std::fabs(x) / 16) << where;
          }
        }
    }
}

// Ties and edges through the quantizer (its vector path where the CPU has AVX-512): a block whose
// largest |value| is 448 has scale 1, so each value must come out as round_to_e4m3 of itself.
TEST(QuantizeFp8Blocks, TiesAndEdgesRoundAsTheScalarReference) {
  const std::vector<float> in = {448.0f,   1.0625f, 1.1875f,   0x1p-10f, 0x3p-10f, -1.0625f,
                                 -1.1875f, 0x1p-6f, 0x5p-9f,   240.0f,   -232.0f,  0.0f,
                                 -0.0f,    1.07f,   0x1.2p-7f, 3.3f,     17.5f};
  const std::vector<float> want = {448.0f, 1.0f,    1.25f,   0.0f,   0x1p-8f, -1.0f,
                                   -1.25f, 0x1p-6f, 0x5p-9f, 240.0f, -224.0f, 0.0f,
                                   -0.0f,  1.125f,  0x1p-7f, 3.25f,  18.0f};
  ThreadPool pool(1);
  std::vector<float> out(in.size());
  const int64_t n = static_cast<int64_t>(in.size());
  quantize_fp8_blocks(pool, out.data(), n, in.data(), n, 1, n, 1, n);
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(bits(out[i]), bits(want[i])) << in[i] << " -> " << out[i];
    EXPECT_EQ(bits(out[i]), bits(round_to_e4m3(in[i]))) << in[i];
  }
}

// A block depends on its own values only: quantizing a slice of columns that starts and ends on
// block boundaries gives the bits of the same columns of the whole (a tensor-parallel shard
// quantizes as one device), for 1 × b, b × 1 and b × b blocks.
TEST(QuantizeFp8Blocks, AShardOnBlockBoundariesQuantizesAsTheWhole) {
  const int64_t rows = 48, cols = 64, b = 16;
  const std::vector<float> in = convert<float>(random_vector(rows * cols, 22));
  ThreadPool pool(2);
  for (const auto& [br, bc] : {std::pair<int64_t, int64_t>{1, b}, {b, 1}, {b, b}}) {
    std::vector<float> whole(rows * cols), shard(rows * 32);
    quantize_fp8_blocks(pool, whole.data(), cols, in.data(), cols, rows, cols, br, bc);
    quantize_fp8_blocks(pool, shard.data(), 32, in.data() + 32, cols, rows, 32, br, bc);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < 32; ++c)
        ASSERT_EQ(bits(shard[r * 32 + c]), bits(whole[r * cols + 32 + c]))
            << br << " x " << bc << " at (" << r << ", " << c << ")";
  }
}

// The Linear at fp8: the products of the quantized operands (DeepSeek-V3's blocks), summed in
// fp32; visibly away from the fp32 Linear.
TEST(MatmulFp8, ForwardAndBackwardAreGemmsOfTheQuantizedOperands) {
  if (!has_avx512f()) GTEST_SKIP() << "the bf16 GEMM under fp8 needs AVX-512";
  const int64_t N = 40, C = 48, OC = 36, b = 16;
  const auto inp = convert<float>(random_vector(N * C, 23));
  const auto weight = convert<float>(random_vector(OC * C, 24, -0.1, 0.1));
  const auto bias = convert<float>(random_vector(OC, 25));
  const auto dout = convert<float>(random_vector(N * OC, 26, -1e-3, 1e-3));
  ThreadPool pool(2);
  const auto quantized = [&](const std::vector<float>& x, int64_t r, int64_t c, int64_t br,
                             int64_t bc) {
    std::vector<float> q(x.size());
    quantize_fp8_blocks(pool, q.data(), c, x.data(), c, r, c, br, bc);
    return q;
  };
  std::vector<float> out(N * OC);
  matmul_forward_fp8(pool, out.data(), inp.data(), weight.data(), bias.data(), N, C, OC, b);
  std::vector<double> want(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) want[n * OC + o] = bias[o];
  const auto xq = quantized(inp, N, C, 1, b), wq = quantized(weight, OC, C, b, b);
  ktest::naive_gemm(false, true, N, OC, C, 1.0, xq.data(), C, wq.data(), C, 1.0, want.data(), OC);
  ktest::expect_close("forward", out, want, 1e-5);
  std::vector<double> exact(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) exact[n * OC + o] = bias[o];
  ktest::naive_gemm(false, true, N, OC, C, 1.0, inp.data(), C, weight.data(), C, 1.0, exact.data(),
                    OC);
  double worst = 0;
  for (int64_t i = 0; i < N * OC; ++i) worst = std::max(worst, std::fabs(out[i] - exact[i]));
  EXPECT_GT(worst, 1e-3) << "fp8 operands should be visibly rounded";

  std::vector<float> dinp(N * C), dweight(OC * C, 0.5f), dbias(OC, 0.25f);
  matmul_backward_fp8(pool, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                      weight.data(), N, C, OC, b);
  std::vector<double> want_dinp(N * C, 0.0), want_dweight(OC * C, 0.5);
  const auto dq_rows = quantized(dout, N, OC, 1, b), dq_cols = quantized(dout, N, OC, b, 1);
  const auto xq_cols = quantized(inp, N, C, b, 1);
  ktest::naive_gemm(false, false, N, C, OC, 1.0, dq_rows.data(), OC, wq.data(), C, 0.0,
                    want_dinp.data(), C);
  ktest::naive_gemm(true, false, OC, C, N, 1.0, dq_cols.data(), OC, xq_cols.data(), C, 1.0,
                    want_dweight.data(), C);
  ktest::expect_close("dinp", dinp, want_dinp, 1e-5);
  ktest::expect_close("dweight", dweight, want_dweight, 1e-5);
  for (int64_t o = 0; o < OC; ++o) {  // the bias gradient from the fp32 dout
    double sum = 0.25;
    for (int64_t n = 0; n < N; ++n) sum += dout[n * OC + o];
    EXPECT_NEAR(dbias[o], sum, 1e-6) << o;
  }
}

}  // namespace
}  // namespace loom::cpu
