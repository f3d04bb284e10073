// Every CUDA kernel against its CPU kernel on random data, through kernels/ops.h as the modules
// call them: the same inputs go to the host and to the GPU, the outputs must agree to 1e-5 of the
// output's scale (max |value|, at least 1) — fp32 rounding, summed in another order — or bit for
// bit where both sides perform the same correctly rounded operations (add, scale, AdamW). Also:
// the GPU's own runs repeat bit for bit (no atomics on floats), and bad token ids are refused
// with the CPU kernels' messages. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../kernels/kernel_test_util.h"
#include "base/error.h"
#include "base/thread_pool.h"
#include "harness/devices.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/kernels.h"
#include "kernels/ops.h"
#include "kernels/targets.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace loom {
namespace {

using cpu::ktest::bitwise_equal;
using cpu::ktest::expect_close;

constexpr double kTol = 1e-5;

// Runs f, which must throw loom::Error with `needle` in its message; `accepted` says what went
// wrong if it does not throw.
template <typename F>
void expect_refused(F&& f, const std::string& needle, const std::string& accepted) {
  try {
    f();
    ADD_FAILURE() << accepted;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

std::vector<float> random_floats(int64_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  return cpu::ktest::convert<float>(cpu::ktest::random_vector(n, seed, lo, hi));
}

std::vector<int32_t> random_ids(int64_t n, int32_t V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = dist(gen);
  return ids;
}

// The cross-entropy backwards run with PaLM's auxiliary z-loss (train.z_loss) at this
// coefficient: their softmax term scaled by 1 + 2 · z · lse, checked against the CPU's.
constexpr float kZLoss = 0.01f;

// Targets: random ids with every 7th row kIgnoredTarget (data.eod_mask_loss: no loss, no gradient).
std::vector<int32_t> random_targets(int64_t n, int32_t V, uint64_t seed) {
  std::vector<int32_t> ids = random_ids(n, V, seed);
  for (int64_t i = 3; i < n; i += 7) ids[static_cast<size_t>(i)] = kIgnoredTarget;
  return ids;
}

// One tensor on the host and the same bits on GPU 0.
struct Pair {
  Tensor host, gpu;
  float* h() const { return host.data<float>(); }
  float* g() const { return gpu.data<float>(); }
  std::vector<float> from_host() const { return host.to_vector(); }
  std::vector<float> from_gpu() const { return gpu.to_vector(); }
};

Pair pair_of(const std::vector<float>& values) {
  Tensor host = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  return {host, host.to(Device::cuda(0))};
}

Pair random_pair(int64_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  return pair_of(random_floats(n, seed, lo, hi));
}

struct IdPair {
  Tensor host, gpu;
};

IdPair ids_pair(const std::vector<int32_t>& ids) {
  Tensor host = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::kI32);
  std::copy(ids.begin(), ids.end(), host.data<int32_t>());
  return {host, host.to(Device::cuda(0))};
}

// The values of a bf16 or f16 tensor (on any device), widened to floats on the host.
std::vector<float> widened(const Tensor& t) {
  const Tensor host = t.to(Device::cpu());
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype() == DType::kBF16 ? bf16_to_float(host.data_u16()[i])
                                       : f16_to_float(host.data_u16()[i]);
  return out;
}

void expect_pair_close(const std::string& what, const Pair& p, double tol = kTol) {
  expect_close(what, p.from_gpu(), p.from_host(), tol);
}

// The rows at positions `rows` of (B, T, width) values, columns [from, from + n) of each:
// (B, Σ sizes, n), a context-parallel rank's share of a whole sequence's tensor.
std::vector<float> rows_at(const std::vector<float>& v, int64_t B, int64_t T, int64_t width,
                           int64_t from, int64_t n, const std::vector<cpu::RowRange>& rows) {
  std::vector<float> picked;
  for (int64_t b = 0; b < B; ++b)
    for (const cpu::RowRange& r : rows)
      for (int64_t t = r.begin; t < r.end; ++t)
        picked.insert(picked.end(), v.begin() + (b * T + t) * width + from,
                      v.begin() + (b * T + t) * width + from + n);
  return picked;
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { LOOM_SKIP_UNLESS_CUDA_DEVICES(1); }

  // Attention forward and backward on random (B, T, 3·C) inputs (seed `seed`), on the GPU and the
  // CPU: out and lse within out_tol, dqkv within dqkv_tol of their scale, the GPU's backward fed
  // its own forward's results as in training; both GPU passes bit for bit the same when run
  // again. Returns the largest |GPU - CPU| difference of dqkv.
  double expect_attention_matches_cpu(int64_t B, int64_t T, int64_t C, int64_t NH, uint64_t seed,
                                      double out_tol, double dqkv_tol) {
    Pair qkv = random_pair(B * T * 3 * C, seed, -2.0, 2.0);
    Pair out = pair_of(std::vector<float>(B * T * C)),
         lse = pair_of(std::vector<float>(B * NH * T));
    ops::attention_forward<float>(on_cpu, out.h(), lse.h(), qkv.h(), B, T, C, NH);
    ops::attention_forward<float>(on_gpu, out.g(), lse.g(), qkv.g(), B, T, C, NH);
    expect_pair_close("out", out, out_tol);
    expect_pair_close("lse", lse, out_tol);

    Pair dout = random_pair(B * T * C, seed + 1), dqkv = pair_of(std::vector<float>(B * T * 3 * C));
    ops::attention_backward<float>(on_cpu, dqkv.h(), dout.h(), qkv.h(), out.h(), lse.h(), B, T, C,
                                   NH);
    ops::attention_backward<float>(on_gpu, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, C,
                                   NH);
    expect_pair_close("dqkv", dqkv, dqkv_tol);

    const std::vector<float> first_out = out.from_gpu(), first_dqkv = dqkv.from_gpu();
    ops::attention_forward<float>(on_gpu, out.g(), lse.g(), qkv.g(), B, T, C, NH);
    ops::attention_backward<float>(on_gpu, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, C,
                                   NH);
    EXPECT_TRUE(bitwise_equal(out.from_gpu(), first_out)) << "out not reproducible";
    EXPECT_TRUE(bitwise_equal(dqkv.from_gpu(), first_dqkv)) << "dqkv not reproducible";

    const std::vector<float> want = dqkv.from_host();
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, double(std::abs(first_dqkv[i] - want[i])));
    return worst;
  }

  // A GPU copy of `rows` × `width` floats of x (row stride width) rounded to bf16, as
  // context parallelism keeps q and kv for the flash kernels.
  Tensor bf16_copy(const Pair& x, int64_t rows, int64_t width) {
    Tensor out = Tensor::empty({rows, width}, DType::kBF16, Device::cuda(0));
    ops::copy_columns_to_bf16(on_gpu, out.raw(), width, x.g(), width, rows, width);
    return out;
  }

  ThreadPool pool{2};
  Exec on_cpu{&pool, Device::cpu()};
  Exec on_gpu{nullptr, Device::cuda(0)};
};

TEST_F(CudaKernelsTest, GemmEveryTranspositionAndBatchMatchesCpu) {
  const int64_t M = 37, N = 53, K = 29;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      Pair A = random_pair(M * K, 1), B = random_pair(K * N, 2), C = random_pair(M * N, 3);
      cpu::gemm<float>(pool, ta, tb, M, N, K, 0.5f, A.h(), lda, B.h(), ldb, 0.25f, C.h(), N);
      cuda::gemm(0, ta, tb, M, N, K, 0.5f, A.g(), lda, B.g(), ldb, 0.25f, C.g(), N);
      expect_pair_close("gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), C);
    }
  }
  // Three independent products, A and C packed, B shared (stride 0).
  const int64_t batch = 3;
  Pair A = random_pair(batch * M * K, 4), B = random_pair(K * N, 5),
       C = random_pair(batch * M * N, 6);
  for (int64_t b = 0; b < batch; ++b)
    cpu::gemm<float>(pool, false, false, M, N, K, 1.0f, A.h() + b * M * K, K, B.h(), N, 0.0f,
                     C.h() + b * M * N, N);
  cuda::gemm(0, false, false, M, N, K, 1.0f, A.g(), K, B.g(), N, 0.0f, C.g(), N, nullptr,
             cuda::GemmBatch{batch, M * K, 0, M * N});
  expect_pair_close("batched gemm", C);
}

// bf16 operands keep 8 significant bits (relative rounding 2^-9 each), TF32 and fp16 11: the
// products of K = 256 terms stay within 1e-2 and 2e-3 of the output's scale. The bias and the
// accumulation are fp32 either way.
TEST_F(CudaKernelsTest, MatmulInBf16Fp16AndTf32StaysWithinTheirRounding) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 64, C = 256, OC = 96;
  Pair inp = random_pair(N * C, 16), w = random_pair(OC * C, 17), b = random_pair(OC, 18);
  Pair out = pair_of(std::vector<float>(N * OC));
  ops::matmul_forward<float>(on_cpu, out.h(), inp.h(), w.h(), b.h(), N, C, OC);
  for (auto [precision, tol] : {std::pair{cuda::MatmulPrecision::kBf16, 1e-2},
                                std::pair{cuda::MatmulPrecision::kFp16, 2e-3},
                                std::pair{cuda::MatmulPrecision::kTf32, 2e-3}}) {
    cuda::set_matmul_precision(precision);
    out.gpu.zero_();
    ops::matmul_forward<float>(on_gpu, out.g(), inp.g(), w.g(), b.g(), N, C, OC);
    const std::vector<float> got = out.from_gpu(), want = out.from_host();
    expect_close("out", got, want, tol);
    // Not fp32 in disguise: some element must differ by more than fp32 rounding would.
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, double(std::abs(got[i] - want[i])));
    EXPECT_GT(worst, 1e-5) << "reduced precision was not applied";
  }
}

// fp16's range ends at 65504: an operand beyond it becomes inf in the product (what loss
// scaling detects), where bf16 (fp32's range) stays finite.
TEST_F(CudaKernelsTest, MatmulInFp16OverflowsPast65504AndBf16DoesNot) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 4, C = 8, OC = 4;
  std::vector<float> big(N * C, 1.0f);
  big[3] = 1e5f;  // row 0
  Pair inp = pair_of(big), w = pair_of(std::vector<float>(OC * C, 0.5f));
  Pair out = pair_of(std::vector<float>(N * OC));
  for (auto [precision, finite] : {std::pair{cuda::MatmulPrecision::kFp16, false},
                                   std::pair{cuda::MatmulPrecision::kBf16, true}}) {
    cuda::set_matmul_precision(precision);
    ops::matmul_forward<float>(on_gpu, out.g(), inp.g(), w.g(), nullptr, N, C, OC);
    const std::vector<float> got = out.from_gpu();
    EXPECT_EQ(std::isfinite(got[0]), finite) << "row 0 holds 1e5";
    EXPECT_TRUE(std::isfinite(got[OC])) << "row 1 is all ones";
    EXPECT_FLOAT_EQ(got[OC], 4.0f);
  }
}

// An operand several GEMMs read is rounded once (cuda::RoundedOperand, as matmul_backward does
// with dout): to exactly the bf16 / fp16 values the GEMM would round it to itself, so products
// come out bit for bit as from fp32 operands. At fp32 and TF32 no copy is made; an operand
// rounded for one precision is refused at another.
TEST_F(CudaKernelsTest, OperandsRoundedOnceAreWhatTheGemmWouldRoundTo) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t M = 33, K = 40, N = 24;
  Pair a = random_pair(M * K, 21, -300.0, 300.0), b = random_pair(K * N, 22);
  std::vector<float> identity(K * K, 0.0f);
  for (int64_t i = 0; i < K; ++i) identity[i * K + i] = 1.0f;
  Pair eye = pair_of(identity);
  Pair c = pair_of(std::vector<float>(M * K)), per_gemm = pair_of(std::vector<float>(M * N)),
       once = pair_of(std::vector<float>(M * N));
  using cuda::MatmulPrecision;
  for (auto [precision, other] : {std::pair{MatmulPrecision::kBf16, MatmulPrecision::kFp16},
                                  std::pair{MatmulPrecision::kFp16, MatmulPrecision::kBf16}}) {
    const bool bf16 = precision == MatmulPrecision::kBf16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp16");
    cuda::set_matmul_precision(precision);
    const cuda::RoundedOperand a16(0, a.g(), M * K), b16(0, b.g(), K * N);
    EXPECT_NE(a16.operand().data, static_cast<const void*>(a.g()));
    EXPECT_EQ(a16.operand().rounded_to, precision);
    // The rounded values, read back through an exact product with the identity.
    cuda::gemm(0, false, false, M, K, K, 1.0f, a16.operand(), K, eye.g(), K, 0.0f, c.g(), K);
    std::vector<float> want = a.from_host();
    for (float& x : want)
      x = bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    EXPECT_TRUE(bitwise_equal(c.from_gpu(), want)) << "not rounded to nearest even";
    // Rounded once or inside the GEMM: the same product.
    cuda::gemm(0, false, false, M, N, K, 1.0f, a.g(), K, b.g(), N, 0.0f, per_gemm.g(), N);
    cuda::gemm(0, false, false, M, N, K, 1.0f, a16.operand(), K, b16.operand(), N, 0.0f, once.g(),
               N);
    EXPECT_TRUE(bitwise_equal(once.from_gpu(), per_gemm.from_gpu()));
    cuda::set_matmul_precision(other);
    expect_refused(
        [&] {
          cuda::gemm(0, false, false, M, N, K, 1.0f, a.g(), K, b16.operand(), N, 0.0f, once.g(), N);
        },
        "operand B was rounded for", "an operand rounded for another precision was accepted");
  }
  for (MatmulPrecision precision : {MatmulPrecision::kFp32, MatmulPrecision::kTf32}) {
    cuda::set_matmul_precision(precision);
    const cuda::RoundedOperand same(0, a.g(), M * K);
    EXPECT_EQ(same.operand().data, static_cast<const void*>(a.g())) << "copied at fp32 / TF32";
    EXPECT_EQ(same.operand().rounded_to, MatmulPrecision::kFp32);
  }
}

TEST_F(CudaKernelsTest, MatmulForwardAndBackwardMatchCpu) {
  const int64_t N = 70, C = 48, OC = 80;
  Pair inp = random_pair(N * C, 10), w = random_pair(OC * C, 11), b = random_pair(OC, 12);
  Pair out = pair_of(std::vector<float>(N * OC));
  ops::matmul_forward<float>(on_cpu, out.h(), inp.h(), w.h(), b.h(), N, C, OC);
  ops::matmul_forward<float>(on_gpu, out.g(), inp.g(), w.g(), b.g(), N, C, OC);
  expect_pair_close("out", out);

  Pair dout = random_pair(N * OC, 13), dinp = pair_of(std::vector<float>(N * C));
  Pair dw = random_pair(OC * C, 14), db = random_pair(OC, 15);  // accumulated into
  ops::matmul_backward<float>(on_cpu, dinp.h(), dw.h(), db.h(), dout.h(), inp.h(), w.h(), N, C, OC);
  ops::matmul_backward<float>(on_gpu, dinp.g(), dw.g(), db.g(), dout.g(), inp.g(), w.g(), N, C, OC);
  expect_pair_close("dinp", dinp);
  expect_pair_close("dweight", dw);
  expect_pair_close("dbias", db);
  // No input gradient, no bias (the first layer; the tied LM head).
  ops::matmul_backward<float>(on_cpu, nullptr, dw.h(), nullptr, dout.h(), inp.h(), w.h(), N, C, OC);
  ops::matmul_backward<float>(on_gpu, nullptr, dw.g(), nullptr, dout.g(), inp.g(), w.g(), N, C, OC);
  expect_pair_close("dweight, twice accumulated", dw);
}

// fp8 quantization on the GPU (cuda::quantize_fp8_blocks) is the CPU's bit for bit: 1 × b, b × b
// and b × 1 blocks, edge blocks smaller, over values across 60 binades (E4M3's subnormals in a
// block whose largest value is far larger), a block of zeros, one with an infinity and one with
// a NaN (both copied as they are), and largest values at the scale's boundaries (448 · 2^k and
// 1.75 · 2^k exactly, and an ulp either side).
TEST_F(CudaKernelsTest, Fp8QuantizationIsTheCpusBitForBit) {
  const int64_t rows = 37, cols = 300;
  std::vector<float> x = random_floats(rows * cols, 220);
  std::mt19937_64 gen(221);
  std::uniform_int_distribution<int> binade(-30, 30);
  for (float& v : x) v = std::ldexp(v, binade(gen));
  for (int64_t c = 0; c < 32; ++c) x[c] = 0.0f;                 // zeros (row 0, first block)
  x[5 * cols + 40] = std::numeric_limits<float>::infinity();     // row 5
  x[9 * cols + 250] = std::numeric_limits<float>::quiet_NaN();   // row 9
  x[12 * cols + 70] = 448.0f * 0x1p-3f;                          // exactly at a boundary
  x[13 * cols + 70] = std::nextafter(1.75f * 0x1p5f, 0.0f);      // an ulp below 1.75 · 2^5
  x[14 * cols + 70] = std::nextafter(1.75f * 0x1p5f, 1e9f);      // an ulp above
  x[15 * cols + 70] = 3e38f;                                     // near the largest float
  Pair in = pair_of(x);
  for (const auto& [br, bc] : {std::pair<int64_t, int64_t>{1, 32}, {32, 32}, {32, 1}, {1, 128},
                               {128, 128}, {128, 1}}) {
    SCOPED_TRACE(std::to_string(br) + " x " + std::to_string(bc) + " blocks");
    Pair out = pair_of(std::vector<float>(rows * cols, -1.0f));
    cpu::quantize_fp8_blocks(pool, out.h(), cols, in.h(), cols, rows, cols, br, bc);
    cuda::quantize_fp8_blocks(0, out.g(), cols, in.g(), cols, rows, cols, br, bc);
    const std::vector<float> want = out.from_host(), got = out.from_gpu();
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
    size_t changed = 0;
    for (size_t i = 0; i < x.size(); ++i) changed += std::memcmp(&want[i], &x[i], 4) != 0;
    EXPECT_GT(changed, x.size() / 8) << "nothing was quantized";  // (some blocks are copied)
  }
}

// E4M3's value of a byte (sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7F / 0xFF NaN).
double e4m3_value(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 7;
  double magnitude =
      exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  if (exponent == 0xF && mantissa == 7) magnitude = std::numeric_limits<double>::quiet_NaN();
  return (bits & 0x80) != 0 ? -magnitude : magnitude;
}

// The fp8 tensor cores' operands and GEMM (cuda::quantize_e4m3, cuda::gemm_fp8): each E4M3 byte
// times its block's scale is bit for bit quantize_fp8_blocks' value (1 × 128 and 128 × 128
// blocks, edge blocks smaller, values across 16 binades, a block of zeros); a block holding an
// infinity is stored as NaNs, so its rows' products are NaN; and the GEMM of A (1 × 128 scales)
// with B (either scaling) is the product of those values — exact products summed in fp32, so
// within 1e-5 of Σ|a·b| of the double product. K = 768: six column blocks, the 128 × 128 scales'
// row padded to eight. On the emulator this checks Loom's side (quantization, scale layout, the
// emulator's reference GEMM) and that each alternative scale layout (set_fp8_scale_layout) is one;
// on a GPU cuBLASLt's reading of the scales too, and where the default layout is not what it
// reads, the failure lists which alternative is.
TEST_F(CudaKernelsTest, Fp8TensorCoreGemmIsTheQuantizedOperandsProduct) {
  const int64_t M = 72, N = 160, K = 768;
  std::mt19937_64 gen(230);
  std::uniform_int_distribution<int> binade(-8, 8);
  const auto values = [&](int64_t n, uint64_t seed) {
    std::vector<float> x = random_floats(n, seed);
    for (float& v : x) v = std::ldexp(v, binade(gen));
    return x;
  };
  std::vector<float> a = values(M * K, 231), b = values(N * K, 232);
  for (int64_t k = 128; k < 256; ++k) a[3 * K + k] = 0.0f;  // row 3's second block: zeros
  a[7 * K + 500] = std::numeric_limits<float>::infinity();  // row 7's fourth block
  const Pair pa = pair_of(a), pb = pair_of(b);
  // The E4M3 bytes of an operand (in a float tensor's storage) and its scales.
  struct Quantized {
    Tensor bytes, scales;
    cuda::Fp8Operand operand() const {
      return {static_cast<const uint8_t*>(bytes.raw()), scales.data<float>(), scaling};
    }
    cuda::Fp8Scaling scaling;
  };
  const auto quantize = [&](const Pair& x, int64_t rows, cuda::Fp8Scaling scaling) {
    Quantized q{
        Tensor::empty({(rows * K + 3) / 4}, DType::kF32, Device::cuda(0)),
        Tensor::empty({cuda::fp8_scale_count(rows, K, scaling)}, DType::kF32, Device::cuda(0)),
        scaling};
    cuda::quantize_e4m3(0, static_cast<uint8_t*>(q.bytes.raw()), q.scales.data<float>(), x.g(),
                        rows, K, scaling);
    // Bit for bit quantize_fp8_blocks' values, but for the block with the infinity.
    const int64_t block_rows = scaling == cuda::Fp8Scaling::kVec128 ? 1 : 128;
    Pair want = pair_of(std::vector<float>(rows * K));
    cuda::quantize_fp8_blocks(0, want.g(), K, x.g(), K, rows, K, block_rows, 128);
    const std::vector<float> w = want.from_gpu(), scales = q.scales.to_vector();
    const Tensor host_bytes = q.bytes.to(Device::cpu());
    const auto* bits = static_cast<const uint8_t*>(host_bytes.raw());
    std::vector<double> dequantized(static_cast<size_t>(rows * K));
    int64_t mismatches = 0, nans = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < K; ++c) {
        const int64_t e = r * K + c;
        const double v = e4m3_value(bits[e]) *
                         scales[static_cast<size_t>(cuda::fp8_scale_index(rows, K, scaling, r, c))];
        dequantized[static_cast<size_t>(e)] = v;
        if (std::isnan(v)) {
          ++nans;
          continue;
        }
        mismatches += static_cast<float>(v) != w[static_cast<size_t>(e)];
      }
    EXPECT_EQ(mismatches, 0) << "bytes × scales are not quantize_fp8_blocks' values";
    return std::make_pair(q, dequantized);
  };
  // The GEMM's outputs off by more than the sums' rounding, for B scaled `scaling`.
  const auto wrong_outputs = [&](cuda::Fp8Scaling scaling) {
    const auto [qa, da] = quantize(pa, M, cuda::Fp8Scaling::kVec128);
    const auto [qb, db] = quantize(pb, N, scaling);
    Pair c = pair_of(std::vector<float>(M * N));
    cuda::gemm_fp8(0, M, N, K, qa.operand(), qb.operand(), c.g());
    const std::vector<float> got = c.from_gpu();
    int64_t bad = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        const float g = got[static_cast<size_t>(i * N + j)];
        if (i == 7) {  // the row with the infinity
          bad += !std::isnan(g);
          continue;
        }
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = da[static_cast<size_t>(i * K + k)] * db[static_cast<size_t>(j * K + k)];
          sum += p;
          magnitude += std::abs(p);
        }
        bad += !(std::abs(g - sum) <= 1e-5 * magnitude + 1e-30);
      }
    return bad;
  };
  const int64_t vec = wrong_outputs(cuda::Fp8Scaling::kVec128),
                block = wrong_outputs(cuda::Fp8Scaling::kBlock128);
  EXPECT_EQ(vec, 0) << "B in 1 x 128 blocks: " << vec << " of " << M * N << " outputs wrong";
  EXPECT_EQ(block, 0) << "B in 128 x 128 blocks: " << block << " of " << M * N << " outputs wrong";
#ifdef LOOM_CUDA_EMULATE
  // Every alternative layout is a layout: no two blocks share a scale (the emulator's GEMM reads
  // the scales as they are written, so a collision is what it can see).
  struct Restore {
    ~Restore() { cuda::set_fp8_scale_layout(0); }
  } restore;
  for (int v = 1; v < cuda::kFp8ScaleLayouts; ++v) {
    cuda::set_fp8_scale_layout(v);
    EXPECT_EQ(wrong_outputs(cuda::Fp8Scaling::kVec128) + wrong_outputs(cuda::Fp8Scaling::kBlock128),
              0)
        << "layout variant " << v;
  }
  EXPECT_THROW(cuda::set_fp8_scale_layout(cuda::kFp8ScaleLayouts), Error);
#else
  // On a GPU whose cuBLASLt reads the scales otherwise: which of the other layouts it reads, for
  // the next session to make the default (the emulator reads whichever Loom writes).
  if (vec != 0 || block != 0) {
    struct Restore {
      ~Restore() { cuda::set_fp8_scale_layout(0); }
    } restore;
    for (int v = 1; v < cuda::kFp8ScaleLayouts; ++v) {
      cuda::set_fp8_scale_layout(v);
      const int64_t v_vec = wrong_outputs(cuda::Fp8Scaling::kVec128),
                    v_block = wrong_outputs(cuda::Fp8Scaling::kBlock128);
      ADD_FAILURE() << "fp8 scale layout variant " << v << " (set_fp8_scale_layout): " << v_vec
                    << " wrong with B in 1 x 128 blocks, " << v_block << " in 128 x 128"
                    << (v_vec == 0 || v_block == 0 ? "  <-- matches" : "");
    }
  }
#endif
}

// A Linear at fp8 on the GPU (ops::matmul_forward_fp8 / matmul_backward_fp8, and the plain
// linear ops routing to them) computes the CPU's: the same quantized operands, the products
// exact on the bf16 GEMM, only the order of the fp32 sums differs. At fp8 the GPU keeps no
// 16-bit activations (the Linears quantize fp32 inputs themselves).
TEST_F(CudaKernelsTest, Fp8MatmulMatchesTheCpus) {
  if (!cpu::has_avx512f()) GTEST_SKIP() << "fp8 needs AVX-512 on the CPU side";
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  const int64_t N = 70, C = 96, OC = 80;
  ops::MatmulPrecisionScope fp8("fp8", 32);
  ASSERT_EQ(ops::fp8_block(on_gpu), 32);
  EXPECT_EQ(ops::matmul_input_dtype(on_gpu, DType::kF32), DType::kF32);
  EXPECT_FALSE(ops::attention_takes_rounded_qkv(on_gpu, 128, 2, 2));
  Pair inp = random_pair(N * C, 230, -3.0, 3.0), w = random_pair(OC * C, 231),
       b = random_pair(OC, 232);
  Pair out = pair_of(std::vector<float>(N * OC)), out2 = pair_of(std::vector<float>(N * OC));
  ops::matmul_forward_fp8(on_cpu, out.h(), inp.h(), w.h(), b.h(), N, C, OC);
  ops::matmul_forward_fp8(on_gpu, out.g(), inp.g(), w.g(), b.g(), N, C, OC);
  expect_pair_close("out", out);
  ops::linear_forward<float>(on_gpu, out2.g(), inp.g(), w.g(), b.g(), nullptr, N, C, OC);
  EXPECT_TRUE(bitwise_equal(out2.from_gpu(), out.from_gpu())) << "linear_forward is not fp8's";
  // Not the bf16 GEMM on the unquantized operands.
  Pair plain = pair_of(std::vector<float>(N * OC));
  ops::matmul_forward<float>(on_gpu, plain.g(), inp.g(), w.g(), b.g(), N, C, OC);
  double worst = 0;
  const std::vector<float> a = plain.from_gpu(), q = out.from_gpu();
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::abs(a[i] - q[i])));
  EXPECT_GT(worst, 1e-2) << "the operands were not quantized";

  Pair dout = random_pair(N * OC, 233), dinp = pair_of(std::vector<float>(N * C));
  Pair dw = random_pair(OC * C, 234), db = random_pair(OC, 235);  // accumulated into
  ops::matmul_backward_fp8(on_cpu, dinp.h(), dw.h(), db.h(), dout.h(), inp.h(), w.h(), N, C, OC);
  ops::matmul_backward_fp8(on_gpu, dinp.g(), dw.g(), db.g(), dout.g(), inp.g(), w.g(), N, C, OC);
  expect_pair_close("dinp", dinp);
  expect_pair_close("dweight", dw);
  expect_pair_close("dbias", db);
  ops::matmul_backward_fp8(on_cpu, nullptr, dw.h(), nullptr, dout.h(), inp.h(), w.h(), N, C, OC);
  ops::matmul_backward_fp8(on_gpu, nullptr, dw.g(), nullptr, dout.g(), inp.g(), w.g(), N, C, OC);
  expect_pair_close("dweight, twice accumulated", dw);
}

// A Linear at fp8 on the E4M3 tensor cores (cuda::set_fp8_tensor_cores: gemm_fp8 on
// quantize_e4m3's operands — the weight in 128 × 128 blocks and, for the input gradient, its
// transpose; the weight gradient's operands transposed into 1 × 128 blocks along the tokens) is
// the bf16 GEMMs' on the quantized values up to the order of the fp32 sums: output, input,
// weight (accumulated) and bias gradients within 1e-5 of the largest value. Shapes that are not
// multiples of 16, and other block sizes, stay on the bf16 path (bit for bit).
TEST_F(CudaKernelsTest, Fp8LinearOnTheTensorCoresIsTheBf16PathsToRounding) {
  const int64_t N = 256, C = 384, OC = 128;
  ops::MatmulPrecisionScope fp8("fp8", 128);
  struct Restore {
    ~Restore() { cuda::set_fp8_tensor_cores(false); }
  } restore;
  const Pair inp = random_pair(N * C, 240), w = random_pair(OC * C, 241), b = random_pair(OC, 242),
             dout = random_pair(N * OC, 243);
  struct Result {
    std::vector<float> out, dinp, dw, db;
  };
  const auto run = [&](bool tensor_cores) {
    cuda::set_fp8_tensor_cores(tensor_cores);
    EXPECT_EQ(cuda::fp8_tensor_cores(), tensor_cores);
    Pair out = pair_of(std::vector<float>(N * OC)), dinp = pair_of(std::vector<float>(N * C));
    Pair dw = random_pair(OC * C, 244), db = random_pair(OC, 245);  // accumulated into
    ops::matmul_forward_fp8(on_gpu, out.g(), inp.g(), w.g(), b.g(), N, C, OC);
    ops::matmul_backward_fp8(on_gpu, dinp.g(), dw.g(), db.g(), dout.g(), inp.g(), w.g(), N, C, OC);
    return Result{out.from_gpu(), dinp.from_gpu(), dw.from_gpu(), db.from_gpu()};
  };
  const Result bf16 = run(false), cores = run(true);
  const auto expect_near = [](const char* what, const std::vector<float>& want,
                              const std::vector<float>& got) {
    ASSERT_EQ(got.size(), want.size()) << what;
    float largest = 0, worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      largest = std::max(largest, std::abs(want[i]));
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
    EXPECT_GT(largest, 0.0f) << what;
    EXPECT_LE(worst, 1e-5f * largest) << what << ": off by " << worst << " of " << largest;
  };
  expect_near("out", bf16.out, cores.out);
  expect_near("dinp", bf16.dinp, cores.dinp);
  expect_near("dweight", bf16.dw, cores.dw);
  expect_near("dbias", bf16.db, cores.db);
  // N = 250 is not a multiple of 16: the bf16 path, the same bits either way.
  cuda::set_fp8_tensor_cores(true);
  Pair out_on = pair_of(std::vector<float>(250 * OC)),
       out_off = pair_of(std::vector<float>(250 * OC));
  ops::matmul_forward_fp8(on_gpu, out_on.g(), inp.g(), w.g(), b.g(), 250, C, OC);
  cuda::set_fp8_tensor_cores(false);
  ops::matmul_forward_fp8(on_gpu, out_off.g(), inp.g(), w.g(), b.g(), 250, C, OC);
  EXPECT_TRUE(bitwise_equal(out_on.from_gpu(), out_off.from_gpu()));
}

// A skip connection added in the GEMM's epilogue (cuda::gemm_adding): out = inp·Wᵀ + b + r,
// rounded once, so within an ulp of the GEMM then add_inplace, at every precision; the addend
// may be the output itself.
TEST_F(CudaKernelsTest, MatmulForwardAddsTheResidualInItsEpilogue) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  using cuda::MatmulPrecision;
  const int64_t N = 70, C = 48, OC = 80;
  Pair inp = random_pair(N * C, 60), w = random_pair(OC * C, 61), b = random_pair(OC, 62);
  const std::vector<float> residual0 = random_floats(N * OC, 63, -20.0, 20.0);
  Pair residual = pair_of(residual0), out = pair_of(std::vector<float>(N * OC));
  ops::matmul_forward_adding<float>(on_cpu, out.h(), inp.h(), w.h(), b.h(), residual.h(), N, C, OC);
  for (auto [precision, tol] :
       {std::pair{MatmulPrecision::kFp32, kTol}, std::pair{MatmulPrecision::kTf32, 2e-3},
        std::pair{MatmulPrecision::kBf16, 1e-2}, std::pair{MatmulPrecision::kFp16, 2e-3}}) {
    cuda::set_matmul_precision(precision);
    SCOPED_TRACE(static_cast<int>(precision));
    ops::matmul_forward_adding<float>(on_gpu, out.g(), inp.g(), w.g(), b.g(), residual.g(), N, C,
                                      OC);
    expect_close("out", out.from_gpu(), out.from_host(), tol);
    EXPECT_TRUE(bitwise_equal(residual.from_gpu(), residual0)) << "residual changed";
    Pair split = pair_of(std::vector<float>(N * OC));
    ops::matmul_forward<float>(on_gpu, split.g(), inp.g(), w.g(), b.g(), N, C, OC);
    ops::add_inplace<float>(on_gpu, split.g(), residual.g(), N * OC);
    expect_close("out vs the GEMM then an add", out.from_gpu(), split.from_gpu(), 1e-6);
    // In place: the residual is the output buffer.
    Pair in_place = pair_of(residual0);
    cuda::gemm_adding(0, false, true, N, OC, C, inp.g(), C, w.g(), C, in_place.g(), in_place.g(),
                      OC, b.g());
    EXPECT_TRUE(bitwise_equal(in_place.from_gpu(), out.from_gpu())) << "in place";
  }
}

// A Linear's backward with a bias reads dout once: the bias gradient's pass also writes its
// rounding for the GEMMs at bf16 / fp16; the MLP's fc folds the GELU's backward into that pass.
// Both are bit for bit the separate ops, at every precision; and near the CPU.
TEST_F(CudaKernelsTest, LinearBackwardMakesItsBiasGradientAndGemmOperandInOnePass) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  using cuda::MatmulPrecision;
  const int64_t N = 300, C = 40, OC = 72;  // N over one 256-row chunk of the bias sums
  const std::vector<float> dout0 = random_floats(N * OC, 30, -3.0, 3.0);
  const std::vector<float> dw0 = random_floats(OC * C, 31), db0 = random_floats(OC, 32);
  Pair inp = random_pair(N * C, 33), w = random_pair(OC * C, 34),
       h = random_pair(N * OC, 35, -4, 4);

  // The CPU's results: gelu_backward then matmul_backward.
  Pair dgelu = pair_of(dout0), dinp = pair_of(std::vector<float>(N * C)), dw = pair_of(dw0),
       db = pair_of(db0);
  ops::matmul_backward_before_gelu<float>(on_cpu, dinp.h(), dw.h(), db.h(), dgelu.h(), h.h(),
                                          inp.h(), w.h(), N, C, OC);

  // The bias gradient at fp32, its own pass over dout: no precision changes its bits.
  Pair db_fp32 = pair_of(db0);
  ops::matmul_backward<float>(on_gpu, nullptr, pair_of(dw0).g(), db_fp32.g(), pair_of(dout0).g(),
                              inp.g(), w.g(), N, C, OC);
  for (auto [precision, tol] :
       {std::pair{MatmulPrecision::kFp32, kTol}, std::pair{MatmulPrecision::kTf32, 2e-3},
        std::pair{MatmulPrecision::kBf16, 1e-2}, std::pair{MatmulPrecision::kFp16, 2e-3}}) {
    cuda::set_matmul_precision(precision);
    SCOPED_TRACE(static_cast<int>(precision));
    // matmul_backward with a bias against its GEMMs on dout rounded apart.
    Pair dx = pair_of(std::vector<float>(N * C)), dwx = pair_of(dw0), dbx = pair_of(db0);
    Pair dout = pair_of(dout0), dx_ref = pair_of(std::vector<float>(N * C)), dw_ref = pair_of(dw0);
    ops::matmul_backward<float>(on_gpu, dx.g(), dwx.g(), dbx.g(), dout.g(), inp.g(), w.g(), N, C,
                                OC);
    {
      const cuda::RoundedOperand rounded(0, dout.g(), N * OC);
      cuda::matmul_backward_gemms(0, dx_ref.g(), dw_ref.g(), rounded.operand(), inp.g(), w.g(), N,
                                  C, OC);
    }
    EXPECT_TRUE(bitwise_equal(dx.from_gpu(), dx_ref.from_gpu())) << "dinp";
    EXPECT_TRUE(bitwise_equal(dwx.from_gpu(), dw_ref.from_gpu())) << "dweight";
    EXPECT_TRUE(bitwise_equal(dbx.from_gpu(), db_fp32.from_gpu())) << "dbias";
    EXPECT_TRUE(bitwise_equal(dout.from_gpu(), dout0)) << "dout changed";

    // Through the GELU: against gelu_backward then matmul_backward on the GPU, with and without
    // an input gradient and a bias.
    for (const bool full : {true, false}) {
      SCOPED_TRACE(full ? "dinp and dbias" : "dweight only");
      Pair g1 = pair_of(dout0), dx1 = pair_of(std::vector<float>(N * C)), dw1 = pair_of(dw0),
           db1 = pair_of(db0);
      ops::matmul_backward_before_gelu<float>(on_gpu, full ? dx1.g() : nullptr, dw1.g(),
                                              full ? db1.g() : nullptr, g1.g(), h.g(), inp.g(),
                                              w.g(), N, C, OC);
      Pair g2 = pair_of(dout0), dx2 = pair_of(std::vector<float>(N * C)), dw2 = pair_of(dw0),
           db2 = pair_of(db0);
      ops::gelu_backward<float>(on_gpu, g2.g(), h.g(), g2.g(), N * OC);
      ops::matmul_backward<float>(on_gpu, full ? dx2.g() : nullptr, dw2.g(),
                                  full ? db2.g() : nullptr, g2.g(), inp.g(), w.g(), N, C, OC);
      EXPECT_TRUE(bitwise_equal(dx1.from_gpu(), dx2.from_gpu())) << "dinp";
      EXPECT_TRUE(bitwise_equal(dw1.from_gpu(), dw2.from_gpu())) << "dweight";
      EXPECT_TRUE(bitwise_equal(db1.from_gpu(), db2.from_gpu())) << "dbias";
      if (!cuda::rounds_to_16_bits(precision)) {  // the GELU's input gradient, left in place
        EXPECT_TRUE(bitwise_equal(g1.from_gpu(), g2.from_gpu())) << "dgelu";
      }
      if (!full) continue;
      expect_close("dinp", dx1.from_gpu(), dinp.from_host(), tol);
      expect_close("dweight", dw1.from_gpu(), dw.from_host(), tol);
      expect_close("dbias", db1.from_gpu(), db.from_host(), kTol);
    }
  }
}

TEST_F(CudaKernelsTest, ElementwiseAndSumsMatchCpu) {
  const int64_t n = 100003;
  Pair a = random_pair(n, 20), b = random_pair(n, 21), out = pair_of(std::vector<float>(n));
  ops::add_forward<float>(on_cpu, out.h(), a.h(), b.h(), n);
  ops::add_forward<float>(on_gpu, out.g(), a.g(), b.g(), n);
  EXPECT_TRUE(bitwise_equal(out.from_gpu(), out.from_host())) << "add_forward";
  ops::add_inplace<float>(on_cpu, a.h(), b.h(), n);
  ops::add_inplace<float>(on_gpu, a.g(), b.g(), n);
  EXPECT_TRUE(bitwise_equal(a.from_gpu(), a.from_host())) << "add_inplace";
  ops::scale_inplace<float>(on_cpu, a.h(), 0.37f, n);
  ops::scale_inplace<float>(on_gpu, a.g(), 0.37f, n);
  EXPECT_TRUE(bitwise_equal(a.from_gpu(), a.from_host())) << "scale_inplace";

  // Both sum in double, in different orders: agreement to double rounding.
  const double s_cpu = ops::sum<float>(on_cpu, a.h(), n), s_gpu = ops::sum<float>(on_gpu, a.g(), n);
  EXPECT_NEAR(s_gpu, s_cpu, 1e-9 * std::max(1.0, std::abs(s_cpu)));
  const double q_cpu = ops::sum_squares<float>(on_cpu, a.h(), n);
  const double q_gpu = ops::sum_squares<float>(on_gpu, a.g(), n);
  EXPECT_NEAR(q_gpu, q_cpu, 1e-12 * q_cpu);
  EXPECT_EQ(ops::sum_squares<float>(on_gpu, a.g(), n), q_gpu) << "not reproducible";
  EXPECT_EQ(ops::sum<float>(on_gpu, a.g(), 0), 0.0);
}

// Gradients communicated in bf16 (parallel.grad_reduce_dtype): the GPU's rounding to bf16, its
// widening and its widened add are the CPU's bit for bit (to nearest even; ties included).
TEST_F(CudaKernelsTest, Bf16GradientConversionsAreTheCpus) {
  const int64_t n = 5000;
  std::vector<float> x = random_floats(n, 240, -50.0, 50.0);
  x[0] = bf16_to_float(0x3f80) + std::ldexp(1.0f, -8);  // a tie: 1 + half a bf16 ulp
  x[1] = bf16_to_float(0x3f81) + std::ldexp(1.0f, -8);  // a tie rounding up to even
  Pair in = pair_of(x), acc = random_pair(n, 241);
  Tensor h = Tensor::empty({n}, DType::kBF16), g = Tensor::empty({n}, DType::kBF16, Device::cuda(0));
  ops::round_to_bf16(on_cpu, h.data_u16(), in.h(), n);
  ops::round_to_bf16(on_gpu, g.data_u16(), in.g(), n);
  EXPECT_EQ(std::memcmp(h.data_u16(), g.to(Device::cpu()).data_u16(), n * 2), 0) << "rounding";
  Pair wide = pair_of(std::vector<float>(n));
  ops::widen_bf16(on_cpu, wide.h(), h.data_u16(), n);
  ops::widen_bf16(on_gpu, wide.g(), g.data_u16(), n);
  EXPECT_TRUE(bitwise_equal(wide.from_host(), wide.from_gpu())) << "widening";
  ops::add_widened_bf16(on_cpu, acc.h(), h.data_u16(), n);
  ops::add_widened_bf16(on_gpu, acc.g(), g.data_u16(), n);
  EXPECT_TRUE(bitwise_equal(acc.from_host(), acc.from_gpu())) << "widened add";
  EXPECT_FALSE(bitwise_equal(wide.from_host(), x)) << "nothing was rounded";
}

TEST_F(CudaKernelsTest, GeluMatchesCpu) {
  const int64_t n = 4099;
  Pair x = random_pair(n, 30, -6.0, 6.0), y = pair_of(std::vector<float>(n));
  ops::gelu_forward<float>(on_cpu, y.h(), x.h(), n);
  ops::gelu_forward<float>(on_gpu, y.g(), x.g(), n);
  expect_pair_close("gelu_forward", y);
  Pair dy = random_pair(n, 31), dx = pair_of(std::vector<float>(n));
  ops::gelu_backward<float>(on_cpu, dx.h(), x.h(), dy.h(), n);
  ops::gelu_backward<float>(on_gpu, dx.g(), x.g(), dy.g(), n);
  expect_pair_close("gelu_backward", dx);
}

// A LayerNorm feeding a Linear on a GPU at bf16 / fp16 writes its rounded input directly
// (ops::layernorm_forward_rounded): bit for bit its fp32 output rounded to nearest even, with the
// same mean and rstd; refused where GEMM inputs stay fp32.
TEST_F(CudaKernelsTest, LayerNormWritesTheNextGemmsRoundedInput) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 19, C = 72;
  Pair inp = random_pair(N * C, 30, -3.0, 3.0), w = random_pair(C, 31), b = random_pair(C, 32);
  Pair ln = pair_of(std::vector<float>(N * C));
  Pair mean = pair_of(std::vector<float>(N)), rstd = pair_of(std::vector<float>(N));
  ops::layernorm_forward<float>(on_gpu, ln.g(), mean.g(), rstd.g(), inp.g(), w.g(), b.g(), N, C);
  const std::vector<float> mean32 = mean.from_gpu(), rstd32 = rstd.from_gpu();
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    SCOPED_TRACE(dtype_name(dtype));
    cuda::set_matmul_precision(precision);
    ASSERT_EQ(ops::matmul_input_dtype(on_gpu, DType::kF32), dtype);
    EXPECT_EQ(ops::matmul_input_dtype(on_cpu, DType::kF32), DType::kF32);
    const bool bf16 = dtype == DType::kBF16;  // clang 14 lambdas cannot capture `dtype` itself
    const auto rounded = [bf16](std::vector<float> v) {
      for (float& x : v) x = bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
      return v;
    };
    Tensor out16 = Tensor::empty({N * C}, dtype, Device::cuda(0));
    mean.gpu.zero_();
    rstd.gpu.zero_();
    ops::layernorm_forward_rounded(on_gpu, out16.raw(), dtype, mean.g(), rstd.g(), inp.g(), w.g(),
                                   b.g(), N, C);
    EXPECT_TRUE(
        bitwise_equal(out16.to(Device::cpu()).to(DType::kF32).to_vector(), rounded(ln.from_gpu())))
        << "layernorm";
    EXPECT_TRUE(bitwise_equal(mean.from_gpu(), mean32));
    EXPECT_TRUE(bitwise_equal(rstd.from_gpu(), rstd32));
  }
  cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
  Tensor out16 = Tensor::empty({N * C}, DType::kBF16, Device::cuda(0));
  expect_refused(
      [&] {
        ops::layernorm_forward_rounded(on_gpu, out16.raw(), DType::kBF16, mean.g(), rstd.g(),
                                       inp.g(), w.g(), b.g(), N, C);
      },
      "GEMM inputs are not rounded to 16 bits",
      "a 16-bit LayerNorm output was written with fp32 GEMMs");
}

// The backward's weight and bias gradients come from the dinp kernel's own read of dout and the
// input (each warp's column sums, added in a fixed order after) where a row has at most 2048
// columns, from a pass of their own beyond: C = 100, 768 and 2100 take the fused kernel's two
// sizes and the separate sums.
TEST_F(CudaKernelsTest, LayerNormMatchesCpu) {
  const int64_t N = 300;  // over several 64-row blocks (and 256-row chunks), the last partial
  for (const int64_t C : {int64_t{100}, int64_t{768}, int64_t{2100}}) {  // C = 100: not 32·k
    SCOPED_TRACE("C=" + std::to_string(C));
    Pair x = random_pair(N * C, 40, -3.0, 5.0), w = random_pair(C, 41), b = random_pair(C, 42);
    Pair y = pair_of(std::vector<float>(N * C)), mean = pair_of(std::vector<float>(N)),
         rstd = pair_of(std::vector<float>(N));
    ops::layernorm_forward<float>(on_cpu, y.h(), mean.h(), rstd.h(), x.h(), w.h(), b.h(), N, C);
    ops::layernorm_forward<float>(on_gpu, y.g(), mean.g(), rstd.g(), x.g(), w.g(), b.g(), N, C);
    expect_pair_close("out", y);
    expect_pair_close("mean", mean);
    expect_pair_close("rstd", rstd);

    Pair dy = random_pair(N * C, 43), dx = pair_of(std::vector<float>(N * C));
    Pair dw = random_pair(C, 44), db = random_pair(C, 45);
    ops::layernorm_backward<float>(on_cpu, dx.h(), dw.h(), db.h(), dy.h(), x.h(), w.h(), mean.h(),
                                   rstd.h(), N, C);
    ops::layernorm_backward<float>(on_gpu, dx.g(), dw.g(), db.g(), dy.g(), x.g(), w.g(), mean.g(),
                                   rstd.g(), N, C);
    expect_pair_close("dinp", dx);
    expect_pair_close("dweight", dw);
    expect_pair_close("dbias", db);

    // With a skip connection's gradient added to dinp in the same kernel: bit for bit the
    // backward then add_inplace on the GPU (on scale: |dresidual| up to 100 against dinp's ~1, so
    // contracting the add into the product before it would show), and near the CPU's.
    Pair dres = random_pair(N * C, 46, -100.0, 100.0), dx2 = pair_of(std::vector<float>(N * C));
    Pair dw2 = random_pair(C, 44), db2 = random_pair(C, 45);
    ops::layernorm_backward_adding<float>(on_cpu, dx2.h(), dw2.h(), db2.h(), dy.h(), x.h(), w.h(),
                                          mean.h(), rstd.h(), dres.h(), N, C);
    ops::layernorm_backward_adding<float>(on_gpu, dx2.g(), dw2.g(), db2.g(), dy.g(), x.g(), w.g(),
                                          mean.g(), rstd.g(), dres.g(), N, C);
    expect_pair_close("dinp + dresidual", dx2);
    Pair dw3 = random_pair(C, 44), db3 = random_pair(C, 45),
         dx3 = pair_of(std::vector<float>(N * C));
    ops::layernorm_backward<float>(on_gpu, dx3.g(), dw3.g(), db3.g(), dy.g(), x.g(), w.g(),
                                   mean.g(), rstd.g(), N, C);
    ops::add_inplace<float>(on_gpu, dx3.g(), dres.g(), N * C);
    EXPECT_TRUE(bitwise_equal(dx2.from_gpu(), dx3.from_gpu())) << "dinp + dresidual";
    EXPECT_TRUE(bitwise_equal(dw2.from_gpu(), dw3.from_gpu())) << "dweight";
    EXPECT_TRUE(bitwise_equal(db2.from_gpu(), db3.from_gpu())) << "dbias";
  }
}

// RMSNorm as LayerNorm above: C = 100, 768 and 2100 take the fused backward's two sizes and the
// separate column sums; with the skip connection's gradient bit for bit the backward then
// add_inplace on the GPU; the GPU's runs repeat bit for bit.
TEST_F(CudaKernelsTest, RmsNormMatchesCpuAndRepeats) {
  const int64_t N = 300;  // over several 64-row blocks (and 256-row chunks), the last partial
  const double eps = 1e-5;
  for (const int64_t C : {int64_t{100}, int64_t{768}, int64_t{2100}}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    Pair x = random_pair(N * C, 140, -3.0, 5.0), w = random_pair(C, 141);
    Pair y = pair_of(std::vector<float>(N * C)), rstd = pair_of(std::vector<float>(N));
    ops::rmsnorm_forward<float>(on_cpu, y.h(), rstd.h(), x.h(), w.h(), N, C, eps);
    ops::rmsnorm_forward<float>(on_gpu, y.g(), rstd.g(), x.g(), w.g(), N, C, eps);
    expect_pair_close("out", y);
    expect_pair_close("rstd", rstd);

    Pair dy = random_pair(N * C, 143), dx = pair_of(std::vector<float>(N * C));
    const std::vector<float> dw0 = random_floats(C, 144);
    Pair dw = pair_of(dw0);  // accumulated onto
    ops::rmsnorm_backward<float>(on_cpu, dx.h(), dw.h(), dy.h(), x.h(), w.h(), rstd.h(), N, C);
    ops::rmsnorm_backward<float>(on_gpu, dx.g(), dw.g(), dy.g(), x.g(), w.g(), rstd.g(), N, C);
    expect_pair_close("dinp", dx);
    expect_pair_close("dweight", dw);

    Pair dres = random_pair(N * C, 146, -100.0, 100.0), dx2 = pair_of(std::vector<float>(N * C));
    Pair dw2 = pair_of(dw0);
    ops::rmsnorm_backward_adding<float>(on_cpu, dx2.h(), dw2.h(), dy.h(), x.h(), w.h(), rstd.h(),
                                        dres.h(), N, C);
    ops::rmsnorm_backward_adding<float>(on_gpu, dx2.g(), dw2.g(), dy.g(), x.g(), w.g(), rstd.g(),
                                        dres.g(), N, C);
    expect_pair_close("dinp + dresidual", dx2);
    Pair dx3 = pair_of(std::vector<float>(N * C)), dw3 = pair_of(dw0);
    ops::rmsnorm_backward<float>(on_gpu, dx3.g(), dw3.g(), dy.g(), x.g(), w.g(), rstd.g(), N, C);
    ops::add_inplace<float>(on_gpu, dx3.g(), dres.g(), N * C);
    EXPECT_TRUE(bitwise_equal(dx2.from_gpu(), dx3.from_gpu())) << "dinp + dresidual";
    EXPECT_TRUE(bitwise_equal(dw2.from_gpu(), dw3.from_gpu())) << "dweight";
    EXPECT_TRUE(bitwise_equal(dw2.from_gpu(), dw.from_gpu())) << "dweight not reproducible";
    EXPECT_FALSE(bitwise_equal(dx3.from_gpu(), dx.from_gpu())) << "dresidual not added";

    const std::vector<float> first = y.from_gpu();
    ops::rmsnorm_forward<float>(on_gpu, y.g(), rstd.g(), x.g(), w.g(), N, C, eps);
    EXPECT_TRUE(bitwise_equal(y.from_gpu(), first)) << "out not reproducible";
  }
}

// The kernels of an RMSNorm whose rows a tp group splits (OLMo 2's query/key norms): the partial
// sums (Σx², and Σ weight·dout·x), the forward given the row's sums over C_full columns and the
// backward given its dots, near the CPU's for C = 96 of 192, 768 of 1536 and 2100 of 4200 (the
// fused backward's sizes and the separate column sums).
TEST_F(CudaKernelsTest, SplitRowRmsNormMatchesCpu) {
  const int64_t N = 300;
  for (const int64_t C : {int64_t{96}, int64_t{768}, int64_t{2100}}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t C_full = 2 * C;
    Pair x = random_pair(N * C, 150, -3.0, 5.0), w = random_pair(C, 151);
    Pair dy = random_pair(N * C, 152);
    Pair sums = pair_of(std::vector<float>(N)), dots = pair_of(std::vector<float>(N));
    ops::rmsnorm_partial_sums<float>(on_cpu, sums.h(), x.h(), x.h(), nullptr, N, C);
    ops::rmsnorm_partial_sums<float>(on_gpu, sums.g(), x.g(), x.g(), nullptr, N, C);
    expect_pair_close("sums", sums);
    ops::rmsnorm_partial_sums<float>(on_cpu, dots.h(), dy.h(), x.h(), w.h(), N, C);
    ops::rmsnorm_partial_sums<float>(on_gpu, dots.g(), dy.g(), x.g(), w.g(), N, C);
    expect_pair_close("dots", dots);
    // As if the other rank's columns held as much again: the row's sums over C_full, the same on
    // both sides.
    Pair whole_sums = pair_of(std::vector<float>(N)), whole_dots = pair_of(std::vector<float>(N));
    {
      std::vector<float> s = sums.from_host(), d = dots.from_host();
      for (int64_t r = 0; r < N; ++r) s[r] *= 2.5f, d[r] *= -1.5f;
      whole_sums = pair_of(s);
      whole_dots = pair_of(d);
    }
    Pair y = pair_of(std::vector<float>(N * C)), rstd = pair_of(std::vector<float>(N));
    ops::rmsnorm_forward_of_sums<float>(on_cpu, y.h(), rstd.h(), whole_sums.h(), x.h(), w.h(), N, C,
                                        C_full, 1e-5);
    ops::rmsnorm_forward_of_sums<float>(on_gpu, y.g(), rstd.g(), whole_sums.g(), x.g(), w.g(), N, C,
                                        C_full, 1e-5);
    expect_pair_close("out", y);
    expect_pair_close("rstd", rstd);
    Pair dx = pair_of(std::vector<float>(N * C)), dw = pair_of(random_floats(C, 153));
    ops::rmsnorm_backward_of_dots<float>(on_cpu, dx.h(), dw.h(), dy.h(), x.h(), w.h(), rstd.h(),
                                         whole_dots.h(), N, C, C_full);
    ops::rmsnorm_backward_of_dots<float>(on_gpu, dx.g(), dw.g(), dy.g(), x.g(), w.g(), rstd.g(),
                                         whole_dots.g(), N, C, C_full);
    expect_pair_close("dinp", dx);
    expect_pair_close("dweight", dw);
  }
}

// RoPE with the heads shared by groups of two, none (KV = NH) and all (KV = 1): the forward and
// the backward (a shared head's gradients summed) near the CPU's, and bit for bit again on a
// second GPU run; shapes it cannot share refused before anything runs.
TEST_F(CudaKernelsTest, RopeGqaMatchesCpuAndRepeats) {
  const int64_t B = 2, T = 37, hd = 16;
  std::vector<float> table(T * hd);
  cpu::rope_table(table.data(), T, hd, 10000.0);
  Pair cs = pair_of(table);
  using Heads = std::pair<int64_t, int64_t>;  // query heads, key/value heads
  for (const auto& [NH, KV] : {Heads{4, 2}, Heads{4, 4}, Heads{4, 1}}) {
    SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV));
    Pair qkv = random_pair(B * T * (NH + 2 * KV) * hd, 150, -3.0, 3.0);
    Pair out = pair_of(std::vector<float>(B * T * 3 * NH * hd));
    ops::rope_gqa_forward<float>(on_cpu, out.h(), qkv.h(), cs.h(), B, T, NH, KV, hd);
    ops::rope_gqa_forward<float>(on_gpu, out.g(), qkv.g(), cs.g(), B, T, NH, KV, hd);
    expect_pair_close("out", out);
    Pair dout = random_pair(B * T * 3 * NH * hd, 151);
    Pair dqkv = pair_of(std::vector<float>(B * T * (NH + 2 * KV) * hd));
    ops::rope_gqa_backward<float>(on_cpu, dqkv.h(), dout.h(), cs.h(), B, T, NH, KV, hd);
    ops::rope_gqa_backward<float>(on_gpu, dqkv.g(), dout.g(), cs.g(), B, T, NH, KV, hd);
    expect_pair_close("dqkv", dqkv);

    const std::vector<float> first_out = out.from_gpu(), first_dqkv = dqkv.from_gpu();
    out.gpu.zero_();
    dqkv.gpu.zero_();
    ops::rope_gqa_forward<float>(on_gpu, out.g(), qkv.g(), cs.g(), B, T, NH, KV, hd);
    ops::rope_gqa_backward<float>(on_gpu, dqkv.g(), dout.g(), cs.g(), B, T, NH, KV, hd);
    EXPECT_TRUE(bitwise_equal(out.from_gpu(), first_out)) << "out not reproducible";
    EXPECT_TRUE(bitwise_equal(dqkv.from_gpu(), first_dqkv)) << "dqkv not reproducible";
  }
  Pair buf = pair_of(std::vector<float>(B * T * 10 * hd));
  expect_refused(
      [&] { ops::rope_gqa_forward<float>(on_gpu, buf.g(), buf.g(), cs.g(), B, T, 4, 3, hd); },
      "3 key/value heads do not divide 4 query heads", "KV = 3 with NH = 4 was accepted");
}

// The rotary embedding in place on qkv's query and key heads (cuda::rope_forward / rope_backward):
// near a reference written here, the value heads bit for bit untouched, the backward turning the
// forward's output back to the input (to rounding), bit for bit again on a second run; with the
// heads shared by groups of two, none and all. Shapes that cannot be shared are refused.
TEST_F(CudaKernelsTest, RopeInPlaceMatchesAReferenceAndTurnsBack) {
  const int64_t B = 2, T = 37, hd = 16, half = hd / 2;
  std::vector<float> table(T * hd);
  cpu::rope_table(table.data(), T, hd, 10000.0);
  Pair cs = pair_of(table);
  // x rotated in place on the host, forward or back, over the query and key heads.
  auto rotate = [&](std::vector<float> x, int64_t NH, int64_t KV, bool back) {
    const int64_t row = (NH + 2 * KV) * hd;
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t j = 0; j < NH + KV; ++j)
        for (int64_t i = 0; i < half; ++i) {
          float* h = x.data() + r * row + j * hd;
          const float c = table[(r % T) * hd + i], s = table[(r % T) * hd + half + i];
          const float x0 = h[i], x1 = h[i + half];
          h[i] = back ? x0 * c + x1 * s : x0 * c - x1 * s;
          h[i + half] = back ? x1 * c - x0 * s : x1 * c + x0 * s;
        }
    return x;
  };
  // Whether a and b hold the same bits in every value head.
  auto same_values = [&](const std::vector<float>& a, const std::vector<float>& b, int64_t NH,
                         int64_t KV) {
    const int64_t row = (NH + 2 * KV) * hd;
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t c = (NH + KV) * hd; c < row; ++c)
        if (std::memcmp(&a[r * row + c], &b[r * row + c], sizeof(float)) != 0) return false;
    return true;
  };
  using Heads = std::pair<int64_t, int64_t>;  // query heads, key/value heads
  for (const auto& [NH, KV] : {Heads{4, 2}, Heads{4, 4}, Heads{4, 1}}) {
    SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV));
    const int64_t n = B * T * (NH + 2 * KV) * hd;
    const std::vector<float> x = random_floats(n, 170, -3.0, 3.0), dy = random_floats(n, 171);
    Pair qkv = pair_of(x);
    cuda::rope_forward(0, qkv.g(), cs.g(), B, T, NH, KV, hd);
    const std::vector<float> y = qkv.from_gpu();
    expect_close("forward", y, rotate(x, NH, KV, false), kTol);
    EXPECT_TRUE(same_values(y, x, NH, KV)) << "forward changed a value head";
    EXPECT_FALSE(bitwise_equal(y, x)) << "nothing rotated";

    Pair dqkv = pair_of(dy);
    cuda::rope_backward(0, dqkv.g(), cs.g(), B, T, NH, KV, hd);
    const std::vector<float> dx = dqkv.from_gpu();
    expect_close("backward", dx, rotate(dy, NH, KV, true), kTol);
    EXPECT_TRUE(same_values(dx, dy, NH, KV)) << "backward changed a value head";

    cuda::rope_backward(0, qkv.g(), cs.g(), B, T, NH, KV, hd);
    expect_close("forward then backward", qkv.from_gpu(), x, kTol);

    Pair again = pair_of(x);
    cuda::rope_forward(0, again.g(), cs.g(), B, T, NH, KV, hd);
    EXPECT_TRUE(bitwise_equal(again.from_gpu(), y)) << "forward not reproducible";
    Pair dagain = pair_of(dy);
    cuda::rope_backward(0, dagain.g(), cs.g(), B, T, NH, KV, hd);
    EXPECT_TRUE(bitwise_equal(dagain.from_gpu(), dx)) << "backward not reproducible";
  }
  Pair buf = pair_of(std::vector<float>(B * T * 10 * hd));
  expect_refused([&] { cuda::rope_forward(0, buf.g(), cs.g(), B, T, 4, 3, hd); },
                 "3 key/value heads do not divide 4 query heads",
                 "KV = 3 with NH = 4 was accepted");
  expect_refused([&] { cuda::rope_backward(0, buf.g(), cs.g(), B, T, 4, 2, 15); },
                 "head size 15 is not even", "an odd head size was accepted");
}

// Grouped-query attention on qkv (B, T, (NH + 2·KV)·hd) as the projection writes it
// (cuda::attention_gqa_forward / attention_gqa_backward) against the CPU's attention on the heads
// repeated: cpu::rope_gqa_forward with an identity table (cos 1, sin 0) expands them,
// cpu::attention_forward / attention_backward run, cpu::rope_gqa_backward with the identity table
// sums a shared head's gradients in ascending query head. out and lse within out_tol, dqkv within
// dqkv_tol of their scale, the GPU's backward fed its own forward's results; bit for bit the
// GPU's own composition of those kernels (with KV == NH: attention_forward / attention_backward on
// qkv itself) — except that where the flash kernels read the shared heads in place (bf16, head
// size 64) a shared head's gradient is summed in their accumulators, in another order than the
// repeated heads' gradients summed after: there the key and value heads' gradients agree to fp32
// rounding (1e-5), the rest bit for bit — and bit for bit again on a second run. Returns the
// largest |GPU − CPU| of dqkv.
double expect_attention_gqa_matches_cpu(ThreadPool& pool, int64_t B, int64_t T, int64_t NH,
                                        int64_t KV, int64_t hd, uint64_t seed, double out_tol,
                                        double dqkv_tol) {
  SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV) +
               " hd=" + std::to_string(hd));
  const int64_t C = NH * hd, n_in = B * T * (NH + 2 * KV) * hd, n_full = B * T * 3 * C;
  std::vector<float> identity(T * hd, 0.0f);
  for (int64_t t = 0; t < T; ++t) std::fill_n(identity.begin() + t * hd, hd / 2, 1.0f);
  Pair id = pair_of(identity);
  Pair qkv = random_pair(n_in, seed, -2.0, 2.0), dout = random_pair(B * T * C, seed + 1);
  const std::vector<float> qkv0 = qkv.from_gpu();
  Pair out = pair_of(std::vector<float>(B * T * C)), lse = pair_of(std::vector<float>(B * NH * T));
  Pair dqkv = pair_of(std::vector<float>(n_in));

  // The CPU on the repeated heads.
  std::vector<float> full(n_full), dfull(n_full);
  cpu::rope_gqa_forward(pool, full.data(), qkv.h(), id.h(), B, T, NH, KV, hd);
  cpu::attention_forward(pool, out.h(), lse.h(), full.data(), B, T, C, NH);
  cpu::attention_backward(pool, dfull.data(), dout.h(), full.data(), out.h(), lse.h(), B, T, C, NH);
  cpu::rope_gqa_backward(pool, dqkv.h(), dfull.data(), id.h(), B, T, NH, KV, hd);

  cuda::attention_gqa_forward(0, out.g(), lse.g(), qkv.g(), B, T, NH, KV, hd);
  expect_pair_close("out", out, out_tol);
  expect_pair_close("lse", lse, out_tol);
  cuda::attention_gqa_backward(0, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, NH, KV, hd);
  expect_pair_close("dqkv", dqkv, dqkv_tol);
  EXPECT_TRUE(bitwise_equal(qkv.from_gpu(), qkv0)) << "qkv changed";

  // The GPU's kernels composed the same way, on a repeated copy.
  const std::vector<float> first_out = out.from_gpu(), first_lse = lse.from_gpu(),
                           first_dqkv = dqkv.from_gpu();
  {
    Pair rep = pair_of(std::vector<float>(n_full)), drep = pair_of(std::vector<float>(n_full));
    Pair o = pair_of(std::vector<float>(B * T * C)), l = pair_of(std::vector<float>(B * NH * T));
    Pair g = pair_of(std::vector<float>(n_in));
    cuda::rope_gqa_forward(0, rep.g(), qkv.g(), id.g(), B, T, NH, KV, hd);
    cuda::attention_forward(0, o.g(), l.g(), rep.g(), B, T, C, NH);
    cuda::attention_backward(0, drep.g(), dout.g(), rep.g(), o.g(), l.g(), B, T, C, NH);
    cuda::rope_gqa_backward(0, g.g(), drep.g(), id.g(), B, T, NH, KV, hd);
    EXPECT_TRUE(bitwise_equal(o.from_gpu(), first_out)) << "out: not the repeated heads'";
    EXPECT_TRUE(bitwise_equal(l.from_gpu(), first_lse)) << "lse: not the repeated heads'";
    const bool in_place = KV != NH && cuda::attention_takes_rounded_qkv(C, NH, B);
    if (!in_place) {
      EXPECT_TRUE(bitwise_equal(g.from_gpu(), first_dqkv)) << "dqkv: not the repeated heads'";
    } else {
      const std::vector<float> composed = g.from_gpu();
      const int64_t row = (NH + 2 * KV) * hd;
      std::vector<float> dq_a, dq_b, dkv_a, dkv_b;
      for (int64_t i = 0; i < n_in; ++i) {
        const bool query = i % row < NH * hd;
        (query ? dq_a : dkv_a).push_back(first_dqkv[i]);
        (query ? dq_b : dkv_b).push_back(composed[i]);
      }
      EXPECT_TRUE(bitwise_equal(dq_a, dq_b)) << "dQ: not the repeated heads'";
      expect_close("dK, dV against the repeated heads'", dkv_a, dkv_b, 1e-5);
      EXPECT_FALSE(bitwise_equal(dkv_a, dkv_b)) << "the shared heads were not read in place";
    }
  }

  out.gpu.zero_();
  lse.gpu.zero_();
  dqkv.gpu.zero_();
  cuda::attention_gqa_forward(0, out.g(), lse.g(), qkv.g(), B, T, NH, KV, hd);
  cuda::attention_gqa_backward(0, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, NH, KV, hd);
  EXPECT_TRUE(bitwise_equal(out.from_gpu(), first_out)) << "out not reproducible";
  EXPECT_TRUE(bitwise_equal(lse.from_gpu(), first_lse)) << "lse not reproducible";
  EXPECT_TRUE(bitwise_equal(dqkv.from_gpu(), first_dqkv)) << "dqkv not reproducible";

  const std::vector<float> want = dqkv.from_host();
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, double(std::abs(first_dqkv[i] - want[i])));
  return worst;
}

// Heads shared by groups of two, all (KV = 1) and none (KV = NH), head sizes 16 and 64 (the
// batched-GEMM path at fp32) and 6, over a T that is no multiple of anything; shapes it cannot
// share refused.
TEST_F(CudaKernelsTest, AttentionGqaReadsSharedHeadsInPlaceAndMatchesCpu) {
  using Heads = std::pair<int64_t, int64_t>;  // query heads, key/value heads
  for (int64_t hd : {16, 64})
    for (const auto& [NH, KV] : {Heads{4, 2}, Heads{4, 1}, Heads{4, 4}})
      expect_attention_gqa_matches_cpu(pool, 2, 37, NH, KV, hd, 180 + hd, kTol, kTol);
  // Head size 6: one float a thread instead of four.
  expect_attention_gqa_matches_cpu(pool, 2, 37, 4, 2, 6, 186, kTol, kTol);
  Pair buf = pair_of(std::vector<float>(2 * 5 * 10 * 16)), o = pair_of(std::vector<float>(640)),
       l = pair_of(std::vector<float>(40));
  expect_refused([&] { cuda::attention_gqa_forward(0, o.g(), l.g(), buf.g(), 2, 5, 4, 3, 16); },
                 "3 key/value heads do not divide 4 query heads",
                 "KV = 3 with NH = 4 was accepted");
}

// At bf16 with head size 64 or 128 the flash kernels read the shared heads in place: within
// bf16's rounding of the fp32 CPU, and the GPU's own composition on repeated heads (dQ bit for
// bit, dK and dV to fp32 rounding) and itself bit for bit.
TEST_F(CudaKernelsTest, AttentionGqaTakesTheFlashKernelsInBf16) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  ASSERT_TRUE(cuda::attention_takes_rounded_qkv(4 * 64, 4, 2)) << "the flash kernels do not apply";
  ASSERT_TRUE(cuda::attention_takes_rounded_qkv(4 * 128, 4, 2)) << "nor at head size 128";
  using Heads = std::pair<int64_t, int64_t>;
  for (const int64_t hd : {64, 128})
    for (const auto& [NH, KV] : {Heads{4, 2}, Heads{4, 1}, Heads{4, 4}}) {
      const double worst =
          expect_attention_gqa_matches_cpu(pool, 2, 77, NH, KV, hd, 190 + KV, 1e-2, 2e-2);
      EXPECT_GT(worst, 1e-5) << "bf16 was not applied";
    }
}

// Each sequence's probability sums (the balance loss's P_e) over sequences longer than a block's
// chunk of tokens (600: two whole chunks of 256 and a part) and more experts than threads (700:
// some threads adding three experts, some two), for softmax probabilities and for sigmoid scores
// normalised per token (a token's sum computed once): the CPU's sums, in the same order.
TEST_F(CudaKernelsTest, ProbabilitySumsOfLongSequencesAndManyExpertsMatchCpu) {
  const int64_t B = 2, T = 600, E = 700;
  Pair scores = random_pair(B * T * E, 171, 0.0, 1.0);
  for (const bool sigmoid : {false, true}) {
    Tensor sums_cpu = Tensor::empty({B, E}, DType::kF64), sums_gpu = sums_cpu.to(Device::cuda(0));
    ops::moe_prob_sums<float>(on_cpu, sums_cpu.data<double>(), scores.h(), B, T, E, sigmoid);
    ops::moe_prob_sums<float>(on_gpu, sums_gpu.data<double>(), scores.g(), B, T, E, sigmoid);
    const Tensor back = sums_gpu.to(Device::cpu());
    double total = 0;
    for (int64_t i = 0; i < B * E; ++i) {
      const double want = sums_cpu.data<double>()[i];
      EXPECT_NEAR(back.data<double>()[i], want, 1e-12 * want) << (sigmoid ? "sigmoid " : "") << i;
      total += want;
    }
    // Normalised, a token's scores sum to 1: the sums to T a sequence.
    if (sigmoid)
      EXPECT_NEAR(total, static_cast<double>(B * T), 1e-6);
    else
      EXPECT_NEAR(total, static_cast<double>(B * T * E) / 2, 0.01 * static_cast<double>(B * T * E));
  }
}

// A mixture of experts' kernels (kernels/cpu/moe.h): the routing — the same experts chosen, in
// the same order, the probabilities and weights to fp32 rounding —, each sequence's probability
// sums, an expert's rows gathered (bit for bit) and scattered back weighed, the routing weights'
// gradients and the router's, on 3 sequences of 13 tokens, 6 experts, top 2.
TEST_F(CudaKernelsTest, MixtureOfExpertsKernelsMatchCpu) {
  const int64_t B = 3, T = 13, N = B * T, E = 6, K = 2, C = 37;
  Pair logits = random_pair(N * E, 170, -3.0, 3.0);
  Pair probs = pair_of(std::vector<float>(N * E)), weight = pair_of(std::vector<float>(N * K));
  Pair lse = pair_of(std::vector<float>(N));
  IdPair choice = ids_pair(std::vector<int32_t>(N * K));
  ops::moe_route<float>(on_cpu, probs.h(), choice.host.data<int32_t>(), weight.h(), lse.h(),
                        logits.h(), N, E, K);
  ops::moe_route<float>(on_gpu, probs.g(), choice.gpu.data<int32_t>(), weight.g(), lse.g(),
                        logits.g(), N, E, K);
  expect_pair_close("probs", probs, 1e-6);
  expect_pair_close("lse", lse, 1e-6);
  expect_pair_close("weight", weight, 1e-6);
  const Tensor gpu_choice = choice.gpu.to(Device::cpu());
  ASSERT_EQ(std::memcmp(gpu_choice.raw(), choice.host.raw(), N * K * sizeof(int32_t)), 0)
      << "another routing";
  // With balancing biases (the choice by p + bias, the weights of p): the same choices and
  // weights as the CPU's.
  Pair bias = random_pair(E, 171, -0.3, 0.3);
  Pair biased_weight = pair_of(std::vector<float>(N * K));
  IdPair biased = ids_pair(std::vector<int32_t>(N * K));
  ops::moe_route<float>(on_cpu, probs.h(), biased.host.data<int32_t>(), biased_weight.h(), lse.h(),
                        logits.h(), N, E, K, MoeRouting{bias.h()});
  ops::moe_route<float>(on_gpu, probs.g(), biased.gpu.data<int32_t>(), biased_weight.g(), lse.g(),
                        logits.g(), N, E, K, MoeRouting{bias.g()});
  expect_pair_close("weight with biases", biased_weight, 1e-6);
  const Tensor gpu_biased = biased.gpu.to(Device::cpu());
  ASSERT_EQ(std::memcmp(gpu_biased.raw(), biased.host.raw(), N * K * sizeof(int32_t)), 0)
      << "another routing with biases";
  ASSERT_NE(std::memcmp(biased.host.raw(), choice.host.raw(), N * K * sizeof(int32_t)), 0)
      << "the biases changed no choice";
  Tensor sums_cpu = Tensor::empty({B, E}, DType::kF64), sums_gpu = sums_cpu.to(Device::cuda(0));
  ops::moe_prob_sums<float>(on_cpu, sums_cpu.data<double>(), probs.h(), B, T, E);
  ops::moe_prob_sums<float>(on_gpu, sums_gpu.data<double>(), probs.g(), B, T, E);
  const Tensor sums_back = sums_gpu.to(Device::cpu());
  for (int64_t i = 0; i < B * E; ++i)
    EXPECT_NEAR(sums_back.data<double>()[i], sums_cpu.data<double>()[i], 1e-9) << i;
  // Expert 2's rows: the tokens that chose it, in order, and where.
  std::vector<int32_t> rows, slots;
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < K; ++j)
      if (choice.host.data<int32_t>()[t * K + j] == 2) {
        rows.push_back(static_cast<int32_t>(t));
        slots.push_back(static_cast<int32_t>(j));
      }
  const int64_t n = static_cast<int64_t>(rows.size());
  ASSERT_GT(n, 2);
  const IdPair r = ids_pair(rows), s = ids_pair(slots);
  Pair x = random_pair(N * C, 171), gathered = pair_of(std::vector<float>(n * C));
  ops::gather_rows(on_cpu, gathered.h(), x.h(), r.host.data<int32_t>(), n, C * 4);
  ops::gather_rows(on_gpu, gathered.g(), x.g(), r.gpu.data<int32_t>(), n, C * 4);
  EXPECT_TRUE(bitwise_equal(gathered.from_gpu(), gathered.from_host()));
  Pair y = random_pair(N * C, 172), out = random_pair(n * C, 173);
  for (const bool weighed : {true, false}) {
    ops::moe_scatter_add<float>(on_cpu, y.h(), out.h(), r.host.data<int32_t>(),
                                s.host.data<int32_t>(), weighed ? weight.h() : nullptr, n, C, K);
    ops::moe_scatter_add<float>(on_gpu, y.g(), out.g(), r.gpu.data<int32_t>(),
                                s.gpu.data<int32_t>(), weighed ? weight.g() : nullptr, n, C, K);
    expect_pair_close(weighed ? "y, weighed" : "y", y, 1e-6);
  }
  Pair g = random_pair(n * C, 174), dweight = pair_of(std::vector<float>(N * K));
  ops::moe_expert_output_grad<float>(on_cpu, g.h(), dweight.h(), out.h(), r.host.data<int32_t>(),
                                     s.host.data<int32_t>(), weight.h(), n, C, K);
  ops::moe_expert_output_grad<float>(on_gpu, g.g(), dweight.g(), out.g(), r.gpu.data<int32_t>(),
                                     s.gpu.data<int32_t>(), weight.g(), n, C, K);
  expect_pair_close("g", g, 1e-6);
  expect_pair_close("dweight", dweight, 1e-6);
  Pair every_dweight = random_pair(N * K, 175), dlogits = pair_of(std::vector<float>(N * E));
  Tensor balance = Tensor::empty({B, E}, DType::kF64);
  for (int64_t i = 0; i < B * E; ++i) balance.data<double>()[i] = 0.01 * static_cast<double>(i % 5);
  const Tensor balance_gpu = balance.to(Device::cuda(0));
  // With the router z-loss's term (z = 0.01).
  ops::moe_router_backward<float>(on_cpu, dlogits.h(), probs.h(), choice.host.data<int32_t>(),
                                  weight.h(), every_dweight.h(), balance.data<double>(), lse.h(),
                                  0.01, B, T, E, K);
  ops::moe_router_backward<float>(on_gpu, dlogits.g(), probs.g(), choice.gpu.data<int32_t>(),
                                  weight.g(), every_dweight.g(), balance_gpu.data<double>(),
                                  lse.g(), 0.01, B, T, E, K);
  expect_pair_close("dlogits", dlogits, 1e-6);
  // Sigmoid scores (DeepSeek-V3's; model.moe_router_score_function), with biases: the same
  // choices, scores and weights; the normalised scores' sums; the router's gradient.
  Pair scores = pair_of(std::vector<float>(N * E)),
       sigmoid_weight = pair_of(std::vector<float>(N * K));
  IdPair sigmoid_choice = ids_pair(std::vector<int32_t>(N * K));
  ops::moe_route<float>(on_cpu, scores.h(), sigmoid_choice.host.data<int32_t>(), sigmoid_weight.h(),
                        lse.h(), logits.h(), N, E, K, MoeRouting{bias.h(), true});
  ops::moe_route<float>(on_gpu, scores.g(), sigmoid_choice.gpu.data<int32_t>(), sigmoid_weight.g(),
                        lse.g(), logits.g(), N, E, K, MoeRouting{bias.g(), true});
  expect_pair_close("sigmoid scores", scores, 1e-6);
  expect_pair_close("sigmoid weight", sigmoid_weight, 1e-6);
  const Tensor gpu_sigmoid = sigmoid_choice.gpu.to(Device::cpu());
  ASSERT_EQ(std::memcmp(gpu_sigmoid.raw(), sigmoid_choice.host.raw(), N * K * sizeof(int32_t)), 0)
      << "another routing by sigmoid scores";
  EXPECT_NEAR(scores.from_host()[0], 1 / (1 + std::exp(-logits.from_host()[0])), 1e-6);
  ops::moe_prob_sums<float>(on_cpu, sums_cpu.data<double>(), scores.h(), B, T, E, true);
  ops::moe_prob_sums<float>(on_gpu, sums_gpu.data<double>(), scores.g(), B, T, E, true);
  const Tensor sigmoid_sums = sums_gpu.to(Device::cpu());
  double total = 0;  // each token's normalised scores sum to 1: the sums, to T a sequence
  for (int64_t i = 0; i < B * E; ++i) {
    EXPECT_NEAR(sigmoid_sums.data<double>()[i], sums_cpu.data<double>()[i], 1e-9) << i;
    total += sums_cpu.data<double>()[i];
  }
  EXPECT_NEAR(total, static_cast<double>(B * T), 1e-9);
  ops::moe_router_backward<float>(
      on_cpu, dlogits.h(), scores.h(), sigmoid_choice.host.data<int32_t>(), sigmoid_weight.h(),
      every_dweight.h(), balance.data<double>(), lse.h(), 0, B, T, E, K, true);
  ops::moe_router_backward<float>(
      on_gpu, dlogits.g(), scores.g(), sigmoid_choice.gpu.data<int32_t>(), sigmoid_weight.g(),
      every_dweight.g(), balance_gpu.data<double>(), lse.g(), 0, B, T, E, K, true);
  expect_pair_close("sigmoid dlogits", dlogits, 1e-6);
  // Group-limited routing (3 groups of 2, the best one or two; with biases) and the weights
  // scaled by 2.5: the same choices and weights, and the router's gradient with the scale.
  for (const int64_t group_topk : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "best " << group_topk << " of 3 groups");
    IdPair grouped = ids_pair(std::vector<int32_t>(N * K));
    ops::moe_route<float>(on_cpu, scores.h(), grouped.host.data<int32_t>(), sigmoid_weight.h(),
                          lse.h(), logits.h(), N, E, K,
                          MoeRouting{bias.h(), true, 3, group_topk, 2.5});
    ops::moe_route<float>(on_gpu, scores.g(), grouped.gpu.data<int32_t>(), sigmoid_weight.g(),
                          lse.g(), logits.g(), N, E, K,
                          MoeRouting{bias.g(), true, 3, group_topk, 2.5});
    expect_pair_close("grouped weight", sigmoid_weight, 1e-6);
    const Tensor gpu_grouped = grouped.gpu.to(Device::cpu());
    ASSERT_EQ(std::memcmp(gpu_grouped.raw(), grouped.host.raw(), N * K * sizeof(int32_t)), 0)
        << "another group-limited routing";
    EXPECT_NEAR(sigmoid_weight.from_host()[0] + sigmoid_weight.from_host()[1], 2.5, 1e-5);
    if (group_topk == 1) {  // both experts of one group
      for (int64_t i = 0; i < N; ++i) {
        EXPECT_EQ(grouped.host.data<int32_t>()[i * K] / 2,
                  grouped.host.data<int32_t>()[i * K + 1] / 2)
            << "token " << i;
      }
    }
    ops::moe_router_backward<float>(on_cpu, dlogits.h(), scores.h(), grouped.host.data<int32_t>(),
                                    sigmoid_weight.h(), every_dweight.h(), balance.data<double>(),
                                    lse.h(), 0, B, T, E, K, true, 2.5);
    ops::moe_router_backward<float>(on_gpu, dlogits.g(), scores.g(), grouped.gpu.data<int32_t>(),
                                    sigmoid_weight.g(), every_dweight.g(),
                                    balance_gpu.data<double>(), lse.g(), 0, B, T, E, K, true, 2.5);
    expect_pair_close("grouped dlogits", dlogits, 1e-6);
  }
  // The chosen scores not normalised (model.moe_router_norm_topk_prob = false), softmax and
  // sigmoid scores: each weight 2.5 × its score, and the router's gradient without the
  // normalisation's term.
  for (const bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid, not normalised" : "softmax, not normalised");
    IdPair chosen = ids_pair(std::vector<int32_t>(N * K));
    MoeRouting plain_cpu{bias.h(), sigmoid}, plain_gpu{bias.g(), sigmoid};
    plain_cpu.scale = plain_gpu.scale = 2.5;
    plain_cpu.normalize = plain_gpu.normalize = false;
    ops::moe_route<float>(on_cpu, scores.h(), chosen.host.data<int32_t>(), sigmoid_weight.h(),
                          lse.h(), logits.h(), N, E, K, plain_cpu);
    ops::moe_route<float>(on_gpu, scores.g(), chosen.gpu.data<int32_t>(), sigmoid_weight.g(),
                          lse.g(), logits.g(), N, E, K, plain_gpu);
    expect_pair_close("weight", sigmoid_weight, 1e-6);
    const std::vector<float> w = sigmoid_weight.from_host(), p = scores.from_host();
    EXPECT_NEAR(w[0], 2.5 * p[chosen.host.data<int32_t>()[0]], 1e-6);
    ops::moe_router_backward<float>(on_cpu, dlogits.h(), scores.h(), chosen.host.data<int32_t>(),
                                    sigmoid_weight.h(), every_dweight.h(), balance.data<double>(),
                                    lse.h(), 0, B, T, E, K, sigmoid, 2.5, false);
    ops::moe_router_backward<float>(
        on_gpu, dlogits.g(), scores.g(), chosen.gpu.data<int32_t>(), sigmoid_weight.g(),
        every_dweight.g(), balance_gpu.data<double>(), lse.g(), 0, B, T, E, K, sigmoid, 2.5, false);
    expect_pair_close("dlogits", dlogits, 1e-6);
  }
}

// SwiGLU over gates far into both tails of the sigmoid; rows of 300 columns (not a multiple of
// the CPU's vector widths).
TEST_F(CudaKernelsTest, SwiGluMatchesCpuAndRepeats) {
  const int64_t N = 37, H = 300;
  Pair h = random_pair(N * 2 * H, 160, -12.0, 12.0), out = pair_of(std::vector<float>(N * H));
  ops::swiglu_forward<float>(on_cpu, out.h(), h.h(), N, H);
  ops::swiglu_forward<float>(on_gpu, out.g(), h.g(), N, H);
  expect_pair_close("out", out);
  Pair dout = random_pair(N * H, 161), dh = pair_of(std::vector<float>(N * 2 * H));
  ops::swiglu_backward<float>(on_cpu, dh.h(), dout.h(), h.h(), N, H);
  ops::swiglu_backward<float>(on_gpu, dh.g(), dout.g(), h.g(), N, H);
  expect_pair_close("dh", dh);
  const std::vector<float> first_out = out.from_gpu(), first_dh = dh.from_gpu();
  ops::swiglu_forward<float>(on_gpu, out.g(), h.g(), N, H);
  ops::swiglu_backward<float>(on_gpu, dh.g(), dout.g(), h.g(), N, H);
  EXPECT_TRUE(bitwise_equal(out.from_gpu(), first_out)) << "out not reproducible";
  EXPECT_TRUE(bitwise_equal(dh.from_gpu(), first_dh)) << "dh not reproducible";
}

// n values rounded to `dtype` (bf16 or f16) on GPU 0, and the same values widened back, in fp32
// on GPU 0: the input of a 16-bit kernel and of the fp32 kernel it must agree with.
struct Rounded {
  Tensor bits;
  Pair values;
};
Rounded rounded_on_gpu(const std::vector<float>& v, DType dtype) {
  Tensor host = Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(dtype);
  Rounded r{host.to(Device::cuda(0)), {}};
  r.values = pair_of(widened(r.bits));
  return r;
}

// Each value rounded to `dtype` (bf16 or f16) and widened back.
std::vector<float> rounded_to(std::vector<float> v, DType dtype) {
  for (float& x : v)
    x = dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
  return v;
}

// GeGLU (Gemma's gated tanh GELU) likewise near the CPU's, and its 16-bit kernels at bf16 bit for
// bit the fp32 kernel on the same widened values, rounded once.
TEST_F(CudaKernelsTest, GeGluMatchesCpuAndItsSixteenBitKernelsRoundOnce) {
  const int64_t N = 37, H = 300;
  const GatedActivation geglu = GatedActivation::kGeluTanh;
  Pair h = random_pair(N * 2 * H, 170, -12.0, 12.0), out = pair_of(std::vector<float>(N * H));
  ops::swiglu_forward<float>(on_cpu, out.h(), h.h(), N, H, geglu);
  ops::swiglu_forward<float>(on_gpu, out.g(), h.g(), N, H, geglu);
  expect_pair_close("out", out);
  Pair dout = random_pair(N * H, 171), dh = pair_of(std::vector<float>(N * 2 * H));
  ops::swiglu_backward<float>(on_cpu, dh.h(), dout.h(), h.h(), N, H, geglu);
  ops::swiglu_backward<float>(on_gpu, dh.g(), dout.g(), h.g(), N, H, geglu);
  expect_pair_close("dh", dh);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  ops::set_matmul_precision("bf16");
  const Rounded h16 = rounded_on_gpu(random_floats(N * 2 * H, 172, -12.0, 12.0), DType::kBF16);
  const Rounded d16 = rounded_on_gpu(random_floats(N * H, 173), DType::kBF16);
  Tensor out16 = Tensor::empty({N * H}, DType::kBF16, Device::cuda(0));
  Tensor dh16 = Tensor::empty({N * 2 * H}, DType::kBF16, Device::cuda(0));
  ops::swiglu_forward_rounded(on_gpu, out16.raw(), h16.bits.raw(), DType::kBF16, N, H, geglu);
  ops::swiglu_backward_rounded(on_gpu, dh16.raw(), d16.bits.raw(), h16.bits.raw(), DType::kBF16, N,
                               H, geglu);
  Pair out32 = pair_of(std::vector<float>(N * H)), dh32 = pair_of(std::vector<float>(N * 2 * H));
  ops::swiglu_forward<float>(on_gpu, out32.g(), h16.values.g(), N, H, geglu);
  ops::swiglu_backward<float>(on_gpu, dh32.g(), d16.values.g(), h16.values.g(), N, H, geglu);
  EXPECT_TRUE(bitwise_equal(widened(out16), rounded_to(out32.from_gpu(), DType::kBF16))) << "out";
  EXPECT_TRUE(bitwise_equal(widened(dh16), rounded_to(dh32.from_gpu(), DType::kBF16))) << "dh";
}

// Llama's element-wise kernels on 16-bit activations (a GPU at bf16 / fp16 matmul precision):
// RMSNorm writing its output as the next GEMM's operand, SwiGLU on the fc's 16-bit output and
// proj's 16-bit input gradient, the rotary embedding in place on a 16-bit qkv and its gradient.
// Each is bit for bit the fp32 kernel on the same (widened) values, its output rounded once; none
// runs where GEMM inputs stay fp32.
TEST_F(CudaKernelsTest, LlamaSixteenBitKernelsAreTheFp32KernelsRoundedOnce) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const Device gpu = Device::cuda(0);
  const int64_t N = 37, C = 100, H = 300, B = 2, T = 37, NH = 4, KV = 2, hd = 16;
  const int64_t n_qkv = B * T * (NH + 2 * KV) * hd;
  std::vector<float> table(T * hd);
  cpu::rope_table(table.data(), T, hd, 10000.0);
  Pair cs = pair_of(table);
  Pair x = random_pair(N * C, 200, -3.0, 5.0), w = random_pair(C, 201);
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    SCOPED_TRACE(dtype_name(dtype));
    cuda::set_matmul_precision(precision);
    // RMSNorm: the output rounded, rstd the fp32 kernel's.
    Pair y = pair_of(std::vector<float>(N * C)), rstd = pair_of(std::vector<float>(N)),
         rstd16 = pair_of(std::vector<float>(N));
    ops::rmsnorm_forward<float>(on_gpu, y.g(), rstd.g(), x.g(), w.g(), N, C, 1e-5);
    Tensor y16 = Tensor::empty({N * C}, dtype, gpu);
    ops::rmsnorm_forward_rounded(on_gpu, y16.raw(), dtype, rstd16.g(), x.g(), w.g(), N, C, 1e-5);
    EXPECT_TRUE(bitwise_equal(widened(y16), rounded_to(y.from_gpu(), dtype))) << "rmsnorm";
    EXPECT_TRUE(bitwise_equal(rstd16.from_gpu(), rstd.from_gpu())) << "rmsnorm rstd";

    // SwiGLU forward and backward, gates far into both tails of the sigmoid.
    const Rounded h = rounded_on_gpu(random_floats(N * 2 * H, 202, -12.0, 12.0), dtype);
    const Rounded dout = rounded_on_gpu(random_floats(N * H, 203), dtype);
    Pair a = pair_of(std::vector<float>(N * H)), dh = pair_of(std::vector<float>(N * 2 * H));
    ops::swiglu_forward<float>(on_gpu, a.g(), h.values.g(), N, H);
    ops::swiglu_backward<float>(on_gpu, dh.g(), dout.values.g(), h.values.g(), N, H);
    Tensor a16 = Tensor::empty({N * H}, dtype, gpu), dh16 = Tensor::empty({N * 2 * H}, dtype, gpu);
    ops::swiglu_forward_rounded(on_gpu, a16.raw(), h.bits.raw(), dtype, N, H);
    ops::swiglu_backward_rounded(on_gpu, dh16.raw(), dout.bits.raw(), h.bits.raw(), dtype, N, H);
    EXPECT_TRUE(bitwise_equal(widened(a16), rounded_to(a.from_gpu(), dtype))) << "swiglu";
    EXPECT_TRUE(bitwise_equal(widened(dh16), rounded_to(dh.from_gpu(), dtype))) << "swiglu dh";

    // The rotation in place, forward and back; the value heads come through bit for bit.
    Rounded qkv = rounded_on_gpu(random_floats(n_qkv, 204, -3.0, 3.0), dtype);
    const std::vector<float> qkv_before = widened(qkv.bits);
    ops::rope_forward<float>(on_gpu, qkv.values.g(), cs.g(), B, T, NH, KV, hd);
    ops::rope_forward_rounded(on_gpu, qkv.bits.raw(), dtype, cs.g(), B, T, NH, KV, hd);
    const std::vector<float> turned = widened(qkv.bits);
    EXPECT_TRUE(bitwise_equal(turned, rounded_to(qkv.values.from_gpu(), dtype))) << "rope";
    EXPECT_FALSE(bitwise_equal(turned, qkv_before)) << "nothing turned";
    Rounded dqkv = rounded_on_gpu(random_floats(n_qkv, 205), dtype);
    ops::rope_backward<float>(on_gpu, dqkv.values.g(), cs.g(), B, T, NH, KV, hd);
    ops::rope_backward_rounded(on_gpu, dqkv.bits.raw(), dtype, cs.g(), B, T, NH, KV, hd);
    EXPECT_TRUE(bitwise_equal(widened(dqkv.bits), rounded_to(dqkv.values.from_gpu(), dtype)))
        << "rope backward";
  }
  cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
  Tensor out16 = Tensor::empty({N * 2 * H}, DType::kBF16, gpu);
  expect_refused(
      [&] {
        ops::swiglu_forward_rounded(on_gpu, out16.raw(), out16.raw(), DType::kBF16, N, H);
      },
      "GEMM inputs are not rounded to 16 bits", "a 16-bit SwiGLU ran with fp32 GEMMs");
  expect_refused(
      [&] { ops::rope_forward_rounded(on_gpu, out16.raw(), DType::kBF16, cs.g(), 1, 1, 4, 2, 16); },
      "GEMM inputs are not rounded to 16 bits", "a 16-bit rotation ran with fp32 GEMMs");
}

// qkv (B·T, (NH + 2·KV)·hd) with the shared heads repeated: (B·T, 3·NH·hd).
std::vector<float> expand_heads(const std::vector<float>& qkv, int64_t BT, int64_t NH, int64_t KV,
                                int64_t hd) {
  const int64_t group = NH / KV, in_row = (NH + 2 * KV) * hd, C = NH * hd;
  std::vector<float> full(BT * 3 * C);
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        const float* in = qkv.data() + r * in_row;
        float* out = full.data() + r * 3 * C;
        out[h * hd + d] = in[h * hd + d];
        out[C + h * hd + d] = in[(NH + h / group) * hd + d];
        out[2 * C + h * hd + d] = in[(NH + KV + h / group) * hd + d];
      }
  return full;
}

// The compact gradient from the repeated heads' (B·T, 3·NH·hd): a query head's copied, a shared
// key or value head's the sum of its query heads', ascending, in fp32.
std::vector<float> reduce_heads(const std::vector<float>& dfull, int64_t BT, int64_t NH,
                                int64_t KV, int64_t hd) {
  const int64_t group = NH / KV, out_row = (NH + 2 * KV) * hd, C = NH * hd;
  std::vector<float> dqkv(BT * out_row);
  for (int64_t r = 0; r < BT; ++r) {
    const float* in = dfull.data() + r * 3 * C;
    float* out = dqkv.data() + r * out_row;
    for (int64_t j = 0; j < NH * hd; ++j) out[j] = in[j];
    for (int64_t part = 1; part <= 2; ++part)
      for (int64_t kv = 0; kv < KV; ++kv)
        for (int64_t d = 0; d < hd; ++d) {
          float acc = in[part * C + kv * group * hd + d];
          for (int64_t h = 1; h < group; ++h) acc += in[part * C + (kv * group + h) * hd + d];
          out[(NH + (part - 1) * KV + kv) * hd + d] = acc;
        }
  }
  return dqkv;
}

// Grouped-query attention at bf16 on the compact qkv (cuda::attention_gqa_*_rounded), its output
// and input gradient 16-bit: bit for bit the rounded attention on the heads repeated, the
// repeated gradient summed back in fp32 and rounded once — with head size 64 and 128 on the flash
// kernels from a bf16 qkv and dO (which read the shared heads in place: there the shared heads'
// gradients to a bf16 rounding step), with head size 16 on the batched GEMMs from fp32 ones —
// and within bf16's rounding of the fp32 CPU. KV = NH is the plain attention on qkv itself.
TEST_F(CudaKernelsTest, AttentionGqaWritesItsOutputAndGradientRoundedForTheProjections) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  const Device gpu = Device::cuda(0);
  const int64_t B = 2, T = 37, NH = 4;
  using Shape2 = std::pair<int64_t, int64_t>;  // head size, key/value heads
  for (const auto& [hd, KV] :
       {Shape2{64, 2}, Shape2{64, 4}, Shape2{128, 2}, Shape2{16, 2}, Shape2{16, 1}}) {
    SCOPED_TRACE("hd=" + std::to_string(hd) + " KV=" + std::to_string(KV));
    const int64_t C = NH * hd, BT = B * T, n_in = BT * (NH + 2 * KV) * hd;
    const bool flash = ops::attention_takes_rounded_qkv(on_gpu, C, NH, B);
    ASSERT_EQ(flash, hd != 16);
    const DType qkv_dtype = flash ? DType::kBF16 : DType::kF32;
    // qkv and dO as the projections write them: bf16 for the flash kernels, else fp32.
    const Rounded qkv16 = rounded_on_gpu(random_floats(n_in, 210 + hd, -2.0, 2.0), DType::kBF16);
    const Rounded dout16 = rounded_on_gpu(random_floats(BT * C, 211 + hd), DType::kBF16);
    const Tensor& qkv = flash ? qkv16.bits : qkv16.values.gpu;
    const Tensor& dout = flash ? dout16.bits : dout16.values.gpu;
    Tensor out = Tensor::empty({BT * C}, DType::kBF16, gpu),
           dqkv = Tensor::empty({n_in}, DType::kBF16, gpu);
    Pair lse = pair_of(std::vector<float>(B * NH * T));
    ops::attention_gqa_forward_rounded(on_gpu, out.raw(), DType::kBF16, lse.g(), qkv.raw(),
                                       qkv_dtype, B, T, NH, KV, hd);
    ops::attention_gqa_backward_rounded(on_gpu, dqkv.raw(), dout.raw(), dout.dtype(), qkv.raw(),
                                        qkv_dtype, out.raw(), DType::kBF16, lse.g(), B, T, NH, KV,
                                        hd);
    // The same on the repeated heads (fp32 values: the flash kernels round them as they load).
    Pair full = pair_of(expand_heads(widened(qkv16.bits), BT, NH, KV, hd));
    Tensor out_ref = Tensor::empty({BT * C}, DType::kBF16, gpu),
           dfull = Tensor::empty({BT * 3 * C}, DType::kBF16, gpu);
    Pair lse_ref = pair_of(std::vector<float>(B * NH * T));
    ops::attention_forward_rounded(on_gpu, out_ref.raw(), DType::kBF16, lse_ref.g(), full.g(),
                                   DType::kF32, B, T, C, NH);
    ops::attention_backward_rounded(on_gpu, dfull.raw(), dout16.values.g(), DType::kF32, full.g(),
                                    DType::kF32, out_ref.raw(), DType::kBF16, lse_ref.g(), B, T, C,
                                    NH);
    EXPECT_TRUE(bitwise_equal(widened(out), widened(out_ref))) << "out";
    EXPECT_TRUE(bitwise_equal(lse.from_gpu(), lse_ref.from_gpu())) << "lse";
    const std::vector<float> got = widened(dqkv);
    const std::vector<float> want =
        rounded_to(reduce_heads(widened(dfull), BT, NH, KV, hd), DType::kBF16);
    if (flash && KV != NH) {
      // The flash kernels read the shared heads in place and sum a shared head's gradient in
      // their accumulators, rounding once (the reference rounds each query head's part, then
      // the sum): dQ bit for bit, dK and dV to a bf16 rounding step of their scale.
      const int64_t row = (NH + 2 * KV) * hd;
      std::vector<float> dq_got, dq_want, dkv_got, dkv_want;
      for (int64_t i = 0; i < n_in; ++i) {
        const bool query = i % row < NH * hd;
        (query ? dq_got : dkv_got).push_back(got[i]);
        (query ? dq_want : dkv_want).push_back(want[i]);
      }
      EXPECT_TRUE(bitwise_equal(dq_got, dq_want)) << "dQ";
      expect_close("dK, dV", dkv_got, dkv_want, 1e-2);
    } else {
      EXPECT_TRUE(bitwise_equal(got, want)) << "dqkv";
    }
    // Near the fp32 CPU's attention on the same values.
    std::vector<float> out_cpu(BT * C), lse_cpu(B * NH * T), dfull_cpu(BT * 3 * C);
    const std::vector<float> full_cpu = full.from_host(), dout_cpu = dout16.values.from_host();
    cpu::attention_forward(pool, out_cpu.data(), lse_cpu.data(), full_cpu.data(), B, T, C, NH);
    cpu::attention_backward(pool, dfull_cpu.data(), dout_cpu.data(), full_cpu.data(),
                            out_cpu.data(), lse_cpu.data(), B, T, C, NH);
    expect_close("out vs the CPU", widened(out), out_cpu, 1e-2);
    expect_close("dqkv vs the CPU", got, reduce_heads(dfull_cpu, BT, NH, KV, hd), 2e-2);
    const int64_t kv = KV, head = hd;  // (clang 14 lambdas cannot capture structured bindings)
    if (!flash && kv != NH)  // the expanding path reads fp32 only: a 16-bit qkv is refused
      expect_refused(
          [&] {
            ops::attention_gqa_forward_rounded(on_gpu, out.raw(), DType::kBF16, lse.g(),
                                               qkv16.bits.raw(), DType::kBF16, B, T, NH, kv, head);
          },
          "a 16-bit qkv needs the flash kernels", "a bf16 qkv was expanded without them");
  }
}

// A model without a position table (wpe, dwpe null): the token rows, bit for bit the CPU's, and
// dwte what it is with a table; the same for the vocabulary-shard kernels.
TEST_F(CudaKernelsTest, EmbeddingWithoutAPositionTableMatchesCpu) {
  const int64_t B = 3, T = 17, C = 40, V = 200;
  IdPair tokens = ids_pair(random_ids(B * T, static_cast<int32_t>(V), 170));
  Pair wte = random_pair(V * C, 171), out = pair_of(std::vector<float>(B * T * C));
  ops::embedding_forward<float>(on_cpu, out.h(), tokens.host.data<int32_t>(), wte.h(), nullptr, B,
                                T, C, V);
  ops::embedding_forward<float>(on_gpu, out.g(), tokens.gpu.data<int32_t>(), wte.g(), nullptr, B, T,
                                C, V);
  EXPECT_TRUE(bitwise_equal(out.from_gpu(), out.from_host())) << "forward";
  const std::vector<float> rows = out.from_host();
  const std::vector<float> table = wte.from_host();
  const auto* ids = tokens.host.data<int32_t>();
  EXPECT_TRUE(std::equal(rows.begin(), rows.begin() + C, table.begin() + ids[0] * C))
      << "not the token's row";

  Pair dout = random_pair(B * T * C, 172);
  const std::vector<float> dwte0 = random_floats(V * C, 173);
  Pair without = pair_of(dwte0), with = pair_of(dwte0), dwpe = pair_of(std::vector<float>(T * C));
  ops::embedding_backward<float>(on_cpu, without.h(), nullptr, dout.h(), ids, B, T, C);
  ops::embedding_backward<float>(on_gpu, without.g(), nullptr, dout.g(), tokens.gpu.data<int32_t>(),
                                 B, T, C);
  ops::embedding_backward<float>(on_gpu, with.g(), dwpe.g(), dout.g(), tokens.gpu.data<int32_t>(),
                                 B, T, C);
  expect_pair_close("dwte", without);
  EXPECT_TRUE(bitwise_equal(without.from_gpu(), with.from_gpu())) << "dwte";

  const VocabShard shard{40, 30, 34, V};
  Pair shard_wte = random_pair(shard.rows * C, 174),
       shard_out = pair_of(std::vector<float>(B * T * C));
  ops::vocab_shard_embedding_forward<float>(on_cpu, shard_out.h(), ids, shard_wte.h(), nullptr,
                                            B * T, T, C, shard, true);
  ops::vocab_shard_embedding_forward<float>(on_gpu, shard_out.g(), tokens.gpu.data<int32_t>(),
                                            shard_wte.g(), nullptr, B * T, T, C, shard, true);
  EXPECT_TRUE(bitwise_equal(shard_out.from_gpu(), shard_out.from_host())) << "shard forward";
  Pair shard_dwte = random_pair(shard.rows * C, 175);
  ops::vocab_shard_embedding_backward<float>(on_cpu, shard_dwte.h(), nullptr, dout.h(), ids, B * T,
                                             T, C, shard);
  ops::vocab_shard_embedding_backward<float>(on_gpu, shard_dwte.g(), nullptr, dout.g(),
                                             tokens.gpu.data<int32_t>(), B * T, T, C, shard);
  EXPECT_TRUE(bitwise_equal(shard_dwte.from_gpu(), shard_dwte.from_host())) << "shard dwte";
}

// Positions reset at each document (data.reset_position_ids): the places in their documents, of
// whole sequences and of a context-parallel shard's positions, exactly the CPU's; the position
// rows they read added bit for bit as on the CPU; their gradient (embedding_backward with the ids
// as tokens) the CPU's to rounding, and the same bits when run again.
// A sliding window raising each query's first visible position (ops::window_starts, nn/
// sliding_window.h): alone and over documents, exactly the CPU's values, which are the window's.
TEST_F(CudaKernelsTest, WindowStartsMatchCpu) {
  const int64_t B = 2, T = 29, W = 6;
  std::vector<int32_t> starts(B * T);
  for (int64_t i = 0; i < B * T; ++i) starts[i] = static_cast<int32_t>(i % T / 10 * 10);
  IdPair docs = ids_pair(starts);
  for (const bool documents : {false, true}) {
    SCOPED_TRACE(documents ? "over documents" : "alone");
    IdPair out = ids_pair(std::vector<int32_t>(B * T, -1));
    const int32_t* host_docs = documents ? docs.host.data<int32_t>() : nullptr;
    const int32_t* gpu_docs = documents ? docs.gpu.data<int32_t>() : nullptr;
    ops::window_starts(on_cpu, out.host.data<int32_t>(), host_docs, B, T, W);
    ops::window_starts(on_gpu, out.gpu.data<int32_t>(), gpu_docs, B, T, W);
    const Tensor back = out.gpu.to(Device::cpu());
    ASSERT_TRUE(
        std::equal(back.data<int32_t>(), back.data<int32_t>() + B * T, out.host.data<int32_t>()));
    for (int64_t t = 0; t < T; ++t) {  // max(document start, t − W + 1)
      const int32_t want =
          std::max<int32_t>(documents ? starts[t] : 0, static_cast<int32_t>(t - W + 1));
      EXPECT_EQ(out.host.data<int32_t>()[T + t], want) << "t " << t;
    }
  }
}

TEST_F(CudaKernelsTest, DocumentPositionsAndTheirRowsMatchCpu) {
  const int64_t B = 3, T = 37, C = 40;
  std::vector<int32_t> starts(B * T);
  const std::vector<int32_t> ends = random_ids(B * T, 5, 180);  // a document ends where 0
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      starts[b * T + t] = start;
      if (ends[b * T + t] == 0) start = static_cast<int32_t>(t + 1);
    }
  }
  IdPair docs = ids_pair(starts);
  std::vector<int32_t> shard_positions;  // load-balanced cp's halves of two chunks
  for (int64_t t = 0; t < 9; ++t) shard_positions.push_back(static_cast<int32_t>(t));
  for (int64_t t = 28; t < T; ++t) shard_positions.push_back(static_cast<int32_t>(t));
  IdPair global = ids_pair(shard_positions);
  for (const bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "a shard's positions" : "whole sequences");
    const int64_t Tl = shard ? static_cast<int64_t>(shard_positions.size()) : T;
    IdPair ids = ids_pair(std::vector<int32_t>(B * Tl, -1));
    ops::document_positions(on_cpu, ids.host.data<int32_t>(), docs.host.data<int32_t>(),
                            shard ? global.host.data<int32_t>() : nullptr, B, Tl, T);
    ops::document_positions(on_gpu, ids.gpu.data<int32_t>(), docs.gpu.data<int32_t>(),
                            shard ? global.gpu.data<int32_t>() : nullptr, B, Tl, T);
    const Tensor back = ids.gpu.to(Device::cpu());
    ASSERT_TRUE(
        std::equal(back.data<int32_t>(), back.data<int32_t>() + B * Tl, ids.host.data<int32_t>()));
    ASSERT_LT(*std::max_element(ids.host.data<int32_t>(), ids.host.data<int32_t>() + B * Tl), T);

    Pair wpe = random_pair(T * C, 181), out = random_pair(B * Tl * C, 182);
    ops::add_rows_by_id<float>(on_cpu, out.h(), wpe.h(), ids.host.data<int32_t>(), B * Tl, C);
    ops::add_rows_by_id<float>(on_gpu, out.g(), wpe.g(), ids.gpu.data<int32_t>(), B * Tl, C);
    EXPECT_TRUE(bitwise_equal(out.from_gpu(), out.from_host())) << "rows added";
    Pair dout = random_pair(B * Tl * C, 183), dwpe = random_pair(T * C, 184);
    const std::vector<float> dwpe0 = dwpe.from_gpu();
    ops::embedding_backward<float>(on_cpu, dwpe.h(), nullptr, dout.h(), ids.host.data<int32_t>(), 1,
                                   B * Tl, C);
    ops::embedding_backward<float>(on_gpu, dwpe.g(), nullptr, dout.g(), ids.gpu.data<int32_t>(), 1,
                                   B * Tl, C);
    expect_pair_close("dwpe", dwpe);
    const std::vector<float> once = dwpe.from_gpu();
    dwpe.gpu.copy_from(Tensor::from_vector(dwpe0, {T * C}));
    ops::embedding_backward<float>(on_gpu, dwpe.g(), nullptr, dout.g(), ids.gpu.data<int32_t>(), 1,
                                   B * Tl, C);
    EXPECT_TRUE(bitwise_equal(dwpe.from_gpu(), once)) << "dwpe not reproducible";
  }
}

TEST_F(CudaKernelsTest, EmbeddingMatchesCpuAndRefusesBadTokens) {
  const int64_t B = 3, T = 17, C = 40, V = 200;
  std::vector<int32_t> ids = random_ids(B * T, static_cast<int32_t>(V), 50);
  ids[5] = ids[9] = ids[30] = 7;  // repeated tokens: their gradient rows add up
  IdPair tokens = ids_pair(ids);
  Pair wte = random_pair(V * C, 51), wpe = random_pair(T * C, 52);
  Pair out = pair_of(std::vector<float>(B * T * C));
  ops::embedding_forward<float>(on_cpu, out.h(), tokens.host.data<int32_t>(), wte.h(), wpe.h(), B,
                                T, C, V);
  ops::embedding_forward<float>(on_gpu, out.g(), tokens.gpu.data<int32_t>(), wte.g(), wpe.g(), B, T,
                                C, V);
  EXPECT_TRUE(bitwise_equal(out.from_gpu(), out.from_host())) << "one rounding each side";

  Pair dout = random_pair(B * T * C, 53), dwte = random_pair(V * C, 54),
       dwpe = random_pair(T * C, 55);
  const std::vector<float> dwte0 = dwte.from_gpu();
  ops::embedding_backward<float>(on_cpu, dwte.h(), dwpe.h(), dout.h(), tokens.host.data<int32_t>(),
                                 B, T, C);
  ops::embedding_backward<float>(on_gpu, dwte.g(), dwpe.g(), dout.g(), tokens.gpu.data<int32_t>(),
                                 B, T, C);
  expect_pair_close("dwte", dwte);
  expect_pair_close("dwpe", dwpe);
  const std::vector<float> once = dwte.from_gpu();
  dwte.gpu.copy_from(Tensor::from_vector(dwte0, {V * C}));
  ops::embedding_backward<float>(on_gpu, dwte.g(), dwpe.g(), dout.g(), tokens.gpu.data<int32_t>(),
                                 B, T, C);
  EXPECT_TRUE(bitwise_equal(dwte.from_gpu(), once)) << "dwte not reproducible";

  ids[B * T - 2] = static_cast<int32_t>(V);
  IdPair bad = ids_pair(ids);
  expect_refused(
      [&] {
        ops::embedding_forward<float>(on_gpu, out.g(), bad.gpu.data<int32_t>(), wte.g(), wpe.g(), B,
                                      T, C, V);
      },
      "token id 200 at batch 2, position 15", "a token outside the vocabulary was accepted");
}

// The dwte walk reads four token ids at a time where B·T is a multiple of 4 and the ids are
// 16-byte aligned: the same additions in the same order as one id at a time (the same ids one int
// past an aligned start), bit for bit; and the CPU's result to rounding.
TEST_F(CudaKernelsTest, EmbeddingBackwardTakesTokensFourAtATimeInTheSameOrder) {
  const int64_t B = 4, T = 17, C = 40, V = 50;  // a small vocabulary: ids repeat often
  const std::vector<int32_t> ids = random_ids(B * T, static_cast<int32_t>(V), 56);
  std::vector<int32_t> shifted(ids.size() + 1, 0);
  std::copy(ids.begin(), ids.end(), shifted.begin() + 1);
  IdPair aligned = ids_pair(ids), offset = ids_pair(shifted);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(aligned.gpu.data<int32_t>()) % 16, 0u);
  Pair dout = random_pair(B * T * C, 57);
  const std::vector<float> dwte0 = random_floats(V * C, 58), dwpe0 = random_floats(T * C, 59);
  Pair four = pair_of(dwte0), one = pair_of(dwte0), dwpe_four = pair_of(dwpe0),
       dwpe_one = pair_of(dwpe0);
  ops::embedding_backward<float>(on_gpu, four.g(), dwpe_four.g(), dout.g(),
                                 aligned.gpu.data<int32_t>(), B, T, C);
  ops::embedding_backward<float>(on_gpu, one.g(), dwpe_one.g(), dout.g(),
                                 offset.gpu.data<int32_t>() + 1, B, T, C);
  EXPECT_TRUE(bitwise_equal(four.from_gpu(), one.from_gpu())) << "dwte";
  ops::embedding_backward<float>(on_cpu, four.h(), dwpe_four.h(), dout.h(),
                                 aligned.host.data<int32_t>(), B, T, C);
  expect_pair_close("dwte", four);
}

// Context parallelism's attention of some query rows (cuda::attention_gqa_*_rows) against the
// CPU's on random inputs: a rank's zigzag rows (two ranges, the second crossing 64-row blocks),
// grouped-query heads, q apart from the keys and values; out, lse, dq and dkv within fp32
// rounding; dkv overwritten wholly (rows past the last key seen: zero); bit for bit on a rerun.
TEST_F(CudaKernelsTest, AttentionOfSomeQueryRowsMatchesCpuAndRepeats) {
  for (const auto& [NH, KV] : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}}) {
    SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV));
    const int64_t B = 2, T = 96, hd = 8, C = NH * hd, W = (NH + 2 * KV) * hd, kvw = 2 * KV * hd;
    const std::vector<cpu::RowRange> rows = {{12, 24}, {60, 84}};  // not the last position
    const int64_t Tq = cpu::rows_in(rows);
    Pair q = random_pair(B * Tq * W, 41, -2.0, 2.0), kv = random_pair(B * T * kvw, 42, -2.0, 2.0);
    Pair dout = random_pair(B * Tq * C, 43);
    Pair out = pair_of(std::vector<float>(B * Tq * C)),
         lse = pair_of(std::vector<float>(B * NH * Tq));
    ops::attention_gqa_forward_rows<float>(on_cpu, out.h(), lse.h(), q.h(), W, kv.h(), kvw, B, T,
                                           NH, KV, hd, rows);
    ops::attention_gqa_forward_rows<float>(on_gpu, out.g(), lse.g(), q.g(), W, kv.g(), kvw, B, T,
                                           NH, KV, hd, rows);
    expect_pair_close("out", out, kTol);
    expect_pair_close("lse", lse, kTol);
    // dq compact (B, Tq, C); dkv overwritten (7: nothing left of it).
    Pair dq = pair_of(std::vector<float>(B * Tq * C)),
         dkv = pair_of(std::vector<float>(B * T * kvw, 7.0f));
    ops::attention_gqa_backward_rows<float>(on_cpu, dq.h(), C, dkv.h(), dout.h(), q.h(), W, kv.h(),
                                            kvw, out.h(), lse.h(), B, T, NH, KV, hd, rows);
    ops::attention_gqa_backward_rows<float>(on_gpu, dq.g(), C, dkv.g(), dout.g(), q.g(), W, kv.g(),
                                            kvw, out.g(), lse.g(), B, T, NH, KV, hd, rows);
    expect_pair_close("dq", dq, kTol);
    expect_pair_close("dkv", dkv, kTol);
    {
      // Scores cut into pieces of a few rows (as a long sequence's are): the same values.
      const int64_t budget = cuda::attention_score_bytes();
      cuda::set_attention_score_bytes(4 * B * NH * 96 * 5);  // the second range 5 rows a piece
      Pair o = pair_of(std::vector<float>(B * Tq * C)), l = pair_of(std::vector<float>(B * NH * Tq));
      Pair pq = pair_of(std::vector<float>(B * Tq * C)), pkv = pair_of(std::vector<float>(B * T * kvw));
      ops::attention_gqa_forward_rows<float>(on_gpu, o.g(), l.g(), q.g(), W, kv.g(), kvw, B, T, NH,
                                             KV, hd, rows);
      ops::attention_gqa_backward_rows<float>(on_gpu, pq.g(), C, pkv.g(), dout.g(), q.g(), W,
                                              kv.g(), kvw, o.g(), l.g(), B, T, NH, KV, hd, rows);
      cuda::set_attention_score_bytes(budget);
      expect_close("out (pieces)", o.from_gpu(), out.from_host(), kTol);
      expect_close("lse (pieces)", l.from_gpu(), lse.from_host(), kTol);
      expect_close("dq (pieces)", pq.from_gpu(), dq.from_host(), kTol);
      expect_close("dkv (pieces)", pkv.from_gpu(), dkv.from_host(), kTol);
    }
    const std::vector<float> g = dkv.from_gpu();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 84; t < T; ++t)
        for (int64_t c = 0; c < kvw; ++c)
          ASSERT_EQ(g[(b * T + t) * kvw + c], 0.0f) << "dkv past the last key, t " << t;
    const std::vector<float> first_out = out.from_gpu(), first_dkv = dkv.from_gpu();
    ops::attention_gqa_forward_rows<float>(on_gpu, out.g(), lse.g(), q.g(), W, kv.g(), kvw, B, T,
                                           NH, KV, hd, rows);
    ops::attention_gqa_backward_rows<float>(on_gpu, dq.g(), C, dkv.g(), dout.g(), q.g(), W, kv.g(),
                                            kvw, out.g(), lse.g(), B, T, NH, KV, hd, rows);
    EXPECT_TRUE(bitwise_equal(out.from_gpu(), first_out)) << "out not reproducible";
    EXPECT_TRUE(bitwise_equal(dkv.from_gpu(), first_dkv)) << "dkv not reproducible";
  }
  // The keys and values of a qkv's rows, column by column.
  Pair qkv = random_pair(10 * 12, 44), kv = pair_of(std::vector<float>(10 * 8));
  ops::copy_columns<float>(on_cpu, kv.h(), 8, qkv.h() + 4, 12, 10, 8);
  ops::copy_columns<float>(on_gpu, kv.g(), 8, qkv.g() + 4, 12, 10, 8);
  EXPECT_TRUE(bitwise_equal(kv.from_gpu(), kv.from_host()));
  EXPECT_EQ(kv.from_host()[8], qkv.from_host()[12 + 4]);
  // The same of 16-bit values (a bf16 qkv, as the projection writes it for the flash kernels):
  // rounding then copying is copying then rounding.
  Tensor qkv16 = Tensor::empty({10, 12}, DType::kBF16, Device::cuda(0)),
         kv16 = Tensor::empty({10, 8}, DType::kBF16, Device::cuda(0)),
         want16 = Tensor::empty({10, 8}, DType::kBF16, Device::cuda(0));
  ops::round_to_bf16(on_gpu, qkv16.data_u16(), qkv.g(), 10 * 12);
  ops::copy_columns_16(on_gpu, kv16.raw(), 8, qkv16.data_u16() + 4, 12, 10, 8);
  ops::copy_columns_to_bf16(on_gpu, want16.raw(), 8, qkv.g() + 4, 12, 10, 8);
  EXPECT_EQ(widened(kv16), widened(want16));
}

// Context parallelism at bf16 with head size 64 or 128: the flash kernels compute a rank's query
// rows at their positions. Each rank's out, lse and dQ rows are bit for bit the whole sequence's
// flash attention's rows (a row walks the same key tiles; the tiles its mask hides add exact
// zeros), the ranks' dK/dV shares sum to the whole sequence's dK/dV to fp32 rounding, and all of
// it is within bf16's rounding of the CPU's rows kernels; keys after every query get zero
// gradients. Zigzag chunks of cp 2, 3 and 4, grouped-query heads, and rows of odd lengths.
TEST_F(CudaKernelsTest, FlashAttentionOfSomeQueryRowsIsTheWholeSequencesRows) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  struct Case {
    int64_t NH, KV, hd, T, cp;
  };
  for (const Case& c : {Case{4, 2, 64, 160, 2}, Case{2, 1, 128, 96, 3}, Case{2, 2, 64, 64, 4}}) {
    const int64_t B = 2, NH = c.NH, KV = c.KV, hd = c.hd, T = c.T, C = NH * hd;
    const int64_t W = (NH + 2 * KV) * hd, kvw = 2 * KV * hd;
    SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV) +
                 " hd=" + std::to_string(hd) + " cp=" + std::to_string(c.cp));
    // The whole sequence's flash attention.
    Pair qkv = random_pair(B * T * W, 300 + hd, -2.0, 2.0), dout = random_pair(B * T * C, 301);
    Pair out = pair_of(std::vector<float>(B * T * C)), lse = pair_of(std::vector<float>(B * NH * T));
    Pair dqkv = pair_of(std::vector<float>(B * T * W));
    ASSERT_TRUE(cuda::attention_takes_rounded_qkv(C, NH, B)) << "the flash kernels do not apply";
    cuda::attention_gqa_forward(0, out.g(), lse.g(), qkv.g(), B, T, NH, KV, hd);
    cuda::attention_gqa_backward(0, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, NH, KV,
                                 hd);
    // ... and with its output in bf16, as one GPU's training path writes it.
    Tensor out16 = Tensor::empty({B * T, C}, DType::kBF16, Device::cuda(0));
    Pair lse16 = pair_of(std::vector<float>(B * NH * T));
    cuda::flash_attention_forward_bf16_out(0, out16.raw(), lse16.g(), qkv.g(), false, B, T, C, NH,
                                           KV);
    const std::vector<float> whole_bf16 = widened(out16);
    const std::vector<float> all = qkv.from_host(), dy = dout.from_host(), o = out.from_gpu(),
                             l = lse.from_gpu(), g = dqkv.from_gpu();
    std::vector<float> kv_rows(B * T * kvw);  // every position's keys and values
    for (int64_t bt = 0; bt < B * T; ++bt)
      std::copy_n(all.begin() + bt * W + C, kvw, kv_rows.begin() + bt * kvw);
    Pair kv = pair_of(kv_rows);

    const auto rows_of = [&](const std::vector<float>& v, int64_t width, int64_t from, int64_t n,
                             const std::vector<cpu::RowRange>& rows) {
      return rows_at(v, B, T, width, from, n, rows);
    };
    // lse's rows: (B·NH, T) → (B·NH, rows).
    const auto lse_rows = [&](const std::vector<cpu::RowRange>& rows) {
      std::vector<float> picked;
      for (int64_t bh = 0; bh < B * NH; ++bh)
        for (const cpu::RowRange& r : rows)
          picked.insert(picked.end(), l.begin() + bh * T + r.begin, l.begin() + bh * T + r.end);
      return picked;
    };
    // One rank's rows: checked against the whole sequence's and the CPU's; returns its dK/dV.
    const auto rank = [&](const std::vector<cpu::RowRange>& rows) {
      const int64_t Tq = cpu::rows_in(rows);
      EXPECT_TRUE(cuda::flash_attention_applies_to_rows(NH, hd, B, rows));
      Pair q = pair_of(rows_of(all, W, 0, C, rows)), dy_r = pair_of(rows_of(dy, C, 0, C, rows));
      Pair o_r = pair_of(std::vector<float>(B * Tq * C)),
           l_r = pair_of(std::vector<float>(B * NH * Tq));
      ops::attention_gqa_forward_rows<float>(on_gpu, o_r.g(), l_r.g(), q.g(), C, kv.g(), kvw, B,
                                             T, NH, KV, hd, rows);
      ops::attention_gqa_forward_rows<float>(on_cpu, o_r.h(), l_r.h(), q.h(), C, kv.h(), kvw, B,
                                             T, NH, KV, hd, rows);
      EXPECT_TRUE(bitwise_equal(o_r.from_gpu(), rows_of(o, C, 0, C, rows))) << "out";
      EXPECT_TRUE(bitwise_equal(l_r.from_gpu(), lse_rows(rows))) << "lse";
      expect_pair_close("out against the CPU", o_r, 1e-2);
      expect_pair_close("lse against the CPU", l_r, 1e-2);
      // dq in every row of a (B, Tq, W) buffer as context parallelism's dqkv; dkv overwritten.
      Pair dq = pair_of(std::vector<float>(B * Tq * W, 5.0f)),
           dkv = pair_of(std::vector<float>(B * T * kvw, 7.0f));
      ops::attention_gqa_backward_rows<float>(on_gpu, dq.g(), W, dkv.g(), dy_r.g(), q.g(), C,
                                              kv.g(), kvw, o_r.g(), l_r.g(), B, T, NH, KV, hd,
                                              rows);
      ops::attention_gqa_backward_rows<float>(on_cpu, dq.h(), W, dkv.h(), dy_r.h(), q.h(), C,
                                              kv.h(), kvw, o_r.h(), l_r.h(), B, T, NH, KV, hd,
                                              rows);
      const std::vector<float> dq_g = dq.from_gpu();
      std::vector<float> dq_cols, rest;
      for (int64_t i = 0; i < B * Tq * W; ++i) (i % W < C ? dq_cols : rest).push_back(dq_g[i]);
      EXPECT_TRUE(bitwise_equal(dq_cols, rows_of(g, W, 0, C, rows))) << "dq";
      EXPECT_TRUE(std::all_of(rest.begin(), rest.end(), [](float x) { return x == 5.0f; }))
          << "dq wrote past its columns";
      expect_pair_close("dq against the CPU", dq, 2e-2);
      expect_pair_close("dkv against the CPU", dkv, 2e-2);
      const std::vector<float> share = dkv.from_gpu();
      {
        // q and kv kept in bf16 (rounded once, as the kernels round them when they load): the
        // same bits, from cp.async's path.
        EXPECT_TRUE(ops::attention_rows_take_bf16(on_gpu, NH, hd, B, rows));
        const Tensor q16 = bf16_copy(q, B * Tq, C), kv16 = bf16_copy(kv, B * T, kvw);
        Pair o16 = pair_of(std::vector<float>(B * Tq * C)),
             l16 = pair_of(std::vector<float>(B * NH * Tq));
        Pair dq16 = pair_of(std::vector<float>(B * Tq * W, 5.0f)),
             dkv16 = pair_of(std::vector<float>(B * T * kvw, 7.0f));
        ops::attention_gqa_forward_rows_bf16(on_gpu, o16.g(), DType::kF32, l16.g(), q16.raw(), C,
                                             kv16.raw(), kvw, B, T, NH, KV, hd, rows);
        ops::attention_gqa_backward_rows_bf16(on_gpu, dq16.g(), W, dkv16.g(), dy_r.g(), q16.raw(),
                                              C, kv16.raw(), kvw, o16.g(), DType::kF32, l16.g(), B,
                                              T, NH, KV, hd, rows);
        EXPECT_TRUE(bitwise_equal(o16.from_gpu(), o_r.from_gpu())) << "out, bf16 q and kv";
        // out written in bf16 (the projection's rounded input): the rows of the whole
        // sequence's bf16 output, bit for bit.
        Tensor out_bf16 = Tensor::empty({B * Tq, C}, DType::kBF16, Device::cuda(0));
        Pair l_b = pair_of(std::vector<float>(B * NH * Tq));
        ops::attention_gqa_forward_rows_bf16(on_gpu, out_bf16.raw(), DType::kBF16, l_b.g(),
                                             q16.raw(), C, kv16.raw(), kvw, B, T, NH, KV, hd, rows);
        EXPECT_TRUE(bitwise_equal(widened(out_bf16), rows_of(whole_bf16, C, 0, C, rows)))
            << "bf16 out";
        EXPECT_TRUE(bitwise_equal(l_b.from_gpu(), l_r.from_gpu())) << "lse, bf16 out";
        EXPECT_TRUE(bitwise_equal(l16.from_gpu(), l_r.from_gpu())) << "lse, bf16 q and kv";
        EXPECT_TRUE(bitwise_equal(dq16.from_gpu(), dq_g)) << "dq, bf16 q and kv";
        EXPECT_TRUE(bitwise_equal(dkv16.from_gpu(), share)) << "dkv, bf16 q and kv";
      }
      const int64_t last = rows.back().end;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = last; t < T; ++t)
          for (int64_t col = 0; col < kvw; ++col)
            EXPECT_EQ(share[(b * T + t) * kvw + col], 0.0f) << "dkv past the last query, t " << t;
      return share;
    };

    std::vector<float> summed(B * T * kvw, 0.0f);
    const int64_t chunk = T / (2 * c.cp);
    for (int64_t r = 0; r < c.cp; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const std::vector<float> share =
          rank({{r * chunk, (r + 1) * chunk}, {(2 * c.cp - 1 - r) * chunk, (2 * c.cp - r) * chunk}});
      for (size_t i = 0; i < summed.size(); ++i) summed[i] += share[i];
    }
    expect_close("the ranks' dK/dV summed against the whole sequence's", summed,
                 rows_of(g, W, C, kvw, {{0, T}}), 1e-5);
    // Rows of odd lengths, the last position not among them.
    rank({{5, 21}, {40, 41}, {T - 9, T - 6}});
  }
  std::vector<cpu::RowRange> nine;
  for (int64_t i = 0; i < 9; ++i) nine.push_back({2 * i, 2 * i + 1});
  EXPECT_FALSE(cuda::flash_attention_applies_to_rows(2, 64, 2, nine)) << "9 runs of rows";
  EXPECT_FALSE(ops::attention_rows_take_bf16(on_cpu, 2, 64, 2, nine)) << "on a CPU";
  cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
  const std::vector<cpu::RowRange> two = {{0, 4}, {12, 16}};
  EXPECT_FALSE(ops::attention_rows_take_bf16(on_gpu, 2, 64, 2, two)) << "at fp32";
  Pair o = pair_of(std::vector<float>(2 * 8 * 128)), l = pair_of(std::vector<float>(2 * 2 * 8));
  Tensor q16 = Tensor::empty({2 * 8, 128}, DType::kBF16, Device::cuda(0)),
         kv16 = Tensor::empty({2 * 16, 256}, DType::kBF16, Device::cuda(0));
  expect_refused(
      [&] {
        ops::attention_gqa_forward_rows_bf16(on_gpu, o.g(), DType::kF32, l.g(), q16.raw(), 128,
                                             kv16.raw(), 256, 2, 16, 2, 2, 64, two);
      },
      "bf16 queries and keys/values are for a GPU's flash kernels", "bf16 rows taken at fp32");
}

// Context parallelism's ring on a GPU (cuda::attention_gqa_*_rows with key runs, and
// attention_merge_rows) against the CPU's kernels on random inputs. Every rank of a zigzag cp 3
// takes every rank's block of keys and values as it would come round (its own first): per block
// out and lse (rows that see none of the block: 0 and -inf, as the CPU's), the merge, and with
// the merged result dq and dkv; the merged rows are within rounding of the whole sequence's rows
// and the blocks' dq sum to the whole sequence's. At fp32 on the batched-GEMM path (head sizes 8
// and 64) and at bf16 on the flash kernels (64 and 128; bf16 q and kv: the same bits).
TEST_F(CudaKernelsTest, RingBlocksOfKeysMatchTheCpuAndMergeIntoTheWholeRows) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  struct Case {
    cuda::MatmulPrecision precision;
    int64_t NH, KV, hd;
    double tol, grad_tol;
  };
  constexpr float kNoKey = -std::numeric_limits<float>::infinity();
  // lse compared with its -inf rows (a block none of whose keys a row sees) where the CPU's are.
  const auto expect_lse_close = [](const std::string& what, const std::vector<float>& got,
                                   const std::vector<float>& want, double tol) {
    ASSERT_EQ(got.size(), want.size());
    std::vector<float> g = got, w = want;
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_EQ(g[i] == kNoKey, w[i] == kNoKey) << what << "[" << i << "]: " << g[i] << " vs "
                                                << w[i];
      if (w[i] == kNoKey) g[i] = w[i] = 0.0f;
    }
    expect_close(what, g, w, tol);
  };
  for (const Case& c : {Case{cuda::MatmulPrecision::kFp32, 4, 2, 8, kTol, kTol},
                        Case{cuda::MatmulPrecision::kFp32, 2, 1, 64, kTol, kTol},
                        Case{cuda::MatmulPrecision::kBf16, 4, 2, 64, 1e-2, 2e-2},
                        Case{cuda::MatmulPrecision::kBf16, 2, 2, 128, 1e-2, 2e-2}}) {
    cuda::set_matmul_precision(c.precision);
    const bool flash = c.precision == cuda::MatmulPrecision::kBf16;
    const int64_t B = 2, cp = 3, chunk = 16, T = 2 * cp * chunk, NH = c.NH, KV = c.KV, hd = c.hd;
    const int64_t C = NH * hd, W = (NH + 2 * KV) * hd, kvw = 2 * KV * hd;
    SCOPED_TRACE("NH=" + std::to_string(NH) + " KV=" + std::to_string(KV) +
                 " hd=" + std::to_string(hd) + (flash ? " bf16" : " fp32"));
    const std::vector<float> all = random_floats(B * T * W, 400 + hd, -2.0, 2.0),
                             dy = random_floats(B * T * C, 401 + hd);
    const auto rows_of = [&](const std::vector<float>& v, int64_t width, int64_t from, int64_t n,
                             const std::vector<cpu::RowRange>& rows) {
      return rows_at(v, B, T, width, from, n, rows);
    };
    const auto positions = [&](int64_t r) {
      return std::vector<cpu::RowRange>{{r * chunk, (r + 1) * chunk},
                                        {(2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk}};
    };
    const std::vector<float> kv_all = rows_of(all, W, C, kvw, {{0, T}});
    for (int64_t r = 0; r < cp; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const std::vector<cpu::RowRange> rows = positions(r);
      const int64_t Tq = cpu::rows_in(rows);
      Pair q = pair_of(rows_of(all, W, 0, C, rows)), dout = pair_of(rows_of(dy, C, 0, C, rows));
      // The whole sequence's rows (the CPU's, every key gathered).
      std::vector<float> whole_out(B * Tq * C), whole_lse(B * NH * Tq), whole_dq(B * Tq * C),
          whole_dkv(B * T * kvw);
      ops::attention_gqa_forward_rows<float>(on_cpu, whole_out.data(), whole_lse.data(), q.h(), C,
                                             kv_all.data(), kvw, B, T, NH, KV, hd, rows);
      ops::attention_gqa_backward_rows<float>(on_cpu, whole_dq.data(), C, whole_dkv.data(),
                                              dout.h(), q.h(), C, kv_all.data(), kvw,
                                              whole_out.data(), whole_lse.data(), B, T, NH, KV,
                                              hd, rows);
      Pair out = pair_of(std::vector<float>(B * Tq * C)), lse = pair_of(std::vector<float>(B * NH * Tq));
      Pair part = pair_of(std::vector<float>(B * Tq * C)),
           part_lse = pair_of(std::vector<float>(B * NH * Tq));
      std::vector<Pair> blocks;
      for (int64_t s = 0; s < cp; ++s) {
        const std::vector<cpu::RowRange> keys = positions((r - s + cp) % cp);
        SCOPED_TRACE("block of positions from " + std::to_string(keys[0].begin));
        EXPECT_EQ(cuda::flash_attention_applies_to_rows(NH, hd, B, rows, keys), flash);
        const int64_t Tk = cpu::rows_in(keys);
        blocks.push_back(pair_of(rows_of(all, W, C, kvw, keys)));
        const Pair& kv = blocks.back();
        Pair& o = s == 0 ? out : part;
        Pair& l = s == 0 ? lse : part_lse;
        ops::attention_gqa_forward_rows<float>(on_cpu, o.h(), l.h(), q.h(), C, kv.h(), kvw, B, Tk,
                                               NH, KV, hd, rows, keys);
        ops::attention_gqa_forward_rows<float>(on_gpu, o.g(), l.g(), q.g(), C, kv.g(), kvw, B, Tk,
                                               NH, KV, hd, rows, keys);
        expect_pair_close("block out", o, c.tol);
        expect_lse_close("block lse", l.from_gpu(), l.from_host(), c.tol);
        if (s == 0) continue;
        ops::attention_merge_rows<float>(on_cpu, out.h(), lse.h(), part.h(), part_lse.h(), B, Tq,
                                         NH, hd);
        ops::attention_merge_rows<float>(on_gpu, out.g(), lse.g(), part.g(), part_lse.g(), B, Tq,
                                         NH, hd);
        expect_pair_close("merged out", out, c.tol);
        expect_lse_close("merged lse", lse.from_gpu(), lse.from_host(), c.tol);
      }
      expect_close("merged out against the whole sequence's rows", out.from_gpu(), whole_out,
                   c.tol);
      expect_close("merged lse against the whole sequence's rows", lse.from_gpu(), whole_lse,
                   c.tol);
      // The backward of each block with the merged result: dq summed over them.
      std::vector<float> dq_sum(B * Tq * C, 0.0f);
      for (int64_t s = 0; s < cp; ++s) {
        const std::vector<cpu::RowRange> keys = positions((r - s + cp) % cp);
        SCOPED_TRACE("backward, block of positions from " + std::to_string(keys[0].begin));
        const int64_t Tk = cpu::rows_in(keys);
        const Pair& kv = blocks[static_cast<size_t>(s)];
        Pair dq = pair_of(std::vector<float>(B * Tq * C)),
             dkv = pair_of(std::vector<float>(B * Tk * kvw, 7.0f));
        ops::attention_gqa_backward_rows<float>(on_cpu, dq.h(), C, dkv.h(), dout.h(), q.h(), C,
                                                kv.h(), kvw, out.h(), lse.h(), B, Tk, NH, KV, hd,
                                                rows, keys);
        ops::attention_gqa_backward_rows<float>(on_gpu, dq.g(), C, dkv.g(), dout.g(), q.g(), C,
                                                kv.g(), kvw, out.g(), lse.g(), B, Tk, NH, KV, hd,
                                                rows, keys);
        expect_pair_close("block dq", dq, c.grad_tol);
        expect_pair_close("block dkv", dkv, c.grad_tol);
        // This block's keys' share against the gathered attention's rows of them.
        expect_close("block dkv against the whole sequence's", dkv.from_gpu(),
                     rows_of(whole_dkv, kvw, 0, kvw, keys), c.grad_tol);
        const std::vector<float> g = dq.from_gpu();
        for (size_t i = 0; i < g.size(); ++i) dq_sum[i] += g[i];
        if (!flash) continue;
        // q and kv in bf16 (rounded once, as the flash kernels round them when they load them):
        // the same bits.
        EXPECT_TRUE(ops::attention_rows_take_bf16(on_gpu, NH, hd, B, rows, keys));
        const Tensor q16 = bf16_copy(q, B * Tq, C), kv16 = bf16_copy(kv, B * Tk, kvw);
        Pair o16 = pair_of(std::vector<float>(B * Tq * C)),
             l16 = pair_of(std::vector<float>(B * NH * Tq));
        Pair o32 = pair_of(std::vector<float>(B * Tq * C)),
             l32 = pair_of(std::vector<float>(B * NH * Tq));
        ops::attention_gqa_forward_rows_bf16(on_gpu, o16.g(), DType::kF32, l16.g(), q16.raw(), C,
                                             kv16.raw(), kvw, B, Tk, NH, KV, hd, rows, keys);
        ops::attention_gqa_forward_rows<float>(on_gpu, o32.g(), l32.g(), q.g(), C, kv.g(), kvw, B,
                                               Tk, NH, KV, hd, rows, keys);
        EXPECT_TRUE(bitwise_equal(o16.from_gpu(), o32.from_gpu())) << "out, bf16 q and kv";
        EXPECT_TRUE(bitwise_equal(l16.from_gpu(), l32.from_gpu())) << "lse, bf16 q and kv";
        Pair dq16 = pair_of(std::vector<float>(B * Tq * C)),
             dkv16 = pair_of(std::vector<float>(B * Tk * kvw));
        ops::attention_gqa_backward_rows_bf16(on_gpu, dq16.g(), C, dkv16.g(), dout.g(), q16.raw(),
                                              C, kv16.raw(), kvw, out.g(), DType::kF32, lse.g(), B,
                                              Tk, NH, KV, hd, rows, keys);
        EXPECT_TRUE(bitwise_equal(dq16.from_gpu(), g)) << "dq, bf16 q and kv";
        EXPECT_TRUE(bitwise_equal(dkv16.from_gpu(), dkv.from_gpu())) << "dkv, bf16 q and kv";
        // out as the projection keeps it, in bf16 (read for D = rowsum(dO ∘ O) alone): the
        // CPU's within bf16 rounding.
        Tensor out16 = Tensor::empty({B * Tq, C}, DType::kBF16, Device::cuda(0));
        ops::round_to_bf16(on_gpu, out16.data_u16(), out.g(), B * Tq * C);
        Pair dq_r = pair_of(dq.from_host()), dkv_r = pair_of(dkv.from_host());
        ops::attention_gqa_backward_rows_bf16(on_gpu, dq_r.g(), C, dkv_r.g(), dout.g(), q16.raw(),
                                              C, kv16.raw(), kvw, out16.raw(), DType::kBF16,
                                              lse.g(), B, Tk, NH, KV, hd, rows, keys);
        expect_pair_close("dq, bf16 out", dq_r, c.grad_tol);
        expect_pair_close("dkv, bf16 out", dkv_r, c.grad_tol);
      }
      expect_close("the blocks' dq summed against the whole sequence's", dq_sum, whole_dq,
                   c.grad_tol);
    }
  }
  // Runs of keys that overlap, or do not add up to the key rows, are refused by name.
  Pair o = pair_of(std::vector<float>(2 * 4 * 16)), l = pair_of(std::vector<float>(2 * 2 * 4));
  Pair q = random_pair(2 * 4 * 16, 402), kv = random_pair(2 * 8 * 16, 403);
  const std::vector<cpu::RowRange> rows = {{8, 12}};
  for (const auto& keys : {std::vector<cpu::RowRange>{{0, 4}, {2, 6}},
                           std::vector<cpu::RowRange>{{0, 4}, {8, 10}}}) {
    expect_refused(
        [&] {
          cuda::attention_gqa_forward_rows(0, o.g(), l.g(), q.g(), 16, kv.g(), 16, 2, 8, 2, 2, 4,
                                           rows, keys);
        },
        "key", "bad key runs taken");
  }
}

TEST_F(CudaKernelsTest, AttentionMatchesCpuAndRepeats) {
  expect_attention_matches_cpu(2, 67, 48, 4, 60, kTol, kTol);  // head size 12
}

// Head sizes other than 64 take the batched-GEMM path at bf16 too: its GEMM operands (Q, K, V,
// dO, P, dS) rounded to bf16 — those read twice rounded once — within bf16's rounding of the fp32
// CPU kernel.
TEST_F(CudaKernelsTest, AttentionWithoutFlashInBf16StaysWithinItsRounding) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  const double worst = expect_attention_matches_cpu(2, 45, 48, 2, 64, 1e-2, 2e-2);  // head size 24
  EXPECT_GT(worst, 1e-5) << "bf16 was not applied";
}

// With bf16 matmuls and head size 64 or 128 the fused flash-attention kernels run (bf16 Q, K, V,
// P and dS on the tensor cores, fp32 accumulation): within bf16's rounding of the fp32 CPU kernel,
// over Ts that are not multiples of their 64-row and 32-row tiles, one long enough for the
// forward's running max and sum to be rescaled over several key tiles, one shorter than a warp's
// 16 rows.
TEST_F(CudaKernelsTest, FlashAttentionInBf16MatchesCpuAndRepeats) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  expect_attention_matches_cpu(2, 77, 128, 2, 62, 1e-2, 2e-2);  // head size 64
  expect_attention_matches_cpu(1, 203, 64, 1, 63, 1e-2, 2e-2);  // 4 key tiles, the last ragged
  expect_attention_matches_cpu(3, 5, 64, 1, 65, 1e-2, 2e-2);    // warps whose rows are all past T
  ASSERT_TRUE(cuda::attention_takes_rounded_qkv(256, 2, 2)) << "head size 128 not flash";
  expect_attention_matches_cpu(2, 77, 256, 2, 66, 1e-2, 2e-2);   // head size 128
  expect_attention_matches_cpu(1, 203, 128, 1, 67, 1e-2, 2e-2);  // 7 of its 32-key tiles
  EXPECT_FALSE(cuda::attention_takes_rounded_qkv(96, 1, 2)) << "head size 96";
}

// Document masking (cpu::DocumentStarts, the starts in GPU memory) on both attention paths —
// the batched GEMMs' masked softmax (fp32, and bf16 at head size 24) and the flash kernels (bf16,
// head sizes 64 and 128: the key walk starts at a tile's first document, warps skip the tiles
// before theirs) — against the CPU kernel: grouped-query heads over the whole sequence, and
// context parallelism's rows (a zigzag rank's two chunks) over every key and over another
// rank's ring block (rows whose documents start after the block see none of it). Documents of
// 1 to 90 positions, some starting on a tile's first row; a second run gives the same bits. And
// all of it again under a sliding window of 37 positions over the documents.
TEST_F(CudaKernelsTest, DocumentMaskedAttentionMatchesCpu) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t B = 2, T = 152, NH = 4, KV = 2;
  const std::vector<std::vector<int64_t>> cuts = {{1, 2, 40, 64, 65, 140}, {32, 122, 151}};
  // The same with a sliding window of 37 (model.sliding_window) over the documents.
  for (const int64_t window : {int64_t{0}, int64_t{37}}) {
    SCOPED_TRACE(window > 0 ? "documents and a sliding window of 37" : "documents");
    Tensor starts = Tensor::empty({B, T}, DType::kI32, Device::cpu());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0, start = 0; t < T; ++t) {
        for (int64_t c : cuts[static_cast<size_t>(b)])
          if (c == t) start = t;
        starts.data<int32_t>()[b * T + t] = static_cast<int32_t>(start);
      }
    if (window > 0)  // nn/sliding_window.h: each row's first position raised to its window's
      cpu::window_starts(pool, starts.data<int32_t>(), starts.data<int32_t>(), B, T, window);
    const Tensor starts_gpu = starts.to(Device::cuda(0));
    const cpu::DocumentStarts host_docs{starts.data<int32_t>(), T};
    const cpu::DocumentStarts gpu_docs{starts_gpu.data<int32_t>(), T};
    struct Case {
      cuda::MatmulPrecision precision;
      int64_t hd;
      double tol, dtol;
    };
    for (const Case& k : {Case{cuda::MatmulPrecision::kFp32, 24, kTol, kTol},
                          Case{cuda::MatmulPrecision::kBf16, 24, 1e-2, 2e-2},
                          Case{cuda::MatmulPrecision::kBf16, 64, 1e-2, 2e-2},
                          Case{cuda::MatmulPrecision::kBf16, 128, 1e-2, 2e-2}}) {
      cuda::set_matmul_precision(k.precision);
      const int64_t hd = k.hd, C = NH * hd, W = (NH + 2 * KV) * hd, kvw = 2 * KV * hd;
      const bool flash = cuda::attention_takes_rounded_qkv(C, NH, B);
      EXPECT_EQ(flash, hd != 24);
      SCOPED_TRACE("hd " + std::to_string(hd) + (flash ? " flash" : " batched"));
      Pair qkv = random_pair(B * T * W, 300 + hd, -2.0, 2.0), dout = random_pair(B * T * C, 301);
      Pair out = pair_of(std::vector<float>(B * T * C)),
           lse = pair_of(std::vector<float>(B * NH * T));
      Pair dqkv = pair_of(std::vector<float>(B * T * W));
      cpu::attention_gqa_forward(pool, out.h(), lse.h(), qkv.h(), B, T, NH, KV, hd, host_docs);
      cpu::attention_gqa_backward(pool, dqkv.h(), dout.h(), qkv.h(), out.h(), lse.h(), B, T, NH, KV,
                                  hd, host_docs);
      // KV != NH off the flash kernels: attention_gqa_* repeat the heads, masked alike.
      cuda::attention_gqa_forward(0, out.g(), lse.g(), qkv.g(), B, T, NH, KV, hd, gpu_docs);
      cuda::attention_gqa_backward(0, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, NH, KV,
                                   hd, gpu_docs);
      expect_pair_close("out", out, k.tol);
      expect_pair_close("lse", lse, k.tol);
      expect_pair_close("dqkv", dqkv, k.dtol);
      const std::vector<float> first = dqkv.from_gpu();
      cuda::attention_gqa_forward(0, out.g(), lse.g(), qkv.g(), B, T, NH, KV, hd, gpu_docs);
      cuda::attention_gqa_backward(0, dqkv.g(), dout.g(), qkv.g(), out.g(), lse.g(), B, T, NH, KV,
                                   hd, gpu_docs);
      EXPECT_TRUE(bitwise_equal(dqkv.from_gpu(), first)) << "dqkv not reproducible";

      // Context parallelism: rank 0 of 2 (positions [0, 38) and [114, 152)), q apart from kv.
      const std::vector<cpu::RowRange> rows = {{0, 38}, {114, 152}};
      const std::vector<cpu::RowRange> ring_block = {{38, 76}, {76, 114}};  // rank 1's keys
      const int64_t Tq = cpu::rows_in(rows);
      std::vector<float> q_rows, kv_all, kv_block;
      const std::vector<float> x = qkv.from_host();
      for (int64_t b = 0; b < B; ++b) {
        for (const cpu::RowRange& r : rows)
          for (int64_t t = r.begin; t < r.end; ++t)
            q_rows.insert(q_rows.end(), x.begin() + (b * T + t) * W,
                          x.begin() + (b * T + t) * W + C);
        for (int64_t t = 0; t < T; ++t)
          kv_all.insert(kv_all.end(), x.begin() + (b * T + t) * W + C,
                        x.begin() + (b * T + t + 1) * W);
        for (const cpu::RowRange& r : ring_block)
          for (int64_t t = r.begin; t < r.end; ++t)
            kv_block.insert(kv_block.end(), x.begin() + (b * T + t) * W + C,
                            x.begin() + (b * T + t + 1) * W);
      }
      Pair q = pair_of(q_rows), dy = random_pair(B * Tq * C, 302);
      for (const bool ring : {false, true}) {
        SCOPED_TRACE(ring ? "ring block" : "every key");
        Pair kv = pair_of(ring ? kv_block : kv_all);
        const int64_t Tk = ring ? cpu::rows_in(ring_block) : T;
        const std::span<const cpu::RowRange> keys =
            ring ? std::span<const cpu::RowRange>(ring_block) : std::span<const cpu::RowRange>();
        Pair o = pair_of(std::vector<float>(B * Tq * C)),
             l = pair_of(std::vector<float>(B * NH * Tq));
        Pair dq = pair_of(std::vector<float>(B * Tq * C)),
             dkv = pair_of(std::vector<float>(B * Tk * kvw));
        cpu::attention_gqa_forward_rows(pool, o.h(), l.h(), q.h(), C, kv.h(), kvw, B, Tk, NH, KV,
                                        hd, rows, keys, host_docs);
        cuda::attention_gqa_forward_rows(0, o.g(), l.g(), q.g(), C, kv.g(), kvw, B, Tk, NH, KV, hd,
                                         rows, keys, gpu_docs);
        expect_pair_close("rows' out", o, k.tol);
        // lse: -inf where a row sees none of the block, on both.
        const std::vector<float> lg = l.from_gpu(), lh = l.from_host();
        int unseen = 0;
        for (size_t i = 0; i < lh.size(); ++i) {
          if (std::isinf(lh[i])) {
            ++unseen;
            EXPECT_TRUE(std::isinf(lg[i]) && lg[i] < 0) << "lse " << i;
          } else {
            EXPECT_NEAR(lg[i], lh[i], k.tol * std::max(1.0f, std::abs(lh[i]))) << "lse " << i;
          }
        }
        if (ring) {
          EXPECT_GT(unseen, 0) << "some rows' documents start after the block";
        }
        cpu::attention_gqa_backward_rows(pool, dq.h(), C, dkv.h(), dy.h(), q.h(), C, kv.h(), kvw,
                                         o.h(), l.h(), B, Tk, NH, KV, hd, rows, keys, host_docs);
        cuda::attention_gqa_backward_rows(0, dq.g(), C, dkv.g(), dy.g(), q.g(), C, kv.g(), kvw,
                                          o.g(), l.g(), B, Tk, NH, KV, hd, rows, keys, gpu_docs);
        expect_pair_close("rows' dq", dq, k.dtol);
        expect_pair_close("rows' dkv", dkv, k.dtol);
      }
    }
  }
}

// The flash kernels read 16 bytes at a time: a qkv view that does not start on a 16-byte boundary
// is refused with a message, not misread.
TEST_F(CudaKernelsTest, FlashAttentionRefusesAMisalignedQkv) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  const int64_t B = 1, T = 8, C = 64, NH = 1;
  Pair qkv = random_pair(B * T * 3 * C + 1, 64), out = pair_of(std::vector<float>(B * T * C)),
       lse = pair_of(std::vector<float>(B * NH * T));
  expect_refused(
      [&] { ops::attention_forward<float>(on_gpu, out.g(), lse.g(), qkv.g() + 1, B, T, C, NH); },
      "qkv does not start on a 16-byte boundary", "a misaligned qkv was accepted");
}

// At bf16 / fp16 the attention writes its output as the projection's 16-bit input and its input
// gradient as the qkv projection's 16-bit dout: bit for bit the fp32 results rounded (the flash
// kernels at bf16 with head size 64, the batched-GEMM path otherwise), the backward given the
// rounded output; the qkv projection's backward on that dout is matmul_backward's on its values.
TEST_F(CudaKernelsTest, AttentionWritesItsOutputAndGradientRoundedForTheProjections) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  struct Case {
    cuda::MatmulPrecision precision;
    int64_t C, NH;
  };
  const int64_t B = 2, T = 45;
  for (const Case& k : {Case{cuda::MatmulPrecision::kBf16, 128, 2},  // flash
                        Case{cuda::MatmulPrecision::kBf16, 96, 3},   // head size 32
                        Case{cuda::MatmulPrecision::kFp16, 128, 2}}) {
    SCOPED_TRACE(std::to_string(static_cast<int>(k.precision)) + " C=" + std::to_string(k.C));
    cuda::set_matmul_precision(k.precision);
    const DType dtype = ops::matmul_input_dtype(on_gpu, DType::kF32);
    const int64_t n = B * T * k.C;
    Pair qkv = random_pair(3 * n, 95, -2.0, 2.0), dout = random_pair(n, 96);
    Pair out = pair_of(std::vector<float>(n)), lse = pair_of(std::vector<float>(B * k.NH * T)),
         lse16 = pair_of(std::vector<float>(B * k.NH * T));
    ops::attention_forward<float>(on_gpu, out.g(), lse.g(), qkv.g(), B, T, k.C, k.NH);
    Tensor out16 = Tensor::empty({n}, dtype, Device::cuda(0));
    ops::attention_forward_rounded(on_gpu, out16.raw(), dtype, lse16.g(), qkv.g(), DType::kF32, B,
                                   T, k.C, k.NH);
    std::vector<float> want = out.from_gpu();
    for (float& x : want)
      x = dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    const std::vector<float> got = widened(out16);
    EXPECT_TRUE(bitwise_equal(got, want)) << "out";
    EXPECT_TRUE(bitwise_equal(lse16.from_gpu(), lse.from_gpu())) << "lse";

    // The backward: dqkv in 16 bits, the fp32-out backward's given the rounded out, rounded.
    Tensor dqkv16 = Tensor::empty({3 * n}, dtype, Device::cuda(0));
    Pair dqkv_ref = pair_of(std::vector<float>(3 * n)), rounded_out = pair_of(got);
    ops::attention_backward_rounded(on_gpu, dqkv16.raw(), dout.g(), DType::kF32, qkv.g(),
                                    DType::kF32, out16.raw(), dtype, lse16.g(), B, T, k.C, k.NH);
    ops::attention_backward<float>(on_gpu, dqkv_ref.g(), dout.g(), qkv.g(), rounded_out.g(),
                                   lse.g(), B, T, k.C, k.NH);
    std::vector<float> dqkv_want = dqkv_ref.from_gpu();
    for (float& x : dqkv_want)
      x = dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    const std::vector<float> dqkv_got = widened(dqkv16);
    EXPECT_TRUE(bitwise_equal(dqkv_got, dqkv_want)) << "dqkv";

    // The qkv projection's backward on that dqkv: matmul_backward's on its values as fp32.
    const int64_t rows = B * T, OC = 3 * k.C;
    Pair inp = random_pair(rows * k.C, 97), w = random_pair(OC * k.C, 98);
    Tensor kept = Tensor::empty({rows * k.C}, dtype, Device::cuda(0));
    (void)cuda::round_for_gemm(0, kept.raw(), inp.g(), rows * k.C);
    const std::vector<float> dw0 = random_floats(OC * k.C, 99), db0 = random_floats(OC, 100);
    Pair dx1 = pair_of(std::vector<float>(rows * k.C)), dw1 = pair_of(dw0), db1 = pair_of(db0);
    Pair dx2 = pair_of(std::vector<float>(rows * k.C)), dw2 = pair_of(dw0), db2 = pair_of(db0);
    Pair dqkv_values = pair_of(dqkv_got);
    ops::matmul_backward_from_rounded(on_gpu, dx1.g(), dw1.g(), db1.g(), dqkv16.raw(), dtype,
                                      kept.raw(), dtype, w.g(), rows, k.C, OC);
    ops::matmul_backward_from_rounded_input(on_gpu, dx2.g(), dw2.g(), db2.g(), dqkv_values.g(),
                                            kept.raw(), dtype, w.g(), rows, k.C, OC);
    EXPECT_TRUE(bitwise_equal(dx1.from_gpu(), dx2.from_gpu())) << "qkv dinp";
    EXPECT_TRUE(bitwise_equal(dw1.from_gpu(), dw2.from_gpu())) << "qkv dweight";
    EXPECT_TRUE(bitwise_equal(db1.from_gpu(), db2.from_gpu())) << "qkv dbias";
  }
}

// Where the flash kernels apply they take qkv in bf16 as the qkv projection writes it: bit for
// bit what they compute from the same values in fp32 (they round Q, K, V to bf16 as they load
// them), forward and backward. Elsewhere a 16-bit qkv is refused with a message.
TEST_F(CudaKernelsTest, FlashAttentionTakesQkvInBf16AsItsOwnRounding) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
  const int64_t B = 2, T = 77, C = 128, NH = 2, n = B * T * C;
  ASSERT_TRUE(ops::attention_takes_rounded_qkv(on_gpu, C, NH, B));
  EXPECT_FALSE(ops::attention_takes_rounded_qkv(on_gpu, 96, 3, B)) << "head size 32";
  EXPECT_FALSE(ops::attention_takes_rounded_qkv(on_cpu, C, NH, B)) << "on a CPU";

  Pair qkv = random_pair(3 * n, 101, -2.0, 2.0), dout = random_pair(n, 102);
  Tensor qkv16 = Tensor::empty({3 * n}, DType::kBF16, Device::cuda(0));
  (void)cuda::round_for_gemm(0, qkv16.raw(), qkv.g(), 3 * n);
  Pair qkv_values = pair_of(widened(qkv16));
  Tensor out_a = Tensor::empty({n}, DType::kBF16, Device::cuda(0)),
         out_b = Tensor::empty({n}, DType::kBF16, Device::cuda(0));
  Pair lse_a = pair_of(std::vector<float>(B * NH * T)),
       lse_b = pair_of(std::vector<float>(B * NH * T));
  ops::attention_forward_rounded(on_gpu, out_a.raw(), DType::kBF16, lse_a.g(), qkv16.raw(),
                                 DType::kBF16, B, T, C, NH);
  ops::attention_forward_rounded(on_gpu, out_b.raw(), DType::kBF16, lse_b.g(), qkv_values.g(),
                                 DType::kF32, B, T, C, NH);
  EXPECT_TRUE(bitwise_equal(widened(out_a), widened(out_b))) << "out";
  EXPECT_TRUE(bitwise_equal(lse_a.from_gpu(), lse_b.from_gpu())) << "lse";
  Tensor dqkv_a = Tensor::empty({3 * n}, DType::kBF16, Device::cuda(0)),
         dqkv_b = Tensor::empty({3 * n}, DType::kBF16, Device::cuda(0));
  ops::attention_backward_rounded(on_gpu, dqkv_a.raw(), dout.g(), DType::kF32, qkv16.raw(),
                                  DType::kBF16, out_a.raw(), DType::kBF16, lse_a.g(), B, T, C, NH);
  ops::attention_backward_rounded(on_gpu, dqkv_b.raw(), dout.g(), DType::kF32, qkv_values.g(),
                                  DType::kF32, out_a.raw(), DType::kBF16, lse_a.g(), B, T, C, NH);
  const std::vector<float> dqkv = widened(dqkv_a);
  EXPECT_TRUE(bitwise_equal(dqkv, widened(dqkv_b))) << "dqkv";
  EXPECT_GT(*std::max_element(dqkv.begin(), dqkv.end()), 0.0f) << "a gradient was computed";

  // dO in bf16 too (the attention projection's backward writes it so): bit for bit the fp32 dO
  // of the same values, which D = rowsum(dO ∘ O) and the kernels round to bf16 anyway.
  Tensor dout16 = Tensor::empty({n}, DType::kBF16, Device::cuda(0));
  (void)cuda::round_for_gemm(0, dout16.raw(), dout.g(), n);
  Pair dout_values = pair_of(widened(dout16));
  Tensor dqkv_c = Tensor::empty({3 * n}, DType::kBF16, Device::cuda(0)),
         dqkv_d = Tensor::empty({3 * n}, DType::kBF16, Device::cuda(0));
  ops::attention_backward_rounded(on_gpu, dqkv_c.raw(), dout16.raw(), DType::kBF16, qkv16.raw(),
                                  DType::kBF16, out_a.raw(), DType::kBF16, lse_a.g(), B, T, C, NH);
  ops::attention_backward_rounded(on_gpu, dqkv_d.raw(), dout_values.g(), DType::kF32, qkv16.raw(),
                                  DType::kBF16, out_a.raw(), DType::kBF16, lse_a.g(), B, T, C, NH);
  EXPECT_TRUE(bitwise_equal(widened(dqkv_c), widened(dqkv_d))) << "dqkv from a bf16 dO";
  expect_refused(
      [&] {
        ops::attention_backward_rounded(on_gpu, dqkv_c.raw(), dout16.raw(), DType::kBF16,
                                        qkv_values.g(), DType::kF32, out_a.raw(), DType::kBF16,
                                        lse_a.g(), B, T, C, NH);
      },
      "a 16-bit dout needs a 16-bit qkv", "a bf16 dO was taken with an fp32 qkv");

  // Head size 32: the batched-GEMM path, which reads fp32 only.
  const int64_t n32 = B * T * 96;
  Tensor small16 = Tensor::empty({3 * n32}, DType::kBF16, Device::cuda(0));
  Tensor small_out = Tensor::empty({n32}, DType::kBF16, Device::cuda(0));
  Pair small_lse = pair_of(std::vector<float>(B * 3 * T));
  expect_refused(
      [&] {
        ops::attention_forward_rounded(on_gpu, small_out.raw(), DType::kBF16, small_lse.g(),
                                       small16.raw(), DType::kBF16, B, T, 96, 3);
      },
      "a 16-bit qkv needs the flash kernels", "a 16-bit qkv was taken without the flash kernels");
}

TEST_F(CudaKernelsTest, CrossEntropyMatchesCpuAndRefusesBadTargets) {
  const int64_t N = 33;
  // 5000: rows read and written 16 bytes at a time; 5003: one value at a time.
  for (const int64_t V : {int64_t{5003}, int64_t{5000}}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    std::vector<float> values = random_floats(N * V, 70, -8.0, 8.0);
    // Masked logits (-inf), first in a row too, where the GPU's running max is still -inf.
    for (int64_t v : {0, 1, 17, 4000}) values[v] = -INFINITY;
    values[3 * V + 5] = -INFINITY;
    Pair logits = pair_of(values);
    IdPair targets = ids_pair(random_targets(N, static_cast<int32_t>(V), 71));
    Pair losses = pair_of(std::vector<float>(N)), lse = pair_of(std::vector<float>(N));
    ops::cross_entropy_forward<float>(on_cpu, losses.h(), lse.h(), logits.h(),
                                      targets.host.data<int32_t>(), N, V);
    ops::cross_entropy_forward<float>(on_gpu, losses.g(), lse.g(), logits.g(),
                                      targets.gpu.data<int32_t>(), N, V);
    expect_pair_close("losses", losses);
    expect_pair_close("lse", lse);
    // The z-loss's Σ lse² over the rows that count, and the vocabulary-parallel head's form of it
    // (lse = max + log sum; here max = lse - 1, sum = e).
    {
      std::vector<float> max = lse.from_host(), sum(max.size(), std::exp(1.0f));
      for (float& m : max) m -= 1.0f;
      Pair maxp = pair_of(max), sump = pair_of(sum);
      double want = 0, want_shard = 0;
      ops::lse_square_sum<float>(on_cpu, &want, lse.h(), nullptr, targets.host.data<int32_t>(), N);
      ops::lse_square_sum<float>(on_cpu, &want_shard, maxp.h(), sump.h(),
                                 targets.host.data<int32_t>(), N);
      EXPECT_NEAR(want_shard, want, 1e-4 * want);
      Tensor got = Tensor::empty({2}, DType::kF64, on_gpu.device);
      ops::lse_square_sum<float>(on_gpu, got.data<double>(), lse.g(), nullptr,
                                 targets.gpu.data<int32_t>(), N);
      ops::lse_square_sum<float>(on_gpu, got.data<double>() + 1, maxp.g(), sump.g(),
                                 targets.gpu.data<int32_t>(), N);
      const Tensor host = got.to(Device::cpu());
      EXPECT_NEAR(host.data<double>()[0], want, 1e-5 * want) << "Σ lse²";
      EXPECT_NEAR(host.data<double>()[1], want_shard, 1e-5 * want_shard) << "Σ (max + log sum)²";
    }
    // In place over the logits, as the model does.
    const float dloss = 1.0f / static_cast<float>(N);
    ops::cross_entropy_backward<float>(on_cpu, logits.h(), logits.h(), lse.h(),
                                       targets.host.data<int32_t>(), dloss, N, V, kZLoss);
    ops::cross_entropy_backward<float>(on_gpu, logits.g(), logits.g(), lse.g(),
                                       targets.gpu.data<int32_t>(), dloss, N, V, kZLoss);
    expect_pair_close("dlogits", logits);

    std::vector<int32_t> bad_ids = random_ids(N, static_cast<int32_t>(V), 71);
    bad_ids[12] = -1;
    IdPair bad = ids_pair(bad_ids);
    EXPECT_THROW(ops::cross_entropy_forward<float>(on_gpu, losses.g(), lse.g(), logits.g(),
                                                   bad.gpu.data<int32_t>(), N, V),
                 Error);
  }
}

// The LM head's backward: at fp32 the GPU's cross-entropy and matmul backward against the CPU's;
// at bf16 / fp16 the gradient goes to the GEMMs already rounded (no fp32 pass over the logits),
// which must be bit for bit the separate ops' result (fp32 gradient in place, then rounded for
// the GEMMs), and within the precision's rounding of the CPU.
TEST_F(CudaKernelsTest, LmHeadBackwardMatchesTheSeparateOpsAndCpu) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 37, C = 24;
  for (const int64_t V : {int64_t{1009}, int64_t{1024}}) {  // 1024: 16-byte accesses
    SCOPED_TRACE("V=" + std::to_string(V));
    cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);  // the last V left it at fp16
    const float dloss = 1.0f / N;
    const std::vector<float> logits0 = random_floats(N * V, 80, -6.0, 6.0);
    IdPair targets = ids_pair(random_targets(N, static_cast<int32_t>(V), 81));
    Pair inp = random_pair(N * C, 82), w = random_pair(V * C, 83), lse = random_pair(N, 84);
    Pair losses = pair_of(std::vector<float>(N));
    Pair logits = pair_of(logits0);
    ops::cross_entropy_forward<float>(on_cpu, losses.h(), lse.h(), logits.h(),
                                      targets.host.data<int32_t>(), N, V);
    lse.gpu.copy_from(lse.host);
    // The CPU reference: dinp overwritten, dweight accumulated onto random values.
    const std::vector<float> dw0 = random_floats(V * C, 85);
    Pair dinp = pair_of(std::vector<float>(N * C)), dw = pair_of(dw0);
    ops::lm_head_backward<float>(on_cpu, dinp.h(), dw.h(), logits.h(), lse.h(),
                                 targets.host.data<int32_t>(), dloss, inp.h(), w.h(), N, C, V,
                                 kZLoss);
    ops::lm_head_backward<float>(on_gpu, dinp.g(), dw.g(), logits.g(), lse.g(),
                                 targets.gpu.data<int32_t>(), dloss, inp.g(), w.g(), N, C, V,
                                 kZLoss);
    expect_pair_close("fp32 dinp", dinp);
    expect_pair_close("fp32 dweight", dw);

    for (auto [precision, tol] : {std::pair{cuda::MatmulPrecision::kBf16, 1e-2},
                                  std::pair{cuda::MatmulPrecision::kFp16, 2e-3}}) {
      cuda::set_matmul_precision(precision);
      SCOPED_TRACE(precision == cuda::MatmulPrecision::kBf16 ? "bf16" : "fp16");
      Pair fused_dinp = pair_of(std::vector<float>(N * C)), fused_dw = pair_of(dw0);
      logits.gpu.copy_from(Tensor::from_vector(logits0, {N * V}));
      ops::lm_head_backward<float>(on_gpu, fused_dinp.g(), fused_dw.g(), logits.g(), lse.g(),
                                   targets.gpu.data<int32_t>(), dloss, inp.g(), w.g(), N, C, V,
                                   kZLoss);
      Pair split_dinp = pair_of(std::vector<float>(N * C)), split_dw = pair_of(dw0);
      logits.gpu.copy_from(Tensor::from_vector(logits0, {N * V}));
      ops::cross_entropy_backward<float>(on_gpu, logits.g(), logits.g(), lse.g(),
                                         targets.gpu.data<int32_t>(), dloss, N, V, kZLoss);
      ops::matmul_backward<float>(on_gpu, split_dinp.g(), split_dw.g(), nullptr, logits.g(),
                                  inp.g(), w.g(), N, C, V);
      EXPECT_TRUE(bitwise_equal(fused_dinp.from_gpu(), split_dinp.from_gpu())) << "dinp";
      EXPECT_TRUE(bitwise_equal(fused_dw.from_gpu(), split_dw.from_gpu())) << "dweight";
      expect_close("dinp", fused_dinp.from_gpu(), dinp.from_host(), tol);
      expect_close("dweight", fused_dw.from_gpu(), dw.from_host(), tol);
    }
  }
}

// A Linear writing its output in 16 bits (the qkv projection for the flash kernels): the fp32
// GEMM's result plus the bias rounded to that type, rounded once — within an ulp, and equal but
// for ≤1% of values (the GPU's two GEMMs may sum in other orders). From an fp32 input it keeps
// the input's rounding for the backward, and computes what it computes from that rounding.
TEST_F(CudaKernelsTest, LinearWithSixteenBitOutputAddsItsBiasRoundedToThatType) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 37, C = 24, OC = 150;
  Pair inp = random_pair(N * C, 110, -2.0, 2.0), w = random_pair(OC * C, 111),
       bias = random_pair(OC, 112, -3.0, 3.0);
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    const bool bf16 = dtype == DType::kBF16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp16");
    cuda::set_matmul_precision(precision);
    const auto round16 = [&](float x) {
      return bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    };
    Tensor kept = Tensor::empty({N * C}, dtype, Device::cuda(0)),
           out = Tensor::empty({N * OC}, dtype, Device::cuda(0)),
           out2 = Tensor::empty({N * OC}, dtype, Device::cuda(0));
    ops::matmul_forward_rounded_output(on_gpu, out.raw(), dtype, inp.g(), DType::kF32, kept.raw(),
                                       w.g(), bias.g(), N, C, OC);
    std::vector<float> inp_rounded = inp.from_host();
    for (float& x : inp_rounded) x = round16(x);
    EXPECT_TRUE(bitwise_equal(widened(kept), inp_rounded)) << "the kept input";
    ops::matmul_forward_rounded_output(on_gpu, out2.raw(), dtype, kept.raw(), dtype, nullptr, w.g(),
                                       bias.g(), N, C, OC);
    const std::vector<float> got = widened(out);
    EXPECT_TRUE(bitwise_equal(got, widened(out2))) << "from the kept input";

    Pair full = pair_of(std::vector<float>(N * OC));
    ops::matmul_forward<float>(on_gpu, full.g(), inp.g(), w.g(), nullptr, N, C, OC);
    const std::vector<float> acc = full.from_gpu(), b = bias.from_host();
    int64_t off = 0, bias_rounding_shows = 0;
    for (int64_t i = 0; i < N * OC; ++i) {
      const float want = round16(acc[i] + round16(b[i % OC]));
      if (want != round16(acc[i] + b[i % OC])) ++bias_rounding_shows;
      const double ulp = std::ldexp(1.0, std::ilogb(want) - (bf16 ? 7 : 10));
      if (got[i] != want) ++off;
      ASSERT_LE(std::abs(double(got[i]) - want), ulp) << "output " << i;
    }
    EXPECT_LE(off, N * OC / 100);
    EXPECT_GT(bias_rounding_shows, N * OC / 100) << "the data tells the two bias roundings apart";
  }
}

// 16-bit values `got` (widened) against `want`, rounded the same way: each within one ulp of the
// type (bf16: 8 significant bits; fp16: 11, subnormals 2^-24 apart), and equal but for at most
// `max_off` of them.
void expect_within_an_ulp(const std::string& what, const std::vector<float>& got,
                          const std::vector<float>& want, bool bf16, int64_t max_off) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t off = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    ++off;
    const float larger = std::max(std::abs(got[i]), std::abs(want[i]));
    const double ulp = std::max(std::ldexp(1.0, std::ilogb(larger) - (bf16 ? 7 : 10)),
                                bf16 ? 0.0 : std::ldexp(1.0, -24));
    ASSERT_LE(std::abs(double(got[i]) - want[i]), ulp) << what << ", value " << i;
  }
  EXPECT_LE(off, max_off) << what << ": values off by an ulp";
}

// The MLP's fc and GELU at bf16 / fp16 (ops::matmul_forward_gelu): pre is the GEMM's fp32 result
// plus the bias rounded to the 16-bit type, rounded once, and gelu_out the GELU of that fp32 sum,
// rounded — with the GELU in cuBLASLt's epilogue, and apart (LOOM_CUDA_GELU_EPILOGUE=0, pre bit
// for bit). Each within an ulp, equal but for ≤1% (another GEMM order, the CPU's tanh). The
// proj's backward into it (ops::matmul_backward_into_gelu): dweight and dbias bit for bit
// matmul_backward's on the same kept input and dout; dpre the GELU's gradient at the 16-bit pre
// times the fp32 input gradient, rounded, within an ulp likewise. Under the emulator, whose
// epilogue takes Loom's own GELU, the two paths agree bit for bit. Refused at fp32.
TEST_F(CudaKernelsTest, MlpGeluInTheGemmEpiloguesIsTheGeluOfTheFp32Sums) {
  struct Restore {
    ~Restore() {
      cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
      unsetenv("LOOM_CUDA_GELU_EPILOGUE");
    }
  } restore;
  const int64_t N = 70, C = 40, H = 96;  // fc: C -> H, proj: H -> C
  Pair inp = random_pair(N * C, 120, -2.0, 2.0), w_fc = random_pair(H * C, 121, -0.5, 0.5),
       b_fc = random_pair(H, 122), w_proj = random_pair(C * H, 123, -0.5, 0.5),
       dout = random_pair(N * C, 124);
  const std::vector<float> dout0 = dout.from_host(), dw0 = random_floats(C * H, 125),
                           db0 = random_floats(C, 126);
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    const bool bf16 = dtype == DType::kBF16;
    cuda::set_matmul_precision(precision);
    const auto round16 = [bf16](std::vector<float> v) {
      for (float& x : v) x = bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
      return v;
    };
    // The GEMM's fp32 sums plus the rounded bias, and their GELU on the CPU.
    Pair full = pair_of(std::vector<float>(N * H));
    ops::matmul_forward<float>(on_gpu, full.g(), inp.g(), w_fc.g(), nullptr, N, C, H);
    std::vector<float> sums = full.from_gpu();
    const std::vector<float> b_rounded = round16(b_fc.from_host());
    for (int64_t i = 0; i < N * H; ++i) sums[i] += b_rounded[i % H];
    std::vector<float> gelu_of_sums(N * H);
    ops::gelu_forward<float>(on_cpu, gelu_of_sums.data(), sums.data(), N * H);

    std::vector<float> outputs[2][3];  // [apart][pre, gelu_out, dpre]
    for (const bool apart : {false, true}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp16") + (apart ? ", GELU apart" : ", epilogue"));
      if (apart)
        setenv("LOOM_CUDA_GELU_EPILOGUE", "0", 1);
      else
        unsetenv("LOOM_CUDA_GELU_EPILOGUE");
      EXPECT_EQ(cuda::gelu_epilogue_enabled(), !apart);
      Tensor kept = Tensor::empty({N * C}, dtype, Device::cuda(0)),
             pre = Tensor::empty({N * H}, dtype, Device::cuda(0)),
             gelu_out = Tensor::empty({N * H}, dtype, Device::cuda(0)),
             dpre = Tensor::empty({N * H}, dtype, Device::cuda(0));
      ops::matmul_forward_gelu(on_gpu, gelu_out.raw(), pre.raw(), dtype, inp.g(), DType::kF32,
                               kept.raw(), w_fc.g(), b_fc.g(), N, C, H);
      EXPECT_TRUE(bitwise_equal(widened(kept), round16(inp.from_host()))) << "the kept input";
      const std::vector<float> pre_values = widened(pre);
      expect_within_an_ulp("pre", pre_values, round16(sums), bf16, apart ? 0 : N * H / 100);
      expect_within_an_ulp("gelu_out", widened(gelu_out), round16(gelu_of_sums), bf16, N * H / 100);

      Pair dw = pair_of(dw0), db = pair_of(db0);
      ops::matmul_backward_into_gelu(on_gpu, dpre.raw(), dtype, dw.g(), db.g(), dout.g(),
                                     gelu_out.raw(), w_proj.g(), pre.raw(), N, H, C);
      Pair dgelu = pair_of(std::vector<float>(N * H)), dw_ref = pair_of(dw0), db_ref = pair_of(db0);
      ops::matmul_backward_from_rounded_input(on_gpu, dgelu.g(), dw_ref.g(), db_ref.g(), dout.g(),
                                              gelu_out.raw(), dtype, w_proj.g(), N, H, C);
      EXPECT_TRUE(bitwise_equal(dw.from_gpu(), dw_ref.from_gpu())) << "dweight";
      EXPECT_TRUE(bitwise_equal(db.from_gpu(), db_ref.from_gpu())) << "dbias";
      EXPECT_TRUE(bitwise_equal(dout.from_gpu(), dout0)) << "dout changed";
      std::vector<float> dpre_want(N * H);
      const std::vector<float> dgelu_values = dgelu.from_gpu();
      ops::gelu_backward<float>(on_cpu, dpre_want.data(), pre_values.data(), dgelu_values.data(),
                                N * H);
      expect_within_an_ulp("dpre", widened(dpre), round16(dpre_want), bf16, N * H / 100);
      outputs[apart][0] = pre_values;
      outputs[apart][1] = widened(gelu_out);
      outputs[apart][2] = widened(dpre);
    }
#ifdef LOOM_CUDA_EMULATE
    for (int k = 0; k < 3; ++k)
      EXPECT_TRUE(bitwise_equal(outputs[0][k], outputs[1][k])) << "output " << k;
#endif
  }
  cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
  Tensor pre = Tensor::empty({N * H}, DType::kBF16, Device::cuda(0)),
         gelu_out = Tensor::empty({N * H}, DType::kBF16, Device::cuda(0));
  expect_refused(
      [&] {
        ops::matmul_forward_gelu(on_gpu, gelu_out.raw(), pre.raw(), DType::kBF16, inp.g(),
                                 DType::kF32, nullptr, w_fc.g(), b_fc.g(), N, C, H);
      },
      "GEMM inputs are not rounded to 16 bits", "a GELU in a GEMM epilogue with fp32 GEMMs");
}

// A Linear's backward writing its input gradient in 16 bits (the attention projection's, dO for
// the flash kernels: ops::matmul_backward_rounded_dinp): dweight and dbias bit for bit
// matmul_backward's on the same kept input, dinp its fp32 dinp rounded — within an ulp, equal but
// for ≤1% (the GPU may sum a 16-bit output in another order). Refused at fp32.
TEST_F(CudaKernelsTest, LinearBackwardWritesASixteenBitInputGradient) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 53, C = 64, OC = 48;
  Pair inp = random_pair(N * C, 130), w = random_pair(OC * C, 131), dout = random_pair(N * OC, 132);
  const std::vector<float> dw0 = random_floats(OC * C, 133), db0 = random_floats(OC, 134);
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    const bool bf16 = dtype == DType::kBF16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp16");
    cuda::set_matmul_precision(precision);
    Tensor kept = Tensor::empty({N * C}, dtype, Device::cuda(0)),
           dinp = Tensor::empty({N * C}, dtype, Device::cuda(0));
    (void)cuda::round_for_gemm(0, kept.raw(), inp.g(), N * C);
    Pair dw = pair_of(dw0), db = pair_of(db0), dw_ref = pair_of(dw0), db_ref = pair_of(db0),
         dinp_ref = pair_of(std::vector<float>(N * C));
    ops::matmul_backward_rounded_dinp(on_gpu, dinp.raw(), dtype, dw.g(), db.g(), dout.g(),
                                      kept.raw(), dtype, w.g(), N, C, OC);
    ops::matmul_backward_from_rounded_input(on_gpu, dinp_ref.g(), dw_ref.g(), db_ref.g(), dout.g(),
                                            kept.raw(), dtype, w.g(), N, C, OC);
    EXPECT_TRUE(bitwise_equal(dw.from_gpu(), dw_ref.from_gpu())) << "dweight";
    EXPECT_TRUE(bitwise_equal(db.from_gpu(), db_ref.from_gpu())) << "dbias";
    std::vector<float> want = dinp_ref.from_gpu();
    for (float& x : want)
      x = bf16 ? bf16_to_float(float_to_bf16(x)) : f16_to_float(float_to_f16(x));
    expect_within_an_ulp("dinp", widened(dinp), want, bf16, N * C / 100);
  }
  cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32);
  Tensor dinp = Tensor::empty({N * C}, DType::kBF16, Device::cuda(0));
  Pair dw = pair_of(dw0);
  expect_refused(
      [&] {
        ops::matmul_backward_rounded_dinp(on_gpu, dinp.raw(), DType::kBF16, dw.g(), nullptr,
                                          dout.g(), inp.g(), DType::kF32, w.g(), N, C, OC);
      },
      "GEMM inputs are not rounded to 16 bits", "a 16-bit dinp with fp32 GEMMs");
}

// At bf16 / fp16 the LM head stores its logits in 16 bits: the GEMM's fp32 result rounded (to
// within an ulp: the GPU may pick another algorithm for a 16-bit output), their cross-entropy
// the CPU's on those rounded logits, the backward bit for bit the fp32-logits head fed them; a
// precision changed in between is refused before the logits are read as another type. With V
// a multiple of 8 the cross-entropy reads and writes them 16 bytes at a time.
TEST_F(CudaKernelsTest, LmHeadWithSixteenBitLogitsIsTheHeadOnRoundedLogits) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 37, C = 24;
  for (const int64_t V : {int64_t{1009}, int64_t{1024}}) {  // 1024: 16-byte accesses
    SCOPED_TRACE("V=" + std::to_string(V));
    const float dloss = 1.0f / N;
    IdPair targets = ids_pair(random_targets(N, static_cast<int32_t>(V), 90));
    Pair inp = random_pair(N * C, 91, -3.0, 3.0), w = random_pair(V * C, 92);
    const std::vector<float> dw0 = random_floats(V * C, 93);
    for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                    std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
      const bool bf16 = dtype == DType::kBF16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp16");
      cuda::set_matmul_precision(precision);
      ASSERT_EQ(ops::matmul_input_dtype(on_gpu, DType::kF32), dtype);
      Tensor logits = Tensor::empty({N * V}, dtype, Device::cuda(0));
      Pair losses = pair_of(std::vector<float>(N)), lse = pair_of(std::vector<float>(N));
      ops::lm_head_forward_rounded_logits(on_gpu, losses.g(), lse.g(), logits.raw(), dtype, inp.g(),
                                          w.g(), targets.gpu.data<int32_t>(), N, C, V);
      const std::vector<float> got = widened(logits);
      // The fp32 logits of the same GEMM, rounded here.
      Pair full = pair_of(std::vector<float>(N * V));
      ops::matmul_forward<float>(on_gpu, full.g(), inp.g(), w.g(), nullptr, N, C, V);
      const std::vector<float> want = full.from_gpu();
      int64_t off_by_an_ulp = 0;
      for (int64_t i = 0; i < N * V; ++i) {
        const float rounded =
            bf16 ? bf16_to_float(float_to_bf16(want[i])) : f16_to_float(float_to_f16(want[i]));
        const double ulp = std::ldexp(1.0, std::ilogb(rounded) - (bf16 ? 7 : 10));
        if (got[i] != rounded) ++off_by_an_ulp;
        ASSERT_LE(std::abs(double(got[i]) - rounded), ulp) << "logit " << i;
      }
      EXPECT_LE(off_by_an_ulp, N * V / 100);
      // The cross-entropy: the CPU's on the rounded logits.
      Pair rounded = pair_of(got), cpu_losses = pair_of(std::vector<float>(N)),
           cpu_lse = pair_of(std::vector<float>(N));
      ops::cross_entropy_forward<float>(on_cpu, cpu_losses.h(), cpu_lse.h(), rounded.h(),
                                        targets.host.data<int32_t>(), N, V);
      expect_close("losses", losses.from_gpu(), cpu_losses.from_host(), kTol);
      expect_close("lse", lse.from_gpu(), cpu_lse.from_host(), kTol);

      // The backward against the fp32-logits head given the same rounded values.
      Pair dinp = pair_of(std::vector<float>(N * C)), dw = pair_of(dw0);
      Pair dinp_ref = pair_of(std::vector<float>(N * C)), dw_ref = pair_of(dw0);
      ops::lm_head_backward_from_rounded_logits(on_gpu, dinp.g(), dw.g(), logits.raw(), dtype,
                                                lse.g(), targets.gpu.data<int32_t>(), dloss,
                                                inp.g(), w.g(), N, C, V, kZLoss);
      ops::lm_head_backward<float>(on_gpu, dinp_ref.g(), dw_ref.g(), rounded.g(), lse.g(),
                                   targets.gpu.data<int32_t>(), dloss, inp.g(), w.g(), N, C, V,
                                   kZLoss);
      EXPECT_TRUE(bitwise_equal(dinp.from_gpu(), dinp_ref.from_gpu())) << "dinp";
      EXPECT_TRUE(bitwise_equal(dw.from_gpu(), dw_ref.from_gpu())) << "dweight";

      // Written at one precision, read at another: refused, the logits untouched.
      ops::lm_head_forward_rounded_logits(on_gpu, losses.g(), lse.g(), logits.raw(), dtype, inp.g(),
                                          w.g(), targets.gpu.data<int32_t>(), N, C, V);
      cuda::set_matmul_precision(bf16 ? cuda::MatmulPrecision::kFp16
                                      : cuda::MatmulPrecision::kBf16);
      const DType logits_dtype = dtype;  // a lambda may not capture a structured binding (C++17)
      expect_refused(
          [&] {
            ops::lm_head_backward_from_rounded_logits(
                on_gpu, dinp.g(), dw.g(), logits.raw(), logits_dtype, lse.g(),
                targets.gpu.data<int32_t>(), dloss, inp.g(), w.g(), N, C, V);
          },
          "logits was rounded for", "logits rounded for another precision were accepted");
      EXPECT_TRUE(bitwise_equal(widened(logits), got)) << "logits changed";
    }
  }
}

// A tensor-parallel rank's vocabulary shard (rows 40..69 of 100, padded to 34 local rows): the
// embedding's forward and backward bit for bit, the cross-entropy pieces and the loss's sum to
// rounding.
TEST_F(CudaKernelsTest, VocabShardKernelsMatchCpu) {
  const int64_t N = 60, T = 12, C = 24, V = 100;
  const VocabShard shard{40, 30, 34, V};
  IdPair tokens = ids_pair(random_ids(N, static_cast<int32_t>(V), 90));
  Pair wte = random_pair(shard.rows * C, 91), wpe = random_pair(T * C, 92);
  Pair out = pair_of(std::vector<float>(N * C));
  for (bool positions : {false, true}) {
    ops::vocab_shard_embedding_forward<float>(on_cpu, out.h(), tokens.host.data<int32_t>(), wte.h(),
                                              wpe.h(), N, T, C, shard, positions);
    ops::vocab_shard_embedding_forward<float>(on_gpu, out.g(), tokens.gpu.data<int32_t>(), wte.g(),
                                              wpe.g(), N, T, C, shard, positions);
    EXPECT_TRUE(bitwise_equal(out.from_gpu(), out.from_host()))
        << "forward, positions " << positions;
  }
  Pair dout = random_pair(N * C, 93), dwte = random_pair(shard.rows * C, 94),
       dwpe = random_pair(T * C, 95);
  ops::vocab_shard_embedding_backward<float>(on_cpu, dwte.h(), dwpe.h(), dout.h(),
                                             tokens.host.data<int32_t>(), N, T, C, shard);
  ops::vocab_shard_embedding_backward<float>(on_gpu, dwte.g(), dwpe.g(), dout.g(),
                                             tokens.gpu.data<int32_t>(), N, T, C, shard);
  EXPECT_TRUE(bitwise_equal(dwte.from_gpu(), dwte.from_host())) << "dwte";
  EXPECT_TRUE(bitwise_equal(dwpe.from_gpu(), dwpe.from_host())) << "dwpe";

  IdPair targets = ids_pair(random_targets(N, static_cast<int32_t>(V), 96));
  Pair logits = random_pair(N * shard.rows, 97, -6.0, 6.0);
  Pair max = pair_of(std::vector<float>(N)), target = pair_of(std::vector<float>(N)),
       sum = pair_of(std::vector<float>(N));
  ops::vocab_shard_logit_max<float>(on_cpu, max.h(), target.h(), logits.h(),
                                    targets.host.data<int32_t>(), N, shard);
  ops::vocab_shard_logit_max<float>(on_gpu, max.g(), target.g(), logits.g(),
                                    targets.gpu.data<int32_t>(), N, shard);
  EXPECT_TRUE(bitwise_equal(max.from_gpu(), max.from_host())) << "max";
  EXPECT_TRUE(bitwise_equal(target.from_gpu(), target.from_host())) << "target logit";
  ops::vocab_shard_sum_exp<float>(on_cpu, sum.h(), logits.h(), max.h(), N, shard);
  ops::vocab_shard_sum_exp<float>(on_gpu, sum.g(), logits.g(), max.g(), N, shard);
  expect_pair_close("sum", sum);
  // The rows' losses summed, the GPU's into its memory (queued): the same inputs, 1000 rows (more
  // than a block's threads), to the rounding of the sum's order.
  {
    const int64_t rows = 1000;
    const std::vector<float> s = random_floats(rows, 98, 1.0, 50.0),
                             m = random_floats(rows, 99, -3.0, 3.0),
                             t = random_floats(rows, 100, -6.0, 6.0);
    const std::vector<int32_t> ids = random_targets(rows, 50, 101);
    double want = 0;
    ops::vocab_shard_loss_sum<float>(on_cpu, &want, s.data(), m.data(), t.data(), ids.data(), rows);
    const Tensor sg = Tensor::from_vector(s, {rows}).to(on_gpu.device),
                 mg = Tensor::from_vector(m, {rows}).to(on_gpu.device),
                 tg = Tensor::from_vector(t, {rows}).to(on_gpu.device);
    const IdPair idg = ids_pair(ids);
    Tensor got = Tensor::empty({1}, DType::kF64, on_gpu.device);
    ops::vocab_shard_loss_sum<float>(on_gpu, got.data<double>(), sg.data<float>(), mg.data<float>(),
                                     tg.data<float>(), idg.gpu.data<int32_t>(), rows);
    EXPECT_NEAR(got.to(Device::cpu()).data<double>()[0], want, 1e-12 * std::abs(want)) << "loss";
  }
  ops::vocab_shard_cross_entropy_backward<float>(
      on_cpu, logits.h(), max.h(), sum.h(), targets.host.data<int32_t>(), 0.5f, N, shard, kZLoss);
  ops::vocab_shard_cross_entropy_backward<float>(
      on_gpu, logits.g(), max.g(), sum.g(), targets.gpu.data<int32_t>(), 0.5f, N, shard, kZLoss);
  expect_pair_close("dlogits", logits);

  std::vector<int32_t> bad = random_ids(N, static_cast<int32_t>(V), 90);
  bad[7] = static_cast<int32_t>(V);
  IdPair bad_tokens = ids_pair(bad);
  EXPECT_THROW(
      ops::vocab_shard_embedding_forward<float>(on_gpu, out.g(), bad_tokens.gpu.data<int32_t>(),
                                                wte.g(), wpe.g(), N, T, C, shard, true),
      Error);
}

// The vocabulary-parallel head's cross-entropy on 16-bit logits (a GPU at bf16 / fp16): the row
// max, the target's logit and the sum of exponentials are the fp32 kernels' on the same values,
// widened; the gradient written over them is the fp32 kernel's rounded once.
TEST_F(CudaKernelsTest, VocabShardCrossEntropyOnSixteenBitLogitsIsTheFp32OnesOnThoseValues) {
  struct Restore {
    ~Restore() { cuda::set_matmul_precision(cuda::MatmulPrecision::kFp32); }
  } restore;
  const int64_t N = 60, V = 100;
  const VocabShard shard{40, 30, 34, V};
  IdPair targets = ids_pair(random_targets(N, static_cast<int32_t>(V), 96));
  const std::vector<float> values = random_floats(N * shard.rows, 97, -6.0, 6.0);
  for (auto [precision, dtype] : {std::pair{cuda::MatmulPrecision::kBf16, DType::kBF16},
                                  std::pair{cuda::MatmulPrecision::kFp16, DType::kF16}}) {
    SCOPED_TRACE(dtype_name(dtype));
    cuda::set_matmul_precision(precision);
    Rounded logits = rounded_on_gpu(values, dtype);
    Pair max = pair_of(std::vector<float>(N)), target = pair_of(std::vector<float>(N)),
         sum = pair_of(std::vector<float>(N));
    Pair max16 = pair_of(std::vector<float>(N)), target16 = pair_of(std::vector<float>(N)),
         sum16 = pair_of(std::vector<float>(N));
    ops::vocab_shard_logit_max<float>(on_gpu, max.g(), target.g(), logits.values.g(),
                                      targets.gpu.data<int32_t>(), N, shard);
    ops::vocab_shard_logit_max_rounded(on_gpu, max16.g(), target16.g(), logits.bits.raw(), dtype,
                                       targets.gpu.data<int32_t>(), N, shard);
    EXPECT_TRUE(bitwise_equal(max16.from_gpu(), max.from_gpu())) << "max";
    EXPECT_TRUE(bitwise_equal(target16.from_gpu(), target.from_gpu())) << "target logit";
    ops::vocab_shard_sum_exp<float>(on_gpu, sum.g(), logits.values.g(), max.g(), N, shard);
    ops::vocab_shard_sum_exp_rounded(on_gpu, sum16.g(), logits.bits.raw(), dtype, max.g(), N,
                                     shard);
    EXPECT_TRUE(bitwise_equal(sum16.from_gpu(), sum.from_gpu())) << "sum";
    ops::vocab_shard_cross_entropy_backward<float>(on_gpu, logits.values.g(), max.g(), sum.g(),
                                                   targets.gpu.data<int32_t>(), 0.5f, N, shard,
                                                   kZLoss);
    ops::vocab_shard_cross_entropy_backward_rounded(on_gpu, logits.bits.raw(), dtype, max.g(),
                                                    sum.g(), targets.gpu.data<int32_t>(), 0.5f, N,
                                                    shard, kZLoss);
    EXPECT_TRUE(bitwise_equal(widened(logits.bits), rounded_to(logits.values.from_gpu(), dtype)))
        << "dlogits";
  }
  // At fp32 GEMM inputs the 16-bit ops are refused.
  Rounded logits = rounded_on_gpu(values, DType::kBF16);
  Pair max = pair_of(std::vector<float>(N)), target = pair_of(std::vector<float>(N));
  EXPECT_THROW(
      ops::vocab_shard_logit_max_rounded(on_gpu, max.g(), target.g(), logits.bits.raw(),
                                         DType::kBF16, targets.gpu.data<int32_t>(), N, shard),
      Error);
}

TEST_F(CudaKernelsTest, AdamWIsBitwiseTheCpuUpdate) {
  const int64_t n = 70001;
  Pair p = random_pair(n, 80), g = random_pair(n, 81), m = random_pair(n, 82, -0.1, 0.1),
       v = random_pair(n, 83, 0.0, 0.01);
  for (int64_t step = 1; step <= 3; ++step) {
    ops::adamw_update<float>(on_cpu, p.h(), g.h(), m.h(), v.h(), n, 6e-4, 0.9, 0.95, 1e-8, 0.1,
                             step, 0.5f);
    ops::adamw_update<float>(on_gpu, p.g(), g.g(), m.g(), v.g(), n, 6e-4, 0.9, 0.95, 1e-8, 0.1,
                             step, 0.5f);
  }
#ifdef __FMA__
  // The CPU build fuses the same multiply-adds as the GPU kernel.
  EXPECT_TRUE(bitwise_equal(p.from_gpu(), p.from_host())) << "param";
  EXPECT_TRUE(bitwise_equal(m.from_gpu(), m.from_host())) << "m";
  EXPECT_TRUE(bitwise_equal(v.from_gpu(), v.from_host())) << "v";
#else
  expect_pair_close("param", p);
  expect_pair_close("m", m);
  expect_pair_close("v", v);
#endif
}

// A model's AdamW in one launch: every run bitwise adamw_update on its own elements (runs longer
// than a chunk, exactly one, an empty one, offsets differing between values, gradients and moments,
// weight decay on some), and the elements between runs untouched.
TEST_F(CudaKernelsTest, AdamWRunsInOneLaunchAreEachRunsOwnUpdate) {
  const int64_t n = 30000;
  std::vector<AdamWRun> runs = {{0, 100, 50, 9000, 1},
                                {9000, 9100, 9050, 0, 0},
                                {9000, 20000, 9050, 700, 0},
                                {12000, 9200, 12000, 4096, 1},
                                {20000, 25000, 20000, 5, 0}};
  EXPECT_EQ(number_adamw_chunks(runs), 3 + 0 + 1 + 1 + 1);
  EXPECT_EQ(adamw_chunk_count(runs), 6);
  Tensor table = Tensor::empty({static_cast<int64_t>(runs.size() * sizeof(AdamWRun) / 8)},
                               DType::kI64, Device::cpu());
  std::memcpy(table.data<int64_t>(), runs.data(), runs.size() * sizeof(AdamWRun));
  const Tensor table_on_gpu = table.to(Device::cuda(0));
  const auto* runs_on_gpu = reinterpret_cast<const AdamWRun*>(table_on_gpu.data<int64_t>());

  Pair p = random_pair(n, 84), g = random_pair(n, 85), m = random_pair(n, 86, -0.1, 0.1),
       v = random_pair(n, 87, 0.0, 0.01);
  Pair p2 = pair_of(p.from_host()), m2 = pair_of(m.from_host()), v2 = pair_of(v.from_host());
  const std::vector<float> p0 = p.from_host();
  for (int64_t step = 1; step <= 2; ++step) {
    ops::adamw_update_runs(on_gpu, p.g(), g.g(), m.g(), v.g(), runs, runs_on_gpu, 6e-4, 0.9, 0.95,
                           1e-8, 0.1, step, 0.5f);
    ops::adamw_update_runs(on_cpu, p.h(), g.h(), m.h(), v.h(), runs, nullptr, 6e-4, 0.9, 0.95, 1e-8,
                           0.1, step, 0.5f);
    for (const AdamWRun& r : runs)
      ops::adamw_update<float>(on_gpu, p2.g() + r.value_offset, g.g() + r.grad_offset,
                               m2.g() + r.state_offset, v2.g() + r.state_offset, r.numel, 6e-4, 0.9,
                               0.95, 1e-8, r.decay != 0 ? 0.1 : 0.0, step, 0.5f);
  }
  EXPECT_TRUE(bitwise_equal(p.from_gpu(), p2.from_gpu())) << "param";
  EXPECT_TRUE(bitwise_equal(m.from_gpu(), m2.from_gpu())) << "m";
  EXPECT_TRUE(bitwise_equal(v.from_gpu(), v2.from_gpu())) << "v";
  const std::vector<float> after = p.from_gpu();
  for (int64_t i : {int64_t{9700}, int64_t{11999}, int64_t{16096}, int64_t{20005}, n - 1})
    EXPECT_EQ(after[static_cast<size_t>(i)], p0[static_cast<size_t>(i)]) << "element " << i;
  EXPECT_NE(after[8999], p0[8999]) << "the first run's last element";
#ifdef __FMA__
  EXPECT_TRUE(bitwise_equal(after, p.from_host())) << "the CPU's runs";
#else
  expect_pair_close("the CPU's runs", p);
#endif
}

// The memory roofline the profile's GB/s are read against: a positive rate from copies that
// arrived (measure_copy_gbps checks), and a GPU that is not there refused with the count.
TEST_F(CudaKernelsTest, MemoryBandwidthIsMeasuredOnCopiesThatArrive) {
  EXPECT_GT(ops::measure_gpu_copy_gbps(Device::cuda(0), int64_t{8} << 20, 3), 0.0);
  expect_refused([&] { ops::measure_gpu_copy_gbps(Device::cuda(99), 1024, 1); },
                 "memory bandwidth on cuda:99: ", "cuda:99 was measured");
}

TEST_F(CudaKernelsTest, DoubleIsRefusedOnTheGpu) {
  Tensor x = Tensor::zeros({4}, DType::kF64, Device::cuda(0));
  expect_refused([&] { ops::scale_inplace<double>(on_gpu, x.data<double>(), 2.0, 4); }, "f32 only",
                 "f64 ran on the GPU");
}

}  // namespace
}  // namespace loom
