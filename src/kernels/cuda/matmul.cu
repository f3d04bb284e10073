// The Linear layer on cuda::gemm (gemm.cu: cuBLASLt; gemm_emulated.cu under the emulator), the
// process-wide matmul precision both read, and the operands they round to it.
#include <atomic>
#include <cstdlib>
#include <string>

#include "base/error.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

std::atomic<MatmulPrecision> g_precision{MatmulPrecision::kFp32};

// Row r, column c of a row-major matrix: the values whose column sums are dbias.
struct RowMajor {
  const float* data;
  int64_t ld;
  __device__ float operator()(int64_t r, int64_t c) const { return data[r * ld + c]; }
};

// Row r, column c of a row-major matrix of 16-bit values (Half), widened.
template <typename Half>
struct RowMajorWidened {
  const Half* data;
  int64_t ld;
  __device__ float operator()(int64_t r, int64_t c) const { return widen(data[r * ld + c]); }
};

// The same value, also stored to `out` (same layout) as a GEMM operand: fp32, or rounded to the
// 16-bit type `Out`. The column-sum kernel visits every element once, so one read of dout gives
// both the bias gradient and the operand.
template <typename Out>
struct RowMajorStored {
  const float* data;
  Out* out;
  int64_t ld;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float v = data[r * ld + c];
    round_to(out[r * ld + c], v);
    return v;
  }
};

// The gradient at a GELU's input h from the gradient at its output (gelu_grad), stored to `out`
// as above; `out` may be `dgelu` itself (each element is read before it is written, by the same
// thread).
template <typename Out>
struct GeluGradStored {
  const float* dgelu;
  const float* h;
  Out* out;
  int64_t ld;
  __device__ float operator()(int64_t r, int64_t c) const {
    const int64_t i = r * ld + c;
    const float v = gelu_grad(h[i], dgelu[i]);
    round_to(out[i], v);
    return v;
  }
};

// value(r, c) for every element of an N × C matrix, for its side effect (the stores above) when
// there is no bias gradient to sum.
template <typename Value>
__global__ void store_each_kernel(Value value, int64_t N, int64_t C) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    (void)value(i / C, i % C);
}

// Runs `value` over the N × C matrix once: adding its column sums to dbias when non-null, else
// only for what it stores.
template <typename Value>
void store_with_column_sums(int device, float* dbias, Value value, int64_t N, int64_t C,
                            const char* name) {
  if (dbias != nullptr)
    accumulate_column_sums(device, dbias, value, N, C, name);
  else if (N * C > 0)
    launch(name, store_each_kernel<Value>, blocks_for(N * C, kThreads), kThreads, value, N, C);
}

// The MLP's fc and GELU apart (matmul_forward_gelu without the GELU epilogue): from the fp32
// product h (N × OC), pre = h + bias (the bias rounded to Half, as the epilogue takes it) and
// GELU(pre), both rounded to Half.
template <typename Half>
__global__ void gelu_with_input_kernel(Half* gelu_out, Half* pre, const float* h, const float* bias,
                                       int64_t N, int64_t OC) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * OC;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    float x = h[i];
    if (bias != nullptr) {
      Half b;
      round_to(b, bias[i % OC]);
      x += widen(b);
    }
    round_to(pre[i], x);
    round_to(gelu_out[i], gelu(x));
  }
}

// The gradient at a 16-bit GELU input from dgelu (fp32, at its output), rounded (the DGELU
// epilogue apart).
template <typename Half>
__global__ void gelu_grad_of_rounded_kernel(Half* dpre, const Half* pre, const float* dgelu,
                                            int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    round_to(dpre[i], gelu_grad(widen(pre[i]), dgelu[i]));
}

// Calls f with dout as both backward GEMMs' operand, rounded once at bf16 / fp16, and adds its
// column sums to dbias (when non-null). At bf16 / fp16 with a bias, the bias gradient's pass over
// dout writes the rounding as it goes: dout (fp32, N × OC) is read once instead of twice.
template <typename F>
void with_dout_for_gemms(int device, float* dbias, const float* dout, int64_t N, int64_t OC,
                         F&& f) {
  if (dbias == nullptr || !rounds_to_16_bits(matmul_precision())) {
    // Both GEMMs read dout: rounded once (the largest operand of the two: N × OC).
    const RoundedOperand dout_rounded(device, dout, N * OC);
    f(dout_rounded.operand());
    if (dbias != nullptr)
      accumulate_column_sums(device, dbias, RowMajor{dout, OC}, N, OC, "matmul_backward (dbias)");
    return;
  }
  const RoundedOperand dout_rounded(device, N * OC);
  with_rounded_type("matmul_backward", [&](auto zero) {
    using Half = decltype(zero);
    store_with_column_sums(device, dbias,
                           RowMajorStored<Half>{dout, static_cast<Half*>(dout_rounded.bits()), OC},
                           N, OC, "matmul_backward (dbias, rounded dout)");
  });
  f(dout_rounded.operand());
}

void expect_sixteen_bit_precision(const char* op) {
  if (!rounds_to_16_bits(matmul_precision()))
    fail(op, ": the matmul precision is not bf16 or fp16");
}

// kVec values a thread at a time (launch.cuh: load_pack): 4 where n is a multiple of 4 and both
// buffers are 16-byte aligned (a weight's cast each GEMM without nn/rounded_weights.h's copies:
// ~1.5 GB a micro-batch at GPT-2 124M), else 1.
template <typename Half, int kVec>
__global__ void round_kernel(Half* out, const float* in, int64_t n) {
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x * kVec) {
    float v[kVec];
    load_pack<kVec>(in + i, v);
    store_pack<kVec>(out + i, v);
  }
}

}  // namespace

void set_matmul_precision(MatmulPrecision precision) {
  g_precision.store(precision);
}

MatmulPrecision matmul_precision() {
  return g_precision.load();
}

void GemmOperand::expect_usable_at(MatmulPrecision precision, const char* name) const {
  if (rounded_to != MatmulPrecision::kFp32 && rounded_to != precision)
    fail("cuda::gemm: operand ", name, " was rounded for ",
         rounded_to == MatmulPrecision::kBf16 ? "bf16" : "fp16",
         " and the matmul precision has changed since");
}

MatmulPrecision check_rounded_output_gemm(int64_t M, int64_t N, int64_t K, const GemmOperand& A,
                                          const GemmOperand& B) {
  if (M < 0 || N < 0 || K <= 0)
    fail("cuda::gemm_rounded_output: bad sizes M=", M, " N=", N, " K=", K);
  const MatmulPrecision precision = matmul_precision();
  if (!rounds_to_16_bits(precision))
    fail("cuda::gemm_rounded_output: the matmul precision is not bf16 or fp16");
  A.expect_usable_at(precision, "A");
  B.expect_usable_at(precision, "B");
  return precision;
}

void RoundedOperand::allocate(int64_t n) {
  if (n < 0) fail("RoundedOperand: negative length ", n);
  bytes_ = static_cast<size_t>(std::max<int64_t>(n, 1)) * 2;
  bits_ = allocator_for(Device::cuda(device_)).allocate(bytes_);
}

RoundedOperand::RoundedOperand(int device, int64_t n) : device_(device), operand_(nullptr) {
  const MatmulPrecision precision = matmul_precision();
  if (!rounds_to_16_bits(precision))
    fail("RoundedOperand: a 16-bit buffer needs bf16 or fp16 matmul precision");
  allocate(n);
  operand_ = GemmOperand(bits_, precision);
}

RoundedOperand::RoundedOperand(int device, const float* x, int64_t n)
    : device_(device), operand_(x) {
  if (!rounds_to_16_bits(matmul_precision())) return;
  allocate(n);
  operand_ = round_for_gemm(device, bits_, x, n);
}

GemmOperand round_for_gemm(int device, void* out, const float* x, int64_t n) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("round_for_gemm", [&](auto zero) {
    using Half = decltype(zero);
    if (n % 4 == 0 && aligned_to(out, 16) && aligned_to(x, 16))
      launch("gemm operand (round to 16 bits)", round_kernel<Half, 4>, blocks_for(n / 4, kThreads),
             kThreads, static_cast<Half*>(out), x, n);
    else
      launch("gemm operand (round to 16 bits)", round_kernel<Half, 1>, blocks_for(n, kThreads),
             kThreads, static_cast<Half*>(out), x, n);
  });
  return GemmOperand(out, precision);
}

RoundedOperand::~RoundedOperand() {
  if (bits_ != nullptr) allocator_for(Device::cuda(device_)).deallocate(bits_, bytes_);
}

void matmul_forward(int device, float* out, GemmOperand inp, GemmOperand weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC) {
  // out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias
  gemm(device, false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC, bias);
}

GemmOperand matmul_forward_rounded_output(int device, void* out, GemmOperand inp,
                                          GemmOperand weight, const float* bias, int64_t N,
                                          int64_t C, int64_t OC) {
  return gemm_rounded_output(device, false, true, N, OC, C, inp, C, weight, C, out, OC, bias);
}

void matmul_forward_adding(int device, float* out, GemmOperand inp, GemmOperand weight,
                           const float* bias, const float* residual, int64_t N, int64_t C,
                           int64_t OC) {
  gemm_adding(device, false, true, N, OC, C, inp, C, weight, C, residual, out, OC, bias);
}

void matmul_backward_gemms(int device, float* dinp, float* dweight, GemmOperand dout,
                           GemmOperand inp, GemmOperand weight, int64_t N, int64_t C, int64_t OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  if (dinp != nullptr)
    gemm(device, false, false, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C);
  // dweight (OC, C) += dout (N, OC)ᵀ · inp (N, C)
  if (dweight != nullptr)
    gemm(device, true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
}

void matmul_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                     GemmOperand inp, GemmOperand weight, int64_t N, int64_t C, int64_t OC) {
  DeviceGuard guard(device);
  with_dout_for_gemms(device, dbias, dout, N, OC, [&](GemmOperand dout_operand) {
    matmul_backward_gemms(device, dinp, dweight, dout_operand, inp, weight, N, C, OC);
  });
}

GemmOperand matmul_backward_rounded_dinp(int device, void* dinp, float* dweight, float* dbias,
                                         const float* dout, GemmOperand inp, GemmOperand weight,
                                         int64_t N, int64_t C, int64_t OC) {
  expect_sixteen_bit_precision("matmul_backward_rounded_dinp");
  DeviceGuard guard(device);
  with_dout_for_gemms(device, dbias, dout, N, OC, [&](GemmOperand dout_operand) {
    matmul_backward_gemms(device, nullptr, dweight, dout_operand, inp, weight, N, C, OC);
    // dinp (N, C) = dout (N, OC) · weight (OC, C), rounded once (none: the weight's gradients
    // alone, a zero-bubble schedule's W)
    if (dinp != nullptr)
      (void)gemm_rounded_output(device, false, false, N, C, OC, dout_operand, OC, weight, C, dinp,
                                C);
  });
  return GemmOperand(dinp, matmul_precision());
}

bool gelu_epilogue_enabled() {
  const char* v = std::getenv("LOOM_CUDA_GELU_EPILOGUE");
  return v == nullptr || std::string(v) != "0";
}

GemmOperand matmul_forward_gelu(int device, void* gelu_out, void* pre, GemmOperand inp,
                                GemmOperand weight, const float* bias, int64_t N, int64_t C,
                                int64_t OC) {
  expect_sixteen_bit_precision("matmul_forward_gelu");
  DeviceGuard guard(device);
  const MatmulPrecision precision = matmul_precision();
  // out (N, OC) = GELU(inp (N, C) · weight (OC, C)ᵀ + bias)
  if (gelu_epilogue_enabled() &&
      gemm_gelu(device, false, true, N, OC, C, inp, C, weight, C, gelu_out, pre, bias))
    return GemmOperand(gelu_out, precision);
  Scratch<float> h(device, N * OC);
  gemm(device, false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, h.get(), OC);
  with_rounded_type("matmul_forward_gelu", [&](auto zero) {
    using Half = decltype(zero);
    launch("matmul_forward_gelu (GELU apart)", gelu_with_input_kernel<Half>,
           blocks_for(N * OC, kThreads), kThreads, static_cast<Half*>(gelu_out),
           static_cast<Half*>(pre), static_cast<const float*>(h.get()), bias, N, OC);
  });
  return GemmOperand(gelu_out, precision);
}

GemmOperand matmul_backward_into_gelu(int device, void* dpre, float* dweight, float* dbias,
                                      const float* dout, GemmOperand inp, GemmOperand weight,
                                      const void* pre, int64_t N, int64_t C, int64_t OC) {
  expect_sixteen_bit_precision("matmul_backward_into_gelu");
  DeviceGuard guard(device);
  const MatmulPrecision precision = matmul_precision();
  with_dout_for_gemms(device, dbias, dout, N, OC, [&](GemmOperand dout_operand) {
    matmul_backward_gemms(device, nullptr, dweight, dout_operand, inp, weight, N, C, OC);
    // dpre (N, C) = GELU'(pre) ⊙ dout (N, OC) · weight (OC, C) (none: a zero-bubble W)
    if (dpre == nullptr) return;
    if (gelu_epilogue_enabled() &&
        gemm_gelu_backward(device, false, false, N, C, OC, dout_operand, OC, weight, C, dpre, pre))
      return;
    Scratch<float> dgelu(device, N * C);
    gemm(device, false, false, N, C, OC, 1.0f, dout_operand, OC, weight, C, 0.0f, dgelu.get(), C);
    with_rounded_type("matmul_backward_into_gelu", [&](auto zero) {
      using Half = decltype(zero);
      launch("matmul_backward_into_gelu (GELU gradient apart)", gelu_grad_of_rounded_kernel<Half>,
             blocks_for(N * C, kThreads), kThreads, static_cast<Half*>(dpre),
             static_cast<const Half*>(pre), static_cast<const float*>(dgelu.get()), N * C);
    });
  });
  return GemmOperand(dpre, precision);
}

void matmul_backward_from_rounded_dout(int device, float* dinp, float* dweight, float* dbias,
                                       GemmOperand dout, GemmOperand inp, GemmOperand weight,
                                       int64_t N, int64_t C, int64_t OC) {
  const MatmulPrecision precision = matmul_precision();
  dout.expect_usable_at(precision, "dout");
  if (dout.rounded_to != precision || !rounds_to_16_bits(precision))
    fail("matmul_backward_from_rounded_dout: dout is not a 16-bit operand");
  DeviceGuard guard(device);
  if (dbias != nullptr)
    with_rounded_type("matmul_backward_from_rounded_dout", [&](auto zero) {
      using Half = decltype(zero);
      accumulate_column_sums(device, dbias,
                             RowMajorWidened<Half>{static_cast<const Half*>(dout.data), OC}, N, OC,
                             "matmul_backward (dbias of a 16-bit dout)");
    });
  matmul_backward_gemms(device, dinp, dweight, dout, inp, weight, N, C, OC);
}

void matmul_backward_before_gelu(int device, float* dinp, float* dweight, float* dbias,
                                 float* dgelu, const float* h, GemmOperand inp, GemmOperand weight,
                                 int64_t N, int64_t C, int64_t OC) {
  DeviceGuard guard(device);
  if (!rounds_to_16_bits(matmul_precision())) {
    // The GELU's input gradient overwrites dgelu in place, the GEMMs' fp32 operand.
    store_with_column_sums(device, dbias, GeluGradStored<float>{dgelu, h, dgelu, OC}, N, OC,
                           "matmul_backward_before_gelu (dbias, gelu_backward)");
    matmul_backward_gemms(device, dinp, dweight, GemmOperand(dgelu), inp, weight, N, C, OC);
    return;
  }
  const RoundedOperand dh(device, N * OC);
  with_rounded_type("matmul_backward_before_gelu", [&](auto zero) {
    using Half = decltype(zero);
    store_with_column_sums(device, dbias,
                           GeluGradStored<Half>{dgelu, h, static_cast<Half*>(dh.bits()), OC}, N, OC,
                           "matmul_backward_before_gelu (dbias, rounded gelu_backward)");
  });
  matmul_backward_gemms(device, dinp, dweight, dh.operand(), inp, weight, N, C, OC);
}

}  // namespace loom::cuda
