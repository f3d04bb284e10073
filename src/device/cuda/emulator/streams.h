// Work on emulated CUDA streams that does not finish when it is issued: an emulated NCCL
// operation (nccl.cc) finishes when the last rank of its communicator posts its part. Kernels and
// copies run when issued, so they never appear here. Events recorded on a stream wait for the
// stream's unfinished work (cudaEventQuery says cudaErrorNotReady until then), as do
// cudaStreamSynchronize, cudaEventSynchronize and cudaDeviceSynchronize (runtime.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>

namespace loom::cuda_emu {

struct StreamWork {
  std::atomic<bool> done{false};
};

// Appends `work` to `stream`'s unfinished work. On the legacy or per-thread default stream,
// whose kernels run when launched, the caller waits instead, here and now.
void enqueue_on_stream(cudaStream_t stream, std::shared_ptr<StreamWork> work);

}  // namespace loom::cuda_emu
