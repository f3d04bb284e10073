#include "harness/devices.h"

#include "device/cuda/cuda_backend.h"

namespace loom::testing {

std::string cuda_devices_missing(int n) {
  const int have = cuda::device_count();
  if (have >= n) return "";
  std::string why = "needs " + std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s") + ", " +
                    std::to_string(have) + " visible";
  const std::string reason = cuda::unavailable_reason();
  if (!reason.empty()) why += ": " + reason;
  return why;
}

}  // namespace loom::testing
