// CUDA events for the op profile (kernels/op_profile.h).
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {

void* record_timing_event(int device) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  LOOM_CUDA_CHECK(cudaEventCreate(&event));
  LOOM_CUDA_CHECK(cudaEventRecord(event, nullptr));  // the legacy stream: every kernel's
  return event;
}

double elapsed_ms_and_release(void* start, void* stop) {
  auto* a = static_cast<cudaEvent_t>(start);
  auto* b = static_cast<cudaEvent_t>(stop);
  LOOM_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return ms;
}

}  // namespace loom::cuda
