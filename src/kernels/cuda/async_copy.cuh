// Asynchronous global → shared copies (cp.async, sm_80 and later): a kernel issues the next
// tile's copies, computes on the current one while they fly, and waits for them only when it
// needs them. Under the CUDA emulator a copy lands when its thread waits for its group
// (device/cuda/emulator/scheduler.h), so a missing wait or barrier reads stale data there too.
#pragma once

#include <cstdint>

#ifdef LOOM_CUDA_EMULATE
#include "device/cuda/emulator/scheduler.h"
#endif

namespace loom::cuda {

#if defined(__CUDACC__) || defined(LOOM_CUDA_EMULATE)

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), or 16 zero bytes when not
// `valid` (src is then not read, but must still be a global address).
__device__ inline void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(LOOM_CUDA_EMULATE)
  cuda_emu::cp_async_16(dst, src, valid ? 16 : 0);
#elif defined(__CUDA_ARCH__)
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
               "r"(valid ? 16 : 0));
#else
  (void)dst, (void)src, (void)valid;  // nvcc's host pass: never called there
#endif
}

// Closes this thread's group of copies issued since the last commit (possibly none).
__device__ inline void cp_async_commit() {
#if defined(LOOM_CUDA_EMULATE)
  cuda_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until all of this thread's committed groups but the `Pending` most recent have landed;
// other threads' copies need a barrier after their waits too.
template <int Pending>
__device__ inline void cp_async_wait() {
#if defined(LOOM_CUDA_EMULATE)
  cuda_emu::cp_async_wait(Pending);
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
#endif
}

#endif

}  // namespace loom::cuda
