// The CUDA side of the device layer. Built from cuda_backend.cu with LOOM_CUDA=ON; otherwise from
// cuda_stub.cc, whose functions report that Loom was built without CUDA (device_count() is 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "device/allocator.h"

namespace loom::cuda {

// Number of visible GPUs; 0 when built without CUDA or when no driver/GPU is present. Other
// failures of the CUDA runtime (a broken install) throw loom::Error rather than hide as "no GPU".
int device_count();

// Why device_count() is 0, for messages and test skips: "built without CUDA (LOOM_CUDA=OFF)",
// or the CUDA runtime's own error (no driver, no device). Empty when a GPU is visible.
std::string unavailable_reason();

// A counting allocator over cudaMalloc for GPU `index`, caching freed blocks by size class (so
// bytes_reserved >= bytes_in_use). Throws loom::Error when GPU `index` does not exist.
std::unique_ptr<Allocator> make_cuda_allocator(int index);

// Copies between host and GPU or GPU and GPU (synchronous: the bytes are there on return).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Copies within GPU `device_index`: cudaMemcpyAsync on the legacy default stream, where the
// kernels run, so it is ordered with them without a wait (nor a stall of the host).
void copy_bytes_queued(void* dst, const void* src, int device_index, size_t bytes);

// Copies host bytes to GPU `device_index` without a wait: into page-locked staging memory (kept
// and reused once the copy out of it has finished), then cudaMemcpyAsync from there on the legacy
// default stream, ordered with the kernels. src may be reused when this returns.
void copy_bytes_from_host_queued(void* dst, int device_index, const void* src, size_t bytes);

// Waits for every kernel and copy queued on GPU `device_index`.
void synchronize(int device_index);
// Waits for the compute stream of GPU `device_index` only (the legacy default stream, where the
// kernels and copies run), not for a communicator's streams, whose operations may wait for peers.
void synchronize_compute(int device_index);

// GPU timelines: points of GPU `device_index`'s compute stream (the legacy default stream) on the
// host's clock (now_seconds()). anchor_clock records an event there and waits for it, so its host
// time is the stream's to the wait's latency (µs); it waits for everything queued, so call it
// where the stream is idle or nearly (a step's start). A mark is an event recorded now;
// mark_seconds says when the stream passed it — the anchor's host time plus the GPU's time from
// the anchor to the mark —, nullopt while the stream has not, or when no anchor precedes it.
// Over seconds, not hours: the GPU's and the host's clocks drift apart (re-anchor).
struct StreamMark;
void anchor_clock(int device_index);
std::shared_ptr<StreamMark> record_mark(int device_index);
std::optional<double> mark_seconds(const StreamMark& mark);

// Zeroes `bytes` bytes of GPU `device_index` memory: cudaMemsetAsync on the legacy default
// stream, where the kernels run, so it is ordered with them without a wait.
void zero_bytes(void* dst, int device_index, size_t bytes);

// out[i] = a * x[i] + y[i] on GPU `device_index` (fp32): the first elementwise kernel, used to
// prove the build and the copies; kernels proper arrive with the CUDA issue. x, y and out must be
// memory of that GPU (throws loom::Error otherwise); out may alias y. Synchronous.
void axpy_f32(int device_index, int64_t n, float a, const float* x, const float* y, float* out);

}  // namespace loom::cuda
