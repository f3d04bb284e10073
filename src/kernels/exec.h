// Exec — where a kernel runs: the rank's device, and its thread pool for the CPU kernels.
// kernels/ops.h takes one and picks the CPU or the CUDA kernel by the device.
#pragma once

#include "base/thread_pool.h"
#include "device/device.h"

namespace loom {

struct Exec {
  ThreadPool* pool = nullptr;  // CPU kernels' parallelism; unused on a GPU
  Device device = Device::cpu();
};

}  // namespace loom
