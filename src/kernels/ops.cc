#include "kernels/ops.h"

#include "device/cuda/cuda_backend.h"

namespace loom::ops {

namespace {
cuda::MatmulPrecision parse_precision(const std::string& name) {
  if (name == "fp32") return cuda::MatmulPrecision::kFp32;
  if (name == "tf32") return cuda::MatmulPrecision::kTf32;
  if (name == "bf16") return cuda::MatmulPrecision::kBf16;
  if (name == "fp16") return cuda::MatmulPrecision::kFp16;
  fail("matmul precision '", name, "': expected fp32, tf32, bf16 or fp16");
}
}  // namespace

void set_matmul_precision(const std::string& name) {
  const cuda::MatmulPrecision precision = parse_precision(name);
  if constexpr (detail::kCudaBuild) cuda::set_matmul_precision(precision);
}

double measure_gpu_gemm_tflops(Device device, const std::string& precision, int64_t n, int iters) {
  const cuda::MatmulPrecision p = parse_precision(precision);
  if (!device.is_cuda()) fail("GEMM rate on ", device.str(), ": not a GPU");
  if constexpr (detail::kCudaBuild) {
    if (device.index >= cuda::device_count())
      fail("GEMM rate on ", device.str(), ": ", cuda::device_count(), " GPU(s) visible",
           cuda::device_count() == 0 ? " (" + cuda::unavailable_reason() + ")" : std::string());
    return cuda::measure_gemm_tflops(device.index, p, n, iters);
  }
  fail("GEMM rate on ", device.str(), ": Loom was built without CUDA (LOOM_CUDA=OFF)");
}

}  // namespace loom::ops
