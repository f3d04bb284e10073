// LOOM_CUDA_CHECK and DeviceGuard — what every CUDA entry point of Loom is wrapped in.
//
// A failing CUDA runtime call throws loom::Error naming file:line, the call and CUDA's own error
// name and string (cudaErrorMemoryAllocation: out of memory). DeviceGuard makes GPU `index`
// current for one scope and restores the previous one, so a thread's current device never leaks
// out of a Loom call. Host code only: include it from .cu and .cc files alike.
#pragma once

#include <cuda_runtime_api.h>

#include "base/error.h"

namespace loom::cuda {

namespace detail {
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  fail(file, ":", line, ": ", expr, " failed: ", cudaGetErrorName(err), ": ",
       cudaGetErrorString(err));
}
}  // namespace detail

#define LOOM_CUDA_CHECK(expr)                                                            \
  do {                                                                                   \
    const cudaError_t loom_cuda_err_ = (expr);                                           \
    if (loom_cuda_err_ != cudaSuccess)                                                   \
      ::loom::cuda::detail::throw_cuda_error(loom_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    LOOM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) LOOM_CUDA_CHECK(cudaSetDevice(index));
    current_ = index;
  }
  // Restoring cannot fail once the guard's own cudaSetDevice succeeded; a destructor must not
  // throw, so the result is ignored.
  ~DeviceGuard() {
    if (previous_ != current_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

}  // namespace loom::cuda
