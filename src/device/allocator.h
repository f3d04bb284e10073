// Allocators that count: every byte a tensor holds is allocated here, so bytes in use and the
// peak are known per device (and so per rank). The CPU allocator caches freed blocks by size:
// on our VMs the first touch of fresh memory costs ~11 µs per 4 KiB page, so a training step
// must reuse last step's activation buffers instead of mapping new ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "device/device.h"

namespace loom {

struct MemoryStats {
  int64_t bytes_in_use = 0;     // held by live tensors
  int64_t peak_bytes_in_use = 0;
  int64_t bytes_reserved = 0;   // in use + cached for reuse
  int64_t allocations = 0;      // calls to allocate()
  int64_t cache_hits = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached, unused blocks to the system.
  virtual void release_cached() = 0;
};

// A caching allocator for host memory: 64-byte aligned blocks, size classes, huge pages for
// large blocks. Thread-safe.
class CachingCpuAllocator final : public Allocator {
 public:
  CachingCpuAllocator() = default;
  ~CachingCpuAllocator() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  MemoryStats stats() const override;
  void reset_peak() override;
  void release_cached() override;

  // The size class a request of `bytes` is served from.
  static size_t round_size(size_t bytes);

 private:
  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;  // size class -> blocks
  MemoryStats stats_;
};

// The allocator of a device, created on first use and alive until the process ends.
// Throws loom::Error for a CUDA device when Loom was built without LOOM_CUDA.
Allocator& allocator_for(Device device);

// Copies `bytes` between any two devices (host<->host, host<->cuda, cuda<->cuda).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Copies `bytes` within one device: on a GPU queued on its compute stream after the work queued
// there (not waited for: what reads dst later on that stream, or a collective, which waits for
// that stream, sees the bytes); on the CPU a memcpy now. For many small moves, e.g. context
// parallelism's rows, which synchronous copies would each stall the GPU's queue for.
void copy_bytes_queued(void* dst, const void* src, Device device, size_t bytes);

// Copies `bytes` of host memory to `device` without waiting for it: on a GPU the bytes are copied
// at once into page-locked staging memory and from there by a copy queued on the compute stream
// (a copy from pageable memory would first wait for everything queued before it); on the CPU a
// memcpy. src may be reused when this returns.
void copy_bytes_from_host_queued(void* dst, Device device, const void* src, size_t bytes);

// Sets `bytes` bytes at dst to zero (on a GPU: queued on its compute stream, not waited for).
void zero_bytes(void* dst, Device device, size_t bytes);

// Waits until the device has finished the work queued on it (a GPU's compute stream); nothing
// to wait for on the CPU. For timing and for handing buffers to code outside Loom.
void synchronize(Device device);

// True when Loom was built with the CUDA backend and at least one GPU is visible.
bool cuda_available();

}  // namespace loom
