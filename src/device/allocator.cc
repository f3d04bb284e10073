#include "device/allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "base/check.h"
#include "base/error.h"
#include "device/cuda/cuda_backend.h"

namespace loom {
namespace {
constexpr size_t kAlignment = 64;
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

size_t CachingCpuAllocator::round_size(size_t bytes) {
  // Small blocks: multiples of 64 B. Larger: 8 classes per power of two (<= 12.5% waste), so a
  // tensor whose size wobbles a little (a shorter last batch) still finds its old block.
  if (bytes <= 4096) return std::max<size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  size_t pow2 = size_t{1} << (63 - __builtin_clzll(bytes - 1));  // largest power of 2 < bytes
  size_t step = pow2 / 8;
  return (bytes + step - 1) / step * step;
}

CachingCpuAllocator::~CachingCpuAllocator() { release_cached(); }

void* CachingCpuAllocator::allocate(size_t bytes) {
  const size_t size = round_size(bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.allocations;
    auto it = free_blocks_.find(size);
    if (it != free_blocks_.end() && !it->second.empty()) {
      void* ptr = it->second.back();
      it->second.pop_back();
      ++stats_.cache_hits;
      stats_.bytes_in_use += static_cast<int64_t>(size);
      stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
      return ptr;
    }
  }
  const size_t align = size >= kHugePage ? kHugePage : kAlignment;
  void* ptr = std::aligned_alloc(align, (size + align - 1) / align * align);
  if (ptr == nullptr) fail("out of host memory allocating ", size, " bytes");
  if (size >= kHugePage) madvise(ptr, size, MADV_HUGEPAGE);  // a hint; failure is harmless
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_in_use += static_cast<int64_t>(size);
  stats_.bytes_reserved += static_cast<int64_t>(size);
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return ptr;
}

void CachingCpuAllocator::deallocate(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_in_use -= static_cast<int64_t>(size);
  LOOM_CHECK(stats_.bytes_in_use >= 0);
  free_blocks_[size].push_back(ptr);
}

MemoryStats CachingCpuAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingCpuAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
}

void CachingCpuAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [size, blocks] : free_blocks_) {
    for (void* p : blocks) std::free(p);
    stats_.bytes_reserved -= static_cast<int64_t>(size * blocks.size());
    blocks.clear();
  }
}

Allocator& allocator_for(Device device) {
  static std::mutex mutex;
  // Leaked on purpose: tensors with static lifetime may be freed after any static destructor.
  static auto* registry = new std::map<std::pair<int, int>, std::unique_ptr<Allocator>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(device.type), device.index);
  auto it = registry->find(key);
  if (it != registry->end()) return *it->second;
  std::unique_ptr<Allocator> alloc;
  if (device.is_cpu()) {
    alloc = std::make_unique<CachingCpuAllocator>();
  } else {
    alloc = cuda::make_cuda_allocator(device.index);  // throws when built without CUDA
  }
  return *registry->emplace(key, std::move(alloc)).first->second;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::copy_bytes(dst, dst_device, src, src_device, bytes);
}

void copy_bytes_queued(void* dst, const void* src, Device device, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::copy_bytes_queued(dst, src, device.index, bytes);
}

void copy_bytes_from_host_queued(void* dst, Device device, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::copy_bytes_from_host_queued(dst, device.index, src, bytes);
}

void zero_bytes(void* dst, Device device, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(dst, 0, bytes);
    return;
  }
  cuda::zero_bytes(dst, device.index, bytes);
}

void synchronize(Device device) {
  if (device.is_cuda()) cuda::synchronize(device.index);
}

bool cuda_available() { return cuda::device_count() > 0; }

}  // namespace loom
