// The device layer's answers when CUDA is not usable: built without it (the stub), or built with
// it but asked for a GPU that does not exist. Both must be a loom::Error that says what to do.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/error.h"
#include "device/allocator.h"
#include "device/cuda/cuda_backend.h"
#if defined(LOOM_WITH_CUDA)
#include "device/cuda/cuda_check.h"
#endif

namespace loom {
namespace {

// Runs `f`, expecting a loom::Error whose message contains `needle`.
template <typename F>
void expect_error_mentioning(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected loom::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

#if !defined(LOOM_WITH_CUDA)

TEST(CudaStub, ReportsNoGpu) {
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_FALSE(cuda_available());
  EXPECT_NE(cuda::unavailable_reason().find("LOOM_CUDA"), std::string::npos);
}

TEST(CudaStub, AllocatorNamesTheBuildOption) {
  expect_error_mentioning([] { allocator_for(Device::cuda(0)); }, "LOOM_CUDA");
  expect_error_mentioning([] { cuda::make_cuda_allocator(0); }, "LOOM_CUDA");
}

TEST(CudaStub, CopiesAndKernelsRefuse) {
  std::vector<char> host(16);
  expect_error_mentioning(
      [&] { copy_bytes(host.data(), Device::cuda(0), host.data(), Device::cpu(), host.size()); },
      "LOOM_CUDA");
  float x = 1.0f;
  expect_error_mentioning([&] { cuda::axpy_f32(0, 1, 2.0f, &x, &x, &x); }, "LOOM_CUDA");
  // Host-to-host copies never touch the CUDA side.
  std::vector<char> dst(16, 1);
  copy_bytes(dst.data(), Device::cpu(), host.data(), Device::cpu(), host.size());
  EXPECT_EQ(dst, host);
}

#else  // built with CUDA

// One past the last GPU is refused with the count, whether or not this machine has a GPU.
TEST(CudaBuild, NonexistentGpuIsAnError) {
  const int n = cuda::device_count();
  expect_error_mentioning([&] { cuda::make_cuda_allocator(n); },
                          "cuda:" + std::to_string(n) + " does not exist");
  expect_error_mentioning([] { cuda::make_cuda_allocator(-1); }, "does not exist");
}

TEST(CudaBuild, AvailabilityAgreesWithTheReason) {
  EXPECT_GE(cuda::device_count(), 0);
  EXPECT_EQ(cuda_available(), cuda::device_count() > 0);
  EXPECT_EQ(cuda_available(), cuda::unavailable_reason().empty()) << cuda::unavailable_reason();
  if (!cuda_available()) std::printf("no GPU here: %s\n", cuda::unavailable_reason().c_str());
}

// The wrapper every CUDA call goes through names the place, the call and CUDA's own words.
cudaError_t pretend_out_of_memory() {
  return cudaErrorMemoryAllocation;
}

TEST(CudaBuild, CheckMacroReportsTheCallAndCudasErrorString) {
  const int line = __LINE__ + 1;
  auto check = [] { LOOM_CUDA_CHECK(pretend_out_of_memory()); };
  expect_error_mentioning(check, "cuda_stub_test.cc:" + std::to_string(line));
  expect_error_mentioning(check, "pretend_out_of_memory()");
  expect_error_mentioning(check, "cudaErrorMemoryAllocation");
  expect_error_mentioning(check, cudaGetErrorString(cudaErrorMemoryAllocation));
  LOOM_CUDA_CHECK(cudaSuccess);  // and success passes through
}

#endif

}  // namespace
}  // namespace loom
