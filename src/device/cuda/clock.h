// The host time of an event on a GPU's compute stream, for code that records its own events (the
// nccl backend's stall timing): see anchor_clock in cuda_backend.h. Host code with the CUDA
// runtime only (LOOM_CUDA=ON or the emulator).
#pragma once

#include <cuda_runtime_api.h>

#include <optional>

namespace loom::cuda {

// When the stream passed `event` (recorded with timing, on GPU `device_index`'s compute stream,
// after its clock anchor), on the host's clock; nullopt while it has not, or without an anchor
// before it.
std::optional<double> event_seconds(int device_index, cudaEvent_t event);

}  // namespace loom::cuda
