// CUDA events for the op profile (kernels/op_profile.h), and the GPU's memory bandwidth it is
// read against.
#include <cstdint>

#include "base/error.h"
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

double measure_copy_gbps(int device, int64_t bytes, int iters) {
  if (bytes < 1 || iters < 1) fail("measure_copy_gbps: bytes and iters must be positive");
  DeviceGuard guard(device);
  const auto n = static_cast<size_t>(bytes);
  Scratch<uint8_t> from(device, bytes), to(device, bytes);
  LOOM_CUDA_CHECK(cudaMemsetAsync(from.get(), 0x5a, n, nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(to.get(), 0, n, nullptr));
  float best_ms = 0;
  for (int i = 0; i <= iters; ++i) {  // i == 0: warm-up
    void* start = record_timing_event(device);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(to.get(), from.get(), n, cudaMemcpyDeviceToDevice, nullptr));
    const auto ms = static_cast<float>(elapsed_ms_and_release(start, record_timing_event(device)));
    if (i > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  // The last byte made it: a copy that did nothing would time as a fast one.
  uint8_t last = 0;
  LOOM_CUDA_CHECK(cudaMemcpy(&last, to.get() + n - 1, 1, cudaMemcpyDeviceToHost));
  if (last != 0x5a)
    fail("measure_copy_gbps: the device-to-device copy on cuda:", device, " failed");
  if (best_ms <= 0) return 0;  // below the events' resolution
  return 2.0 * static_cast<double>(bytes) / (static_cast<double>(best_ms) * 1e-3) / 1e9;
}

}  // namespace loom::cuda
