// The CUDA emulator's execution model: a kernel's grid runs on the calling host thread, one block
// after another, each CUDA thread of a block a fiber with its own small stack. A fiber runs until
// it finishes or waits at a barrier: __syncthreads (the block's live threads) or a warp shuffle
// (its warp's 32 lanes). The emulator thereby runs CUDA kernels written for the GPU, barriers and
// warp-synchronous reductions included, on machines without one (the build preset
// "cuda-emulated", docs/testing.md), and turns what the GPU would do silently wrong into errors:
//  - a shuffle while a lane of the warp has exited (undefined with a full mask),
//  - a barrier some threads never reach (a deadlock on the GPU),
//  - more than 1024 threads per block, or a grid dimension past the GPU's limits.
//
// Blocks run in order and the fibers of a block round robin, so an emulated run is deterministic;
// it says nothing about races between blocks (atomics are plain operations here) nor about speed.
// Plain C++ with no CUDA headers: the kernel-side names (threadIdx, __syncthreads, ...) are mapped
// onto this by kernel_api.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace loom::cuda_emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// What a CUDA thread reads as threadIdx, blockIdx, blockDim and gridDim.
struct ThreadIndices {
  Dim3 thread_idx, block_idx, block_dim, grid_dim;
};

// The indices of the CUDA thread running now. Only inside a kernel run by run_kernel.
const ThreadIndices& current();

// Runs body(context) once per CUDA thread of a grid × block launch, and returns when every thread
// has finished. Throws loom::Error naming `kernel` on a bad launch configuration, a deadlock or a
// shuffle with exited lanes. Kernels must not throw. Not reentrant: a kernel does not launch
// kernels.
void run_kernel(const char* kernel, Dim3 grid, Dim3 block, void (*body)(void*), void* context);

// The same for a callable: run_kernel(name, grid, block, [&] { my_kernel(args...); }).
template <typename Body>
void run_kernel(const char* kernel, Dim3 grid, Dim3 block, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_kernel(
      kernel, grid, block, [](void* c) { (*static_cast<B*>(c))(); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

// __syncthreads(): waits until every live thread of the block has arrived.
void sync_threads();

// The exchange behind the warp shuffles: every lane of the calling warp offers `bytes` (at most 8)
// of `value` and receives lane `source_lane`'s offer into `out` (its own when source_lane is
// outside [0, 32)). All 32 lanes must take part.
void warp_exchange(const void* value, void* out, size_t bytes, int source_lane);

// This thread's lane in its warp (threads are numbered x fastest, then y, then z, as on the GPU).
int lane_id();

// The tensor cores' mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a·b over the warp:
// A 16×16, B 16×8 and D 16×8 spread over the 32 lanes as PTX lays out their fragments (groupID =
// lane / 4, t = lane % 4; each uint32_t two bf16, the lower-numbered element in the low half):
//  - a[0]: A row g, columns 2t and 2t+1; a[1]: row g+8; a[2]: row g, columns 2t+8 and 2t+9;
//    a[3]: row g+8, columns 2t+8 and 2t+9;
//  - b[0]: B rows 2t and 2t+1 of column g; b[1]: rows 2t+8 and 2t+9;
//  - d[0], d[1]: D row g, columns 2t and 2t+1; d[2], d[3]: row g+8.
// The products are summed in fp32 in k order (the tensor cores' order and internal precision are
// theirs). All 32 lanes must take part.
void warp_mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 over the warp: four 8×8 matrices of 16-bit
// values, lanes 8i .. 8i + 7 giving the addresses of matrix i's 8 rows (16 bytes each). r[i] is
// this lane's fragment of matrix i: row lane / 4, elements 2·(lane % 4) and the next (low half
// first); `transposed` (.trans, the matrix read column-major): column lane / 4, the elements of
// rows 2·(lane % 4) and the next. All 32 lanes must take part.
void warp_ldmatrix_x4(uint32_t (&r)[4], const void* row, bool transposed);

// cp.async.cg.shared.global of 16 bytes (the bytes past src_bytes zero-filled), commit_group and
// wait_group, per thread as on the GPU: the destination turns to 0xff bytes (NaN) at the issue
// and gets its data when its thread waits for the copy's group — so a kernel that reads it before
// the wait (or before a barrier after the other threads' waits), or refills a buffer other warps
// still read, reads garbage, as a GPU may. A thread that exits with copies it never waited for
// is an error.
void cp_async_16(void* dst, const void* src, int src_bytes);
void cp_async_commit();
// Completes this thread's committed groups but the `pending` most recent.
void cp_async_wait(int pending);

// What the host has asked of the emulated GPUs since the process started, all host threads
// together: two figures behind a GPU step's speed that an emulator can count truthfully, where
// its timings say nothing. A kernel is a grid (run_kernel) or a GEMM (cuBLASLt's place). A host
// wait is a drain: the host waiting for work it queued since it last waited — a kernel, a queued
// copy or memset, an NCCL operation — so the GPU runs dry until the host queues more. The calls
// that wait: cudaDeviceSynchronize, cudaStreamSynchronize and cudaEventSynchronize of the compute
// stream (the legacy default stream, where the kernels run), and cudaMemcpy (or cudaMemcpyAsync
// with pageable host memory on that stream) to or from the host; a side stream's (a
// communicator's) waits only for that stream. Waits in a row count once: the first drains, the
// next finds nothing queued. Counted per host thread (a thread rank's GPU), summed over them.
struct HostActivity {
  int64_t kernels = 0;
  int64_t host_waits = 0;
};
HostActivity host_activity();
void note_kernel();       // a kernel or GEMM queued
void note_queued();       // other work queued: a copy, a memset, an NCCL operation
void note_host_wait();    // a call that waits for the calling thread's queued work

}  // namespace loom::cuda_emu
