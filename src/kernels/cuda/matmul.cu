// The Linear layer on cuda::gemm (gemm.cu: cuBLASLt; gemm_emulated.cu under the emulator), and
// the process-wide matmul precision both read.
#include <atomic>

#include "kernels/cuda/column_sums.cuh"
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

}  // namespace

void set_matmul_precision(MatmulPrecision precision) {
  g_precision.store(precision);
}

MatmulPrecision matmul_precision() {
  return g_precision.load();
}

void matmul_forward(int device, float* out, const float* inp, const float* weight,
                    const float* bias, int64_t N, int64_t C, int64_t OC) {
  // out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias
  gemm(device, false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC, bias);
}

void matmul_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  if (dinp != nullptr)
    gemm(device, false, false, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C);
  // dweight (OC, C) += dout (N, OC)ᵀ · inp (N, C)
  gemm(device, true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias != nullptr) {
    DeviceGuard guard(device);
    accumulate_column_sums(device, dbias, RowMajor{dout, OC}, N, OC, "matmul_backward (dbias)");
  }
}

}  // namespace loom::cuda
