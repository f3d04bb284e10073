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

DType matmul_input_dtype(const Exec& ex, DType dtype) {
  if constexpr (detail::kCudaBuild) {
    if (ex.device.is_cuda() && dtype == DType::kF32) {
      switch (cuda::matmul_precision()) {
        case cuda::MatmulPrecision::kBf16:
          return DType::kBF16;
        case cuda::MatmulPrecision::kFp16:
          return DType::kF16;
        case cuda::MatmulPrecision::kTf32:
        case cuda::MatmulPrecision::kFp32:
          break;
      }
    }
  }
  return dtype;
}

void matmul_forward_keeping_rounded_input(const Exec& ex, float* out, void* inp_rounded,
                                          const float* inp, const float* weight, const float* bias,
                                          int64_t N, int64_t C, int64_t OC) {
  const detail::OpScope op_scope_("matmul_forward", ex, [&] {
    return detail::work_of<float>(detail::matmul_forward_counts(N, C, OC, bias != nullptr));
  });
  if constexpr (detail::kCudaBuild) {
    if (matmul_input_dtype(ex, DType::kF32) != DType::kF32) {
      const cuda::GemmOperand kept = cuda::round_for_gemm(ex.device.index, inp_rounded, inp, N * C);
      cuda::matmul_forward(ex.device.index, out, kept, weight, bias, N, C, OC);
      return;
    }
  }
  fail("matmul_forward_keeping_rounded_input on ", ex.device.str(),
       ": GEMM inputs are not rounded to 16 bits there");
}

void matmul_backward_from_rounded_input(const Exec& ex, float* dinp, float* dweight, float* dbias,
                                        const float* dout, const void* inp_rounded, DType inp_dtype,
                                        const float* weight, int64_t N, int64_t C, int64_t OC) {
  const detail::OpScope op_scope_("matmul_backward", ex, [&] {
    return detail::work_of<float>(
        detail::matmul_backward_counts(N, C, OC, dinp != nullptr, dbias != nullptr));
  });
  if constexpr (detail::kCudaBuild) {
    if (ex.device.is_cuda() && (inp_dtype == DType::kBF16 || inp_dtype == DType::kF16)) {
      // gemm refuses the operand if the matmul precision changed since it was rounded.
      const cuda::GemmOperand kept(inp_rounded, inp_dtype == DType::kBF16
                                                    ? cuda::MatmulPrecision::kBf16
                                                    : cuda::MatmulPrecision::kFp16);
      cuda::matmul_backward(ex.device.index, dinp, dweight, dbias, dout, kept, weight, N, C, OC);
      return;
    }
  }
  fail("matmul_backward_from_rounded_input on ", ex.device.str(), ": a kept ",
       dtype_name(inp_dtype), " input is not a 16-bit GEMM operand on a GPU");
}

}  // namespace loom::ops
