// The CUDA backend against the host: copies must round-trip bit for bit, axpy must equal the CPU
// computation bit for bit (both use one fma rounding), the allocator must count what it holds.
// Every test skips on a machine without a GPU, printing the CUDA runtime's reason.
#include "device/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "device/allocator.h"
#ifdef LOOM_CUDA_EMULATE
#include <cuda_runtime_api.h>

#include "device/cuda/emulator/scheduler.h"
#endif
#include "tensor/tensor.h"

namespace loom {
namespace {

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no GPU: " << cuda::unavailable_reason();
  }
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> out(n);
  for (auto& v : out) v = dist(rng);
  return out;
}

// A device buffer from `alloc`, freed at the end of the scope.
struct DeviceBuffer {
  DeviceBuffer(Allocator& alloc, size_t bytes) : alloc_(alloc), bytes_(bytes) {
    ptr = alloc.allocate(bytes);
  }
  ~DeviceBuffer() { alloc_.deallocate(ptr, bytes_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }

  void* ptr = nullptr;

 private:
  Allocator& alloc_;
  size_t bytes_;
};

const Device kGpu = Device::cuda(0);
const Device kHost = Device::cpu();

TEST_F(CudaBackendTest, HostDeviceHostRoundTripIsBitwise) {
  auto alloc = cuda::make_cuda_allocator(0);
  for (size_t bytes : {size_t{1}, size_t{4097}, size_t{(3 << 20) + 13}}) {
    const std::vector<uint8_t> src = random_bytes(bytes, static_cast<uint32_t>(bytes));
    DeviceBuffer dev(*alloc, bytes);
    copy_bytes(dev.ptr, kGpu, src.data(), kHost, bytes);
    std::vector<uint8_t> back(bytes, 0);
    copy_bytes(back.data(), kHost, dev.ptr, kGpu, bytes);
    EXPECT_EQ(back, src) << bytes << " bytes";
  }
}

TEST_F(CudaBackendTest, DeviceToDeviceCopy) {
  auto alloc = cuda::make_cuda_allocator(0);
  const size_t bytes = (5 << 20) + 3;
  const std::vector<uint8_t> src = random_bytes(bytes, 7);
  DeviceBuffer a(*alloc, bytes), b(*alloc, bytes);
  copy_bytes(a.ptr, kGpu, src.data(), kHost, bytes);
  copy_bytes(b.ptr, kGpu, a.ptr, kGpu, bytes);
  std::vector<uint8_t> back(bytes, 0);
  copy_bytes(back.data(), kHost, b.ptr, kGpu, bytes);
  EXPECT_EQ(back, src);
}

// A queued copy (copy_bytes_queued: on the compute stream, not waited for) is ordered with what
// follows on that stream: a chain of them, a kernel after them and a copy to the host see their
// bytes; on the host it is a memcpy.
TEST_F(CudaBackendTest, QueuedCopiesAreOrderedWithTheStream) {
  auto alloc = cuda::make_cuda_allocator(0);
  const size_t n = (1 << 20) + 5, bytes = n * sizeof(float);
  std::vector<float> src(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i % 1000) * 0.5f;
  DeviceBuffer a(*alloc, bytes), b(*alloc, bytes), c(*alloc, bytes);
  copy_bytes(a.ptr, kGpu, src.data(), kHost, bytes);
  copy_bytes_queued(b.ptr, a.ptr, kGpu, bytes);
  copy_bytes_queued(c.ptr, b.ptr, kGpu, bytes);
  // c = 2·c + a, after the copies on the same stream.
  cuda::axpy_f32(0, static_cast<int64_t>(n), 2.0f, static_cast<const float*>(c.ptr),
                 static_cast<const float*>(a.ptr), static_cast<float*>(c.ptr));
  std::vector<float> back(n, -1.0f);
  copy_bytes(back.data(), kHost, c.ptr, kGpu, bytes);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], 3.0f * src[i]) << i;
  std::vector<float> host(n, 0.0f);
  copy_bytes_queued(host.data(), src.data(), kHost, bytes);
  EXPECT_EQ(host, src);
}

// An upload that does not wait (copy_bytes_from_host_queued: through page-locked staging, queued
// on the compute stream): its source may be overwritten as soon as it returns, uploads in a row
// (more than one staging block in flight, of different sizes) land in order, a kernel queued
// after them reads them; on the host it is a memcpy. Under the CUDA emulator: none of them makes
// the host wait for the GPU, where a copy_bytes from the host does.
TEST_F(CudaBackendTest, QueuedUploadsLeaveTheSourceFreeAndAreOrderedWithTheStream) {
  auto alloc = cuda::make_cuda_allocator(0);
  const size_t n = (1 << 18) + 3, bytes = n * sizeof(float);
  DeviceBuffer a(*alloc, bytes), b(*alloc, bytes), small(*alloc, 64);
  std::vector<float> host = random_floats(n, 1);
  const std::vector<float> first = host;
#ifdef LOOM_CUDA_EMULATE
  copy_bytes_queued(b.ptr, a.ptr, kGpu, 64);  // work queued before, not waited for
  const int64_t waits_before = cuda_emu::host_activity().host_waits;
#endif
  copy_bytes_from_host_queued(a.ptr, kGpu, host.data(), bytes);
  for (float& v : host) v = -v;  // the source, overwritten at once
  copy_bytes_from_host_queued(b.ptr, kGpu, host.data(), bytes);
  const char tag[] = "sixteen bytes!!";
  copy_bytes_from_host_queued(small.ptr, kGpu, tag, sizeof tag);
#ifdef LOOM_CUDA_EMULATE
  EXPECT_EQ(cuda_emu::host_activity().host_waits, waits_before) << "an upload waited";
#endif
  // b = 2·a + b after the uploads on the same stream: a's first values, b their negatives.
  cuda::axpy_f32(0, static_cast<int64_t>(n), 2.0f, a.as<float>(), b.as<float>(), b.as<float>());
  std::vector<float> back(n), back_a(n);
  char tag_back[sizeof tag] = {};
  copy_bytes(back.data(), kHost, b.ptr, kGpu, bytes);
  copy_bytes(back_a.data(), kHost, a.ptr, kGpu, bytes);
  copy_bytes(tag_back, kHost, small.ptr, kGpu, sizeof tag);
  EXPECT_EQ(back_a, first);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], std::fma(2.0f, first[i], -first[i])) << i;
  EXPECT_STREQ(tag_back, tag);
#ifdef LOOM_CUDA_EMULATE
  const int64_t waits_after_reads = cuda_emu::host_activity().host_waits;
  EXPECT_GT(waits_after_reads, waits_before);  // reading back waits
  copy_bytes_queued(small.ptr, a.ptr, kGpu, 64);
  copy_bytes(a.ptr, kGpu, host.data(), kHost, sizeof(float));  // from pageable memory: waits
  EXPECT_EQ(cuda_emu::host_activity().host_waits, waits_after_reads + 1);
#endif
  std::vector<float> on_host(n, 0.0f);
  copy_bytes_from_host_queued(on_host.data(), kHost, host.data(), bytes);
  EXPECT_EQ(on_host, host);
}

// Where page-locked memory cannot be had (a container's locked-memory limit; here the emulator's
// LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB = 0), a queued upload is a plain synchronous copy: it waits
// for the work queued before it, and is still right, the source free at once; the refused
// cudaHostAlloc leaves no error behind for the next call to trip on.
TEST_F(CudaBackendTest, QueuedUploadsFallBackToSynchronousCopiesWithoutPageLockedMemory) {
#ifndef LOOM_CUDA_EMULATE
  GTEST_SKIP() << "the emulator refuses page-locked memory on request; a GPU does not";
#else
  auto alloc = cuda::make_cuda_allocator(0);
  // Larger than any staging block the other tests left, so that the upload needs a new one.
  const size_t n = (3 << 20) + 5, bytes = n * sizeof(float);
  DeviceBuffer a(*alloc, bytes), b(*alloc, bytes);
  std::vector<float> host = random_floats(n, 4);
  const std::vector<float> first = host;
  ASSERT_EQ(setenv("LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB", "0", 1), 0);
  copy_bytes_queued(b.ptr, a.ptr, kGpu, 64);  // work queued before, not waited for
  const int64_t waits_before = cuda_emu::host_activity().host_waits;
  copy_bytes_from_host_queued(a.ptr, kGpu, host.data(), bytes);
  EXPECT_EQ(cuda_emu::host_activity().host_waits, waits_before + 1)
      << "without page-locked memory the upload is synchronous";
  unsetenv("LOOM_CUDA_EMULATE_PAGE_LOCKED_MIB");
  for (float& v : host) v = -v;  // the source, overwritten at once
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the refusal left an error behind";
  cuda::axpy_f32(0, static_cast<int64_t>(n), 1.0f, a.as<float>(), a.as<float>(), b.as<float>());
  std::vector<float> back(n);
  copy_bytes(back.data(), kHost, b.ptr, kGpu, bytes);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], 2.0f * first[i]) << i;
#endif
}

TEST_F(CudaBackendTest, CopyBetweenTwoGpus) {
  if (cuda::device_count() < 2)
    GTEST_SKIP() << "needs two GPUs, " << cuda::device_count() << " visible";
  auto alloc0 = cuda::make_cuda_allocator(0);
  auto alloc1 = cuda::make_cuda_allocator(1);
  const size_t bytes = (2 << 20) + 5;
  const std::vector<uint8_t> src = random_bytes(bytes, 11);
  DeviceBuffer a(*alloc0, bytes), b(*alloc1, bytes);
  copy_bytes(a.ptr, kGpu, src.data(), kHost, bytes);
  copy_bytes(b.ptr, Device::cuda(1), a.ptr, kGpu, bytes);
  std::vector<uint8_t> back(bytes, 0);
  copy_bytes(back.data(), kHost, b.ptr, Device::cuda(1), bytes);
  EXPECT_EQ(back, src);
}

// Sizes: one element, a ragged tail, and more elements than the grid has threads (the
// grid-stride loop must go round).
TEST_F(CudaBackendTest, AxpyMatchesTheCpuBitwise) {
  auto alloc = cuda::make_cuda_allocator(0);
  for (int64_t n : {int64_t{1}, int64_t{1000003}, int64_t{(1 << 24) + 7}}) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    const float a = -1.75f;
    const std::vector<float> x = random_floats(static_cast<size_t>(n), 1);
    const std::vector<float> y = random_floats(static_cast<size_t>(n), 2);
    DeviceBuffer dx(*alloc, bytes), dy(*alloc, bytes), dout(*alloc, bytes);
    copy_bytes(dx.ptr, kGpu, x.data(), kHost, bytes);
    copy_bytes(dy.ptr, kGpu, y.data(), kHost, bytes);
    cuda::axpy_f32(0, n, a, dx.as<float>(), dy.as<float>(), dout.as<float>());
    std::vector<float> out(static_cast<size_t>(n));
    copy_bytes(out.data(), kHost, dout.ptr, kGpu, bytes);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float want = std::fma(a, x[i], y[i]);
      if (std::memcmp(&out[i], &want, sizeof(float)) != 0 && mismatches++ < 5)
        ADD_FAILURE() << "n=" << n << " i=" << i << ": got " << out[i] << ", want " << want;
    }
    EXPECT_EQ(mismatches, 0) << "n=" << n;
  }
}

TEST_F(CudaBackendTest, AxpyInPlace) {
  auto alloc = cuda::make_cuda_allocator(0);
  const std::vector<float> x = {1, 2, 3}, y = {10, 20, 30};
  DeviceBuffer dx(*alloc, 12), dy(*alloc, 12);
  copy_bytes(dx.ptr, kGpu, x.data(), kHost, 12);
  copy_bytes(dy.ptr, kGpu, y.data(), kHost, 12);
  cuda::axpy_f32(0, 3, 2.0f, dx.as<float>(), dy.as<float>(), dy.as<float>());  // y = 2x + y
  std::vector<float> out(3);
  copy_bytes(out.data(), kHost, dy.ptr, kGpu, 12);
  EXPECT_EQ(out, (std::vector<float>{12, 24, 36}));
}

TEST_F(CudaBackendTest, AxpyRejectsHostPointersAndNegativeSizes) {
  auto alloc = cuda::make_cuda_allocator(0);
  DeviceBuffer d(*alloc, 16);
  std::vector<float> host(4, 1.0f);
  EXPECT_THROW(cuda::axpy_f32(0, 4, 1.0f, host.data(), d.as<float>(), d.as<float>()), Error);
  EXPECT_THROW(cuda::axpy_f32(0, -1, 1.0f, d.as<float>(), d.as<float>(), d.as<float>()), Error);
  cuda::axpy_f32(0, 0, 1.0f, nullptr, nullptr, nullptr);  // nothing to do, nothing checked
  // The context survived: the backend still works.
  cuda::axpy_f32(0, 4, 1.0f, d.as<float>(), d.as<float>(), d.as<float>());
}

TEST_F(CudaBackendTest, AllocatorCountsBytesPeakAndCache) {
  auto alloc = cuda::make_cuda_allocator(0);
  constexpr size_t kSmall = 1 << 20, kLarge = 4 << 20;  // both exact size classes
  void* p = alloc->allocate(kSmall);
  void* q = alloc->allocate(kLarge);
  MemoryStats s = alloc->stats();
  EXPECT_EQ(s.bytes_in_use, int64_t{kSmall + kLarge});
  EXPECT_EQ(s.peak_bytes_in_use, int64_t{kSmall + kLarge});
  EXPECT_EQ(s.bytes_reserved, int64_t{kSmall + kLarge});
  EXPECT_EQ(s.allocations, 2);

  alloc->deallocate(q, kLarge);
  s = alloc->stats();
  EXPECT_EQ(s.bytes_in_use, int64_t{kSmall});
  EXPECT_EQ(s.peak_bytes_in_use, int64_t{kSmall + kLarge});
  EXPECT_EQ(s.bytes_reserved, int64_t{kSmall + kLarge});  // cached, not returned

  void* r = alloc->allocate(kLarge - 1000);  // same size class: served from the cache
  EXPECT_EQ(r, q);
  EXPECT_EQ(alloc->stats().cache_hits, 1);
  EXPECT_EQ(alloc->stats().bytes_reserved, int64_t{kSmall + kLarge});
  alloc->deallocate(r, kLarge - 1000);

  alloc->reset_peak();
  EXPECT_EQ(alloc->stats().peak_bytes_in_use, int64_t{kSmall});
  alloc->release_cached();
  EXPECT_EQ(alloc->stats().bytes_reserved, int64_t{kSmall});
  alloc->deallocate(p, kSmall);
  EXPECT_EQ(alloc->stats().bytes_in_use, 0);
}

TEST_F(CudaBackendTest, OutOfMemoryIsAnErrorWithTheNumbers) {
  auto alloc = cuda::make_cuda_allocator(0);
  try {
    alloc->allocate(size_t{1} << 50);  // 1 PiB
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of GPU memory on cuda:0"), std::string::npos)
        << e.what();
  }
  void* p = alloc->allocate(1024);  // and the allocator still works
  alloc->deallocate(p, 1024);
}

TEST_F(CudaBackendTest, TensorsLiveOnTheGpu) {
  const MemoryStats before = allocator_for(kGpu).stats();
  {
    Tensor t = Tensor::empty({3, 5}, DType::kF32, kGpu);
    EXPECT_EQ(t.device(), kGpu);
    EXPECT_EQ(allocator_for(kGpu).stats().bytes_in_use, before.bytes_in_use + 512);

    Tensor host = Tensor::from_vector(random_floats(15, 3), {3, 5});
    Tensor gpu = host.to(kGpu);
    EXPECT_EQ(gpu.device(), kGpu);
    EXPECT_EQ(gpu.shape(), host.shape());
    EXPECT_EQ(gpu.to_vector(), host.to_vector());  // to_vector copies back to the host
    Tensor again = gpu.to(kGpu);                   // device -> device
    EXPECT_EQ(again.to(kHost).to_vector(), host.to_vector());

    Tensor z = Tensor::zeros({1000}, DType::kF32, kGpu);
    EXPECT_EQ(z.to_vector(), std::vector<float>(1000, 0.0f));
  }
  EXPECT_EQ(allocator_for(kGpu).stats().bytes_in_use, before.bytes_in_use);
}

}  // namespace
}  // namespace loom
