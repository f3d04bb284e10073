// Exec — where a kernel runs: the rank's device, and its thread pool for the CPU kernels.
// kernels/ops.h takes one and picks the CPU or the CUDA kernel by the device.
#pragma once

#include "base/thread_pool.h"
#include "device/device.h"

namespace loom {

struct Exec {
  ThreadPool* pool = nullptr;  // CPU kernels' parallelism; unused on a GPU
  Device device = Device::cpu();
  // The token ids the ops take (embedding inputs, cross-entropy targets) were checked against the
  // vocabulary where they came from (a training loader: data/loader.h, set_vocab_size). A GPU's
  // kernels then skip their own check, which reads its verdict back (a wait for the GPU per op);
  // unchecked ids would be read out of bounds there. The CPU kernels check anyway (no wait).
  bool ids_checked = false;
};

}  // namespace loom
