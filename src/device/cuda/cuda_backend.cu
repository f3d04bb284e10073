// The CUDA device backend: GPU discovery, a counting caching allocator over cudaMalloc, copies
// between host and GPUs, and one elementwise kernel (axpy) that proves the toolchain end to end.
//
// The kernels (kernels/cuda) run on each GPU's legacy default stream, the compute stream, and
// the host goes on while they run. Here copy_bytes waits for the GPU (the bytes are there on
// return); copy_bytes_queued, copy_bytes_from_host_queued and zero_bytes are queued on the
// compute stream and do not wait.
#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "base/timer.h"
#include "device/cuda/cuda_backend.h"
#include "device/cuda/clock.h"
#include "device/cuda/cuda_check.h"
#ifdef LOOM_CUDA_EMULATE
#include "device/cuda/emulator/poison.h"
#include "device/cuda/emulator/scheduler.h"
#endif

namespace loom::cuda {
namespace {

// Asks the runtime how many GPUs it sees. Errors that mean "no usable GPU on this machine" count
// as zero GPUs (CPU-only machines run the CUDA build's tests, which then skip); anything else is
// a broken setup worth an error rather than a silent skip.
struct Probe {
  int count = 0;
  cudaError_t error = cudaSuccess;
};

Probe probe() {
  Probe p;
  p.error = cudaGetDeviceCount(&p.count);
  if (p.error == cudaSuccess) return p;
  (void)cudaGetLastError();  // clear it, so that it is not reported by the next unrelated check
  p.count = 0;
  switch (p.error) {
    case cudaErrorNoDevice:                    // a driver, but no GPU (or CUDA_VISIBLE_DEVICES="")
    case cudaErrorInsufficientDriver:          // no driver, or one older than this runtime
    case cudaErrorStubLibrary:                 // the toolkit's stub libcuda.so, not a driver
    case cudaErrorSystemDriverMismatch:        // user-mode and kernel-mode drivers differ
    case cudaErrorCompatNotSupportedOnDevice:  // forward-compat driver, unsupported GPU
    case cudaErrorDevicesUnavailable:          // every GPU taken in exclusive-process mode
      return p;
    default:
      detail::throw_cuda_error(p.error, "cudaGetDeviceCount(&count)", __FILE__, __LINE__);
  }
}

void expect_gpu_exists(int index) {
  const Probe p = probe();
  if (index < 0 || index >= p.count)
    fail("GPU cuda:", index, " does not exist: ", p.count, " visible",
         p.count == 0 ? " (" + unavailable_reason() + ")" : std::string());
}

// Size classes: multiples of 512 B up to 4 KiB (PyTorch's CUDA caching allocator also rounds to
// 512 B), then the host allocator's 8 classes per power of two, so a tensor whose size wobbles a
// little finds its old block.
size_t round_size(size_t bytes) {
  constexpr size_t kMinBlock = 512;
  if (bytes <= 4096) return std::max(kMinBlock, (bytes + kMinBlock - 1) / kMinBlock * kMinBlock);
  return CachingCpuAllocator::round_size(bytes);
}

// Caches freed blocks by size class, as cudaMalloc and cudaFree are slow and synchronise the
// device. Sound because every call here is synchronous: a block is idle when it is freed. Once
// kernels run on side streams, a block must remember its stream (as PyTorch's allocator does).
class CachingCudaAllocator final : public Allocator {
 public:
  explicit CachingCudaAllocator(int index) : index_(index) {}

  // Never throws: when the process ends the CUDA runtime may be gone already, and cudaFree fails.
  ~CachingCudaAllocator() override {
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    if (cudaSetDevice(index_) != cudaSuccess) return;
    for (auto& [size, blocks] : free_blocks_)
      for (void* p : blocks) (void)cudaFree(p);
    (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
  }

  void* allocate(size_t bytes) override {
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.allocations;
    void* ptr = nullptr;
    auto it = free_blocks_.find(size);
    if (it != free_blocks_.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      ++stats_.cache_hits;
    } else {
      ptr = malloc_locked(size);
      stats_.bytes_reserved += static_cast<int64_t>(size);
    }
    stats_.bytes_in_use += static_cast<int64_t>(size);
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
#ifdef LOOM_CUDA_EMULATE
    // As a GPU's reused block holds stale bytes: NaN, so that reading unwritten memory shows;
    // the size class's slack and (below) freed blocks are off limits under AddressSanitizer.
    cuda_emu::unpoison(ptr, size);
    std::memset(ptr, 0xff, bytes);
    cuda_emu::poison(static_cast<char*>(ptr) + bytes, size - bytes);
#endif
    return ptr;
  }

  void deallocate(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.bytes_in_use -= static_cast<int64_t>(size);
    LOOM_CHECK(stats_.bytes_in_use >= 0);
#ifdef LOOM_CUDA_EMULATE
    cuda_emu::poison(ptr, size);  // a kernel still using it is a use after free
#endif
    free_blocks_[size].push_back(ptr);
  }

  MemoryStats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }

  void release_cached() override {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached_locked();
  }

 private:
  // On out-of-memory: give the cache back to the driver and try once more, then fail with the
  // numbers a user needs to size the model or the batch.
  void* malloc_locked(size_t size) {
    DeviceGuard guard(index_);
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      release_cached_locked();
      err = cudaMalloc(&ptr, size);
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      LOOM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      fail("out of GPU memory on cuda:", index_, " allocating ", size, " bytes: Loom holds ",
           stats_.bytes_in_use, " bytes in tensors; the GPU has ", free_bytes, " of ", total_bytes,
           " bytes free");
    }
    LOOM_CUDA_CHECK(err);
    return ptr;
  }

  void release_cached_locked() {
    DeviceGuard guard(index_);
    for (auto& [size, blocks] : free_blocks_) {
      while (!blocks.empty()) {
        LOOM_CUDA_CHECK(cudaFree(blocks.back()));  // (the emulator's cudaFree unpoisons it)
        blocks.pop_back();
        stats_.bytes_reserved -= static_cast<int64_t>(size);
      }
    }
  }

  const int index_;
  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;  // size class -> blocks
  MemoryStats stats_;
};

void expect_on_gpu(const void* ptr, int index, const char* what) {
  cudaPointerAttributes attr{};
  LOOM_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  const bool device_memory =
      attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (!device_memory || attr.device != index)
    fail("axpy_f32: ", what, " is not memory of GPU cuda:", index);
}

// Grid-stride loop: any grid covers any n. fmaf rounds once, as does std::fma, the CPU oracle, so
// the two agree bit for bit (nvcc contracts a * x + y into an fma; g++ in ISO mode does not).
__global__ void axpy_f32_kernel(int64_t n, float a, const float* x, const float* y, float* out) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = fmaf(a, x[i], y[i]);
}

// Page-locked blocks that uploads pass through. A copy from pageable memory waits for the work
// queued before it, so each micro-batch's tokens would stall the host until the last
// micro-batch's backward had run; from page-locked memory it is queued like a kernel. A block is
// reused once an event recorded after its copy says the copy is done (in a training loop, the
// last step's); blocks are kept for the process's life, one set per GPU, at most kMaxBytes of
// them. Past that, or where page-locked memory cannot be had (a container's limits), the upload
// is a plain synchronous copy: slower, never wrong.
class UploadStaging {
 public:
  explicit UploadStaging(int device) : device_(device) {}

  void upload(void* dst, const void* src, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceGuard guard(device_);
    Block* found = free_block_locked(bytes);
    if (found == nullptr) {
      cuda::copy_bytes(dst, Device::cuda(device_), src, Device::cpu(), bytes);
      return;
    }
    Block& block = *found;
    std::memcpy(block.ptr, src, bytes);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, block.ptr, bytes, cudaMemcpyHostToDevice, nullptr));
    LOOM_CUDA_CHECK(cudaEventRecord(block.copied, nullptr));
    block.in_flight = true;
  }

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
    cudaEvent_t copied = nullptr;
    bool in_flight = false;
  };

  static constexpr size_t kMaxBytes = size_t{256} << 20;

  // The smallest block of at least `bytes` whose copy has finished, or a new one; null when no
  // more page-locked memory is to be had.
  Block* free_block_locked(size_t bytes) {
    Block* best = nullptr;
    for (Block& b : blocks_) {
      if (b.size < bytes || (best != nullptr && b.size >= best->size)) continue;
      if (b.in_flight) {
        const cudaError_t state = cudaEventQuery(b.copied);
        if (state == cudaErrorNotReady) continue;
        LOOM_CUDA_CHECK(state);
        b.in_flight = false;
      }
      best = &b;
    }
    if (best != nullptr) return best;
    Block b;
    b.size = round_size(bytes);
    if (held_ + b.size > kMaxBytes) return nullptr;
    if (cudaHostAlloc(&b.ptr, b.size, cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: the synchronous copy goes on
      return nullptr;
    }
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&b.copied, cudaEventDisableTiming));
    held_ += b.size;
    blocks_.push_back(b);
    return &blocks_.back();
  }

  const int device_;
  std::mutex mutex_;
  size_t held_ = 0;
  std::deque<Block> blocks_;  // a deque: references stay valid as it grows
};

UploadStaging& upload_staging(int device) {
  static std::mutex mutex;
  // Never destroyed: the CUDA runtime may be gone when static destructors run.
  static auto* staging = new std::unordered_map<int, std::unique_ptr<UploadStaging>>;
  std::lock_guard<std::mutex> lock(mutex);
  auto& s = (*staging)[device];
  if (!s) s = std::make_unique<UploadStaging>(device);
  return *s;
}

}  // namespace

int device_count() {
  return probe().count;
}

std::string unavailable_reason() {
  const Probe p = probe();
  if (p.count > 0) return "";
  if (p.error == cudaSuccess) return "the CUDA runtime sees no GPU";
  return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(p.error) + ": " +
         cudaGetErrorString(p.error);
}

std::unique_ptr<Allocator> make_cuda_allocator(int index) {
  expect_gpu_exists(index);
  return std::make_unique<CachingCudaAllocator>(index);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  LOOM_CHECK(dst_device.is_cuda() || src_device.is_cuda());
  if (bytes == 0) return;
  if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
    // Between GPUs: over NVLink or PCIe peer-to-peer when enabled, else staged through the host.
    // cudaMemcpyPeer returns before the copy ends, hence the synchronisation.
    DeviceGuard guard(dst_device.index);
    LOOM_CUDA_CHECK(cudaMemcpyPeer(dst, dst_device.index, src, src_device.index, bytes));
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    return;
  }
  const cudaMemcpyKind kind = !src_device.is_cuda()   ? cudaMemcpyHostToDevice
                              : !dst_device.is_cuda() ? cudaMemcpyDeviceToHost
                                                      : cudaMemcpyDeviceToDevice;
  DeviceGuard guard(dst_device.is_cuda() ? dst_device.index : src_device.index);
  LOOM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
  // cudaMemcpy returns once a copy to the host is done, but may return while a copy from pageable
  // host memory is still in flight from the staging buffer, and before a copy within the GPU.
  if (kind != cudaMemcpyDeviceToHost) LOOM_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

void copy_bytes_queued(void* dst, const void* src, int device_index, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_index);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
}

void copy_bytes_from_host_queued(void* dst, int device_index, const void* src, size_t bytes) {
  if (bytes == 0) return;
  upload_staging(device_index).upload(dst, src, bytes);
}

void synchronize(int device_index) {
  DeviceGuard guard(device_index);
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
}

void synchronize_compute(int device_index) {
  DeviceGuard guard(device_index);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

namespace {
// A GPU's clock anchor (anchor_clock): an event of its compute stream and the host time the
// stream passed it. The mutex orders a re-anchoring with the readings against the old event.
struct ClockAnchor {
  std::mutex mutex;
  cudaEvent_t event = nullptr;
  double host_seconds = 0;
  // At exit; a CUDA runtime already shutting down answers with an error, which changes nothing.
  ~ClockAnchor() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};
ClockAnchor& clock_anchor(int device_index) {
  static std::mutex mutex;
  static std::unordered_map<int, std::unique_ptr<ClockAnchor>> anchors;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<ClockAnchor>& anchor = anchors[device_index];
  if (!anchor) anchor = std::make_unique<ClockAnchor>();
  return *anchor;
}
}  // namespace

struct StreamMark {
  int device = 0;
  cudaEvent_t event = nullptr;
  ~StreamMark() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};

void anchor_clock(int device_index) {
  ClockAnchor& anchor = clock_anchor(device_index);
  DeviceGuard guard(device_index);
  std::lock_guard<std::mutex> lock(anchor.mutex);
  if (anchor.event == nullptr) LOOM_CUDA_CHECK(cudaEventCreate(&anchor.event));
  LOOM_CUDA_CHECK(cudaEventRecord(anchor.event, cudaStreamLegacy));
  LOOM_CUDA_CHECK(cudaEventSynchronize(anchor.event));
  anchor.host_seconds = now_seconds();
}

std::optional<double> event_seconds(int device_index, cudaEvent_t event) {
  ClockAnchor& anchor = clock_anchor(device_index);
  std::lock_guard<std::mutex> lock(anchor.mutex);
  if (anchor.event == nullptr || cudaEventQuery(event) != cudaSuccess) return std::nullopt;
  float ms = 0;
  if (cudaEventElapsedTime(&ms, anchor.event, event) != cudaSuccess || ms < 0) return std::nullopt;
  return anchor.host_seconds + ms / 1e3;
}

std::shared_ptr<StreamMark> record_mark(int device_index) {
  DeviceGuard guard(device_index);
  auto mark = std::make_shared<StreamMark>();
  mark->device = device_index;
  LOOM_CUDA_CHECK(cudaEventCreate(&mark->event));
  LOOM_CUDA_CHECK(cudaEventRecord(mark->event, cudaStreamLegacy));
  return mark;
}

std::optional<double> mark_seconds(const StreamMark& mark) {
  return event_seconds(mark.device, mark.event);
}

void zero_bytes(void* dst, int device_index, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_index);
  LOOM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, nullptr));
}

void axpy_f32(int device_index, int64_t n, float a, const float* x, const float* y, float* out) {
  if (n < 0) fail("axpy_f32: n must be non-negative, got ", n);
  if (n == 0) return;
  DeviceGuard guard(device_index);
  expect_on_gpu(x, device_index, "x");
  expect_on_gpu(y, device_index, "y");
  expect_on_gpu(out, device_index, "out");

  // Enough blocks to fill every SM a few times over; the grid-stride loop does the rest.
  constexpr int kThreads = 256;
  constexpr int kBlocksPerSm = 32;
  int sms = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index));
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{sms} * kBlocksPerSm));
#ifdef LOOM_CUDA_EMULATE
  cuda_emu::run_kernel("axpy_f32", {static_cast<unsigned>(blocks)}, {kThreads},
                       [&] { axpy_f32_kernel(n, a, x, y, out); });
#else
  axpy_f32_kernel<<<blocks, kThreads>>>(n, a, x, y, out);
#endif
  LOOM_CUDA_CHECK(cudaGetLastError());              // launch errors (bad configuration)
  LOOM_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // errors while the kernel ran
}

}  // namespace loom::cuda
