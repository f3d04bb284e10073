// The part of the CUDA runtime API that Loom calls, for the emulator (LOOM_CUDA_EMULATE=ON): the
// declarations are the toolkit's own (cuda_runtime_api.h), the definitions here. "GPU memory" is
// host memory from a registry that knows each allocation's GPU and size, so copies check what the
// driver would (a device pointer where one is due, the range inside its allocation) and pointer
// attributes answer truthfully. Fresh allocations are filled with 0xff bytes (NaN as floats), so
// a kernel that reads memory nobody wrote shows up as NaN instead of a lucky zero; under
// AddressSanitizer the bytes past the size asked for are poisoned (poison.h). Kernels and
// copies run when issued; what finishes later is emulated NCCL work (streams.h), which events
// and synchronisations wait for.
//
// LOOM_CUDA_EMULATE_DEVICES (default 4) sets the number of emulated GPUs, each with 2 SMs (grids
// sized by SM count stay small) and 80 GiB. LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB (read at each
// cudaHostAlloc; default no limit) caps the page-locked memory a process may hold, as a
// container's locked-memory limit does: past it cudaHostAlloc fails, for testing the code that
// then does without.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device/cuda/emulator/poison.h"
#include "device/cuda/emulator/scheduler.h"
#include "device/cuda/emulator/streams.h"

namespace {

constexpr int kSms = 2;
constexpr size_t kBytesPerGpu = size_t{80} << 30;

int emulated_devices() {
  static const int count = [] {
    const char* v = std::getenv("LOOM_CUDA_EMULATE_DEVICES");
    if (v == nullptr || *v == '\0') return 4;
    return std::clamp(std::atoi(v), 0, 64);
  }();
  return count;
}

struct Allocation {
  size_t bytes;
  int device;
};

std::mutex g_mutex;
std::map<uintptr_t, Allocation> g_allocations;  // start -> allocation
std::map<uintptr_t, size_t> g_page_locked;       // cudaHostAlloc's blocks: start -> bytes
size_t g_allocated[64] = {};

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local std::string t_detail;

cudaError_t fail(cudaError_t error, std::string detail) {
  t_last_error = error;
  t_detail = std::move(detail);
  return error;
}

// The allocation holding [p, p + bytes), if any.
const Allocation* find_locked(const void* p, size_t bytes, uintptr_t* start = nullptr) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocations.upper_bound(addr);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  if (addr + bytes > it->first + it->second.bytes || addr < it->first) return nullptr;
  if (start != nullptr) *start = it->first;
  return &it->second;
}

bool is_page_locked(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = g_page_locked.upper_bound(addr);
  if (it == g_page_locked.begin()) return false;
  --it;
  return addr >= it->first && addr + bytes <= it->first + it->second;
}

bool is_device(const void* p) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return find_locked(p, 1) != nullptr;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// A device range must lie inside one allocation; a host range must not touch GPU memory.
cudaError_t check_range(const char* call, const char* what, const void* p, size_t bytes,
                        bool device) {
  if (bytes == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device && find_locked(p, bytes) == nullptr)
    return fail(cudaErrorInvalidValue, std::string(call) + ": " + what + " " + hex(p) + " + " +
                                           std::to_string(bytes) +
                                           " bytes is not inside one GPU allocation");
  if (!device && find_locked(p, 1) != nullptr)
    return fail(cudaErrorInvalidValue,
                std::string(call) + ": " + what + " " + hex(p) + " is GPU memory, host expected");
  return cudaSuccess;
}

// How a copy stands with the compute stream (the legacy default stream, where the kernels run):
enum class Order {
  kCompute,        // cudaMemcpy, or cudaMemcpyAsync on a default stream: after its work
  kComputeQueued,  // the same, asynchronous
  kSideStream,     // cudaMemcpyAsync on a created stream: apart from the compute stream's work
};

// A copy to or from the host after the compute stream's work makes the host wait for that work
// (note_host_wait) unless it is queued and its host side page-locked; on a side stream it waits
// for that stream only, which is no drain of the compute stream.
cudaError_t copy(const char* call, void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                 Order order = Order::kCompute) {
  if (kind == cudaMemcpyDefault)
    kind = is_device(src) ? (is_device(dst) ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                          : (is_device(dst) ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if (cudaError_t e = check_range(call, "source", src, count, src_device); e != cudaSuccess)
    return e;
  if (cudaError_t e = check_range(call, "destination", dst, count, dst_device); e != cudaSuccess)
    return e;
  if (count > 0) std::memmove(dst, src, count);
  if (order == Order::kSideStream) return cudaSuccess;
  const void* host = kind == cudaMemcpyHostToDevice ? src : dst;
  if (kind != cudaMemcpyDeviceToDevice &&
      !(order == Order::kComputeQueued && is_page_locked(host, count)))
    loom::cuda_emu::note_host_wait();
  else
    loom::cuda_emu::note_queued();
  return cudaSuccess;
}

using Works = std::vector<std::shared_ptr<loom::cuda_emu::StreamWork>>;

bool all_done(const Works& works) {
  return std::all_of(works.begin(), works.end(), [](const auto& w) { return w->done.load(); });
}

void wait_for(const Works& works) {
  for (int polls = 0; !all_done(works); ++polls) {
    if (polls < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

struct CUevent_st {
  std::chrono::steady_clock::time_point at{};
  Works waits_for;           // the stream's unfinished work when recorded
  bool on_compute = true;    // recorded on a default stream, after the compute stream's work
};

struct CUstream_st {
  int device = 0;  // the GPU current when it was created: what cudaDeviceSynchronize waits on
  std::mutex mutex;
  Works pending;
  Works unfinished() {
    std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(pending, [](const auto& w) { return w->done.load(); });
    return pending;
  }
};

namespace {

std::mutex g_streams_mutex;
std::set<cudaStream_t>
    g_streams;  // created and not destroyed: what cudaDeviceSynchronize waits for (its GPU's)

bool is_created(cudaStream_t stream) {
  return stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread;
}

}  // namespace

namespace loom::cuda_emu {

void enqueue_on_stream(cudaStream_t stream, std::shared_ptr<StreamWork> work) {
  if (!is_created(stream)) {
    wait_for({std::move(work)});
    return;
  }
  std::lock_guard<std::mutex> lock(stream->mutex);
  stream->pending.push_back(std::move(work));
}

}  // namespace loom::cuda_emu

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = emulated_devices();
  return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice, "LOOM_CUDA_EMULATE_DEVICES is 0");
}

cudaError_t cudaGetLastError(void) {
  return std::exchange(t_last_error, cudaSuccess);
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorUnknown";
  }
}

// The error's meaning plus, from this emulator, what exactly was wrong with the last failed call.
const char* cudaGetErrorString(cudaError_t error) {
  thread_local std::string text;
  text = error == cudaSuccess ? "no error" : "emulated CUDA runtime";
  if (error != cudaSuccess && !t_detail.empty()) text += ": " + t_detail;
  return text.c_str();
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= emulated_devices())
    return fail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) + ") with " +
                                            std::to_string(emulated_devices()) + " GPUs");
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  const size_t rounded = (std::max<size_t>(size, 1) + 255) / 256 * 256;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_allocated[t_device] + rounded > kBytesPerGpu)
    return fail(cudaErrorMemoryAllocation, "cudaMalloc(" + std::to_string(size) + ")");
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) return fail(cudaErrorMemoryAllocation, "host memory exhausted");
  std::memset(p, 0xff, rounded);
  loom::cuda_emu::poison(static_cast<char*>(p) + size, rounded - size);  // past what was asked
  g_allocations[reinterpret_cast<uintptr_t>(p)] = {rounded, t_device};
  g_allocated[t_device] += rounded;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == g_allocations.end())
    return fail(cudaErrorInvalidValue, "cudaFree(" + hex(ptr) + "): not a GPU allocation");
  g_allocated[it->second.device] -= it->second.bytes;
  loom::cuda_emu::unpoison(ptr, it->second.bytes);
  g_allocations.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  if (const char* limit = std::getenv("LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB");
      limit != nullptr && *limit != '\0') {
    std::lock_guard<std::mutex> lock(g_mutex);
    size_t held = 0;
    for (const auto& [start, bytes] : g_page_locked) held += bytes;
    if (held + size > (static_cast<size_t>(std::max(std::atoll(limit), 0LL)) << 20))
      return fail(cudaErrorMemoryAllocation,
                  "cudaHostAlloc: past LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB = " + std::string(limit));
  }
  void* p = std::aligned_alloc(256, (std::max<size_t>(size, 1) + 255) / 256 * 256);
  if (p == nullptr) return fail(cudaErrorMemoryAllocation, "cudaHostAlloc: host memory exhausted");
  std::lock_guard<std::mutex> lock(g_mutex);
  g_page_locked[reinterpret_cast<uintptr_t>(p)] = size;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_page_locked.erase(reinterpret_cast<uintptr_t>(ptr)) == 0)
    return fail(cudaErrorInvalidValue, "cudaFreeHost(" + hex(ptr) + "): not from cudaHostAlloc");
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *total = kBytesPerGpu;
  *free_bytes = kBytesPerGpu - g_allocated[t_device];
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy("cudaMemcpy", dst, src, count, kind);
}

cudaError_t cudaMemcpyPeer(void* dst, int, const void* src, int, size_t count) {
  return copy("cudaMemcpyPeer", dst, src, count, cudaMemcpyDeviceToDevice);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  if (cudaError_t e = check_range("cudaMemsetAsync", "destination", ptr, count, true);
      e != cudaSuccess)
    return e;
  std::memset(ptr, value, count);
  loom::cuda_emu::note_queued();
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  loom::cuda_emu::note_host_wait();
  std::vector<cudaStream_t> streams;
  {
    std::lock_guard<std::mutex> lock(g_streams_mutex);
    streams.assign(g_streams.begin(), g_streams.end());
  }
  // The current GPU's streams only, as CUDA does: another GPU's may wait for this one (a peer's
  // collective), which a wait for every stream would deadlock on.
  for (cudaStream_t s : streams)
    if (s->device == t_device) wait_for(s->unfinished());
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy("cudaMemcpyAsync", dst, src, count, kind,
              is_created(stream) ? Order::kSideStream : Order::kComputeQueued);
}

// A side stream's synchronisation waits for that stream only: no drain of the compute stream.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (is_created(stream))
    wait_for(stream->unfinished());
  else
    loom::cuda_emu::note_host_wait();
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *attributes = {};
  if (const Allocation* a = find_locked(ptr, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = a->device;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -1;
    attributes->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= emulated_devices())
    return fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute on GPU " + std::to_string(device));
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = kSms;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    default:
      return fail(cudaErrorInvalidValue,
                  "cudaDeviceGetAttribute: attribute " + std::to_string(attr) + " not emulated");
  }
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  event->at = std::chrono::steady_clock::now();
  event->waits_for = is_created(stream) ? stream->unfinished() : Works{};
  event->on_compute = !is_created(stream);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event->on_compute) loom::cuda_emu::note_host_wait();
  wait_for(event->waits_for);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  return all_done(event->waits_for) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = new CUstream_st;
  (*stream)->device = t_device;
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  g_streams.insert(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mutex);
    g_streams.erase(stream);
  }
  delete stream;
  return cudaSuccess;
}

// A created stream takes on the event's unfinished work; the default streams run their kernels
// when launched, so the caller waits for it now.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  for (const auto& work : event->waits_for) loom::cuda_emu::enqueue_on_stream(stream, work);
  return cudaSuccess;
}

}  // extern "C"
