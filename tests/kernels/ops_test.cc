// kernels/ops.h on the CPU: each op is its CPU kernel, bit for bit, on the Exec's pool; a GPU
// Exec in a build without CUDA, or f64 on a GPU, is a clear error rather than a crash. (The CUDA
// side is tests/cuda/cuda_kernels_test.cc, on a GPU.)
#include "kernels/ops.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/error.h"
#include "device/allocator.h"
#include "kernel_test_util.h"
#include "kernels/cpu/cpu_features.h"

namespace loom {
namespace {

using cpu::ktest::bitwise_equal;
using cpu::ktest::convert;
using cpu::ktest::random_vector;

TEST(Ops, OnTheCpuEachOpIsItsCpuKernel) {
  ThreadPool pool(3);
  const Exec ex{&pool, Device::cpu()};
  const int64_t N = 37, C = 24, OC = 40;
  const std::vector<float> inp = convert<float>(random_vector(N * C, 1));
  const std::vector<float> w = convert<float>(random_vector(OC * C, 2));
  const std::vector<float> b = convert<float>(random_vector(OC, 3));
  std::vector<float> via_ops(N * OC), direct(N * OC);
  ops::matmul_forward<float>(ex, via_ops.data(), inp.data(), w.data(), b.data(), N, C, OC);
  cpu::matmul_forward<float>(pool, direct.data(), inp.data(), w.data(), b.data(), N, C, OC);
  EXPECT_TRUE(bitwise_equal(via_ops, direct));

  std::vector<float> ln_ops(N * C), ln_cpu(N * C), mean(N), rstd(N);
  const std::vector<float> gamma = convert<float>(random_vector(C, 4));
  const std::vector<float> beta = convert<float>(random_vector(C, 5));
  ops::layernorm_forward<float>(ex, ln_ops.data(), mean.data(), rstd.data(), inp.data(),
                                gamma.data(), beta.data(), N, C);
  cpu::layernorm_forward<float>(pool, ln_cpu.data(), mean.data(), rstd.data(), inp.data(),
                                gamma.data(), beta.data(), N, C);
  EXPECT_TRUE(bitwise_equal(ln_ops, ln_cpu));
  EXPECT_EQ(ops::sum_squares<float>(ex, inp.data(), N * C),
            cpu::sum_squares<float>(pool, inp.data(), N * C));
  // f64 runs on the CPU (gradient checks).
  const std::vector<double> d = random_vector(100, 6);
  EXPECT_EQ(ops::sum<double>(ex, d.data(), 100), cpu::sum<double>(pool, d.data(), 100));
}

// The op profile counts each op kind's calls and times them while on, and nothing while off.
TEST(Ops, TheProfileTimesEachOpKindWhileOn) {
  ThreadPool pool(2);
  const Exec ex{&pool, Device::cpu()};
  const int64_t N = 64, C = 48, OC = 96;
  const std::vector<float> inp = convert<float>(random_vector(N * C, 1));
  const std::vector<float> w = convert<float>(random_vector(OC * C, 2));
  std::vector<float> out(N * OC);
  ops::matmul_forward<float>(ex, out.data(), inp.data(), w.data(), nullptr, N, C, OC);  // off
  ops::start_profile();
  for (int i = 0; i < 3; ++i)
    ops::matmul_forward<float>(ex, out.data(), inp.data(), w.data(), nullptr, N, C, OC);
  const double sq = ops::sum_squares<float>(ex, out.data(), N * OC);
  const std::vector<ops::OpTime> profile = ops::stop_profile();
  ops::sum<float>(ex, out.data(), N * OC);  // off again
  EXPECT_GT(sq, 0);
  ASSERT_EQ(profile.size(), 2u);
  const ops::OpTime* mm = profile[0].name == "matmul_forward" ? &profile[0] : &profile[1];
  const ops::OpTime* ss = mm == &profile[0] ? &profile[1] : &profile[0];
  EXPECT_EQ(mm->name, "matmul_forward");
  EXPECT_EQ(mm->calls, 3);
  EXPECT_GT(mm->ms, 0);
  EXPECT_EQ(ss->name, "sum_squares");
  EXPECT_EQ(ss->calls, 1);
  // Each op's least work, summed over its calls: 2·N·C·OC flops per GEMM and its operands once.
  EXPECT_DOUBLE_EQ(mm->work.flops, 3 * 2.0 * N * C * OC);
  EXPECT_DOUBLE_EQ(mm->work.bytes, 3 * 4.0 * (N * C + OC * C + N * OC));
  EXPECT_DOUBLE_EQ(ss->work.flops, 0);
  EXPECT_DOUBLE_EQ(ss->work.bytes, 4.0 * N * OC);
  EXPECT_GE(profile[0].ms, profile[1].ms) << "most expensive first";
  ops::start_profile();
  EXPECT_TRUE(ops::stop_profile().empty()) << "start clears the table";
}

// GEMM inputs are rounded to 16 bits only on a GPU at bf16 / fp16 matmul precision: on the CPU a
// Linear keeps f32 (or f64) inputs, and the 16-bit ops refuse with their names.
TEST(Ops, SixteenBitGemmInputsAreAGpuMatterOnly) {
  ThreadPool pool(1);
  const Exec ex{&pool, Device::cpu()};
  EXPECT_EQ(ops::matmul_input_dtype(ex, DType::kF32), DType::kF32);
  EXPECT_EQ(ops::matmul_input_dtype(ex, DType::kF64), DType::kF64);
  std::vector<float> x(8, 1.0f), out(8, 0.0f);
  std::vector<uint16_t> bits(8, 0);
  const auto expect_refused = [](const std::function<void()>& op, const std::string& message) {
    try {
      op();
      ADD_FAILURE() << "accepted: " << message;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_refused(
      [&] { ops::gelu_forward_of_rounded(ex, bits.data(), bits.data(), DType::kBF16, 8); },
      "gelu_forward_of_rounded on cpu:0: output dtype bf16, but GEMM inputs are not rounded");
  expect_refused(
      [&] {
        ops::matmul_forward_from_rounded_input(ex, out.data(), bits.data(), DType::kBF16, x.data(),
                                               nullptr, 1, 8, 1);
      },
      "matmul_forward_from_rounded_input on cpu:0: bf16 is not a 16-bit GEMM operand on a GPU");
  EXPECT_EQ(out[0], 0.0f) << "written before refusing";
}

TEST(Ops, AGpuExecIsAClearErrorWithoutCuda) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is here: tests/cuda covers it";
  std::vector<float> x(8, 1.0f);
  try {
    ops::scale_inplace<float>(Exec{nullptr, Device::cuda(0)}, x.data(), 2.0f, 8);
    FAIL() << "an op ran on cuda:0 without a GPU";
  } catch (const Error& e) {
#ifndef LOOM_WITH_CUDA
    const std::string what = e.what();
    EXPECT_NE(what.find("scale_inplace on cuda:0: Loom was built without CUDA"), std::string::npos)
        << what;
#endif  // a CUDA build without a GPU reports the CUDA runtime's own error
  }
  EXPECT_EQ(x[0], 1.0f) << "the data was touched";
  EXPECT_THROW(ops::set_matmul_precision("fp4"), Error);
  EXPECT_NO_THROW(ops::set_matmul_precision("fp32"));
}

// fp8: inside a precision scope the Linears' block is the scope's, on CPU ranks and GPUs alike
// (whose GEMMs run at bf16 then); after it, 0 and fp32 GEMMs again.
TEST(Ops, Fp8PrecisionScopeSetsTheLinearsBlock) {
  if (!cpu::has_avx512f()) GTEST_SKIP() << "fp8 GEMMs on CPU ranks need AVX-512";
  ThreadPool pool(1);
  const Exec cpu_exec{&pool, Device::cpu()}, gpu_exec{&pool, Device::cuda(0)};
  {
    const ops::MatmulPrecisionScope fp8("fp8", 32);
    EXPECT_EQ(ops::fp8_block(cpu_exec), 32);
    EXPECT_EQ(ops::fp8_block(gpu_exec), 32);
    EXPECT_EQ(cpu::matmul_precision(), cpu::CpuMatmulPrecision::kFp8);
  }
  EXPECT_EQ(ops::fp8_block(cpu_exec), 0);
  EXPECT_EQ(ops::fp8_block(gpu_exec), 0);
  EXPECT_EQ(cpu::matmul_precision(), cpu::CpuMatmulPrecision::kFp32);
  float out = 0, x = 1, w = 1;
  EXPECT_THROW(ops::matmul_forward_fp8(cpu_exec, &out, &x, &w, nullptr, 1, 1, 1), Error);
}

}  // namespace
}  // namespace loom
