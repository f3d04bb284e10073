// The Linear layer on cuda::gemm (gemm.cu: cuBLASLt; gemm_emulated.cu under the emulator), the
// process-wide matmul precision both read, and the operands they round to it.
#include <atomic>

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

template <typename Half>
__global__ void round_kernel(Half* out, const float* in, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    round_to(out[i], in[i]);
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
    launch("gemm operand (round to 16 bits)", round_kernel<Half>, blocks_for(n, kThreads), kThreads,
           static_cast<Half*>(out), x, n);
  });
  return GemmOperand(out, precision);
}

RoundedOperand::~RoundedOperand() {
  if (bits_ != nullptr) allocator_for(Device::cuda(device_)).deallocate(bits_, bytes_);
}

void matmul_forward(int device, float* out, GemmOperand inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC) {
  // out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias
  gemm(device, false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC, bias);
}

GemmOperand matmul_forward_rounded_output(int device, void* out, GemmOperand inp,
                                          const float* weight, const float* bias, int64_t N,
                                          int64_t C, int64_t OC) {
  return gemm_rounded_output(device, false, true, N, OC, C, inp, C, weight, C, out, OC, bias);
}

void matmul_forward_adding(int device, float* out, GemmOperand inp, const float* weight,
                           const float* bias, const float* residual, int64_t N, int64_t C,
                           int64_t OC) {
  gemm_adding(device, false, true, N, OC, C, inp, C, weight, C, residual, out, OC, bias);
}

void matmul_backward_gemms(int device, float* dinp, float* dweight, GemmOperand dout,
                           GemmOperand inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  if (dinp != nullptr)
    gemm(device, false, false, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C);
  // dweight (OC, C) += dout (N, OC)ᵀ · inp (N, C)
  gemm(device, true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
}

void matmul_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                     GemmOperand inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  DeviceGuard guard(device);
  if (dbias == nullptr || !rounds_to_16_bits(matmul_precision())) {
    // Both GEMMs read dout: rounded once (the largest operand of the two: N × OC).
    const RoundedOperand dout_rounded(device, dout, N * OC);
    matmul_backward_gemms(device, dinp, dweight, dout_rounded.operand(), inp, weight, N, C, OC);
    if (dbias != nullptr)
      accumulate_column_sums(device, dbias, RowMajor{dout, OC}, N, OC, "matmul_backward (dbias)");
    return;
  }
  // The bias gradient's pass over dout writes its rounding for the GEMMs as it goes: dout (fp32,
  // N × OC) is read once instead of twice.
  const RoundedOperand dout_rounded(device, N * OC);
  with_rounded_type("matmul_backward", [&](auto zero) {
    using Half = decltype(zero);
    store_with_column_sums(device, dbias,
                           RowMajorStored<Half>{dout, static_cast<Half*>(dout_rounded.bits()), OC},
                           N, OC, "matmul_backward (dbias, rounded dout)");
  });
  matmul_backward_gemms(device, dinp, dweight, dout_rounded.operand(), inp, weight, N, C, OC);
}

void matmul_backward_from_rounded_dout(int device, float* dinp, float* dweight, float* dbias,
                                       GemmOperand dout, GemmOperand inp, const float* weight,
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
                                 float* dgelu, const float* h, GemmOperand inp, const float* weight,
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
