// Context — what a module needs to run a kernel: the rank's thread pool and where activations
// live. Passed explicitly to every forward/backward; no globals.
#pragma once

#include "base/thread_pool.h"
#include "device/device.h"
#include "tensor/dtype.h"

namespace loom {

struct Context {
  ThreadPool* pool = nullptr;
  Device device = Device::cpu();
  DType dtype = DType::kF32;  // activations' compute dtype (f64 in gradient checks)
};

}  // namespace loom
