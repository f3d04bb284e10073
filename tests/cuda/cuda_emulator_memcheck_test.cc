// The CUDA emulator as a memory checker for GPU code (built with LOOM_CUDA_EMULATE only): GPU
// memory nobody wrote reads as NaN, fresh or from the caching allocator, as stale bytes on a GPU
// would read as garbage; copies refuse pointers on the wrong side; and under AddressSanitizer
// (preset cuda-emulated-asan) a kernel touching bytes past a tensor, or a block already given
// back to the allocator, is reported with the kernel's stack.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "base/error.h"
#include "device/allocator.h"
#include "device/cuda/cuda_backend.h"
#include "device/cuda/emulator/poison.h"
#include "device/cuda/emulator/scheduler.h"

namespace loom {
namespace {

// Reads `count` floats of GPU memory at `p` in a kernel (one thread per float) into the host.
std::vector<float> read_in_kernel(const float* p, int count) {
  std::vector<float> out(static_cast<size_t>(count));
  cuda_emu::run_kernel("read", {1}, {static_cast<unsigned>(count)}, [&] {
    out[cuda_emu::current().thread_idx.x] = p[cuda_emu::current().thread_idx.x];
  });
  return out;
}

TEST(CudaEmulatorMemcheck, UnwrittenGpuMemoryReadsAsNaN) {
  Allocator& gpu = allocator_for(Device::cuda(0));
  constexpr size_t kBytes = 40 * sizeof(float);
  auto* fresh = static_cast<float*>(gpu.allocate(kBytes));
  for (float v : read_in_kernel(fresh, 40)) EXPECT_TRUE(std::isnan(v));
  // Written, given back, taken again (the cache hands out the same block): stale no more.
  cuda_emu::run_kernel("write", {1}, {40}, [&] { fresh[cuda_emu::current().thread_idx.x] = 1.0f; });
  gpu.deallocate(fresh, kBytes);
  auto* reused = static_cast<float*>(gpu.allocate(kBytes));
  EXPECT_EQ(reused, fresh);
  for (float v : read_in_kernel(reused, 40)) EXPECT_TRUE(std::isnan(v));
  gpu.deallocate(reused, kBytes);
}

TEST(CudaEmulatorMemcheck, CopiesRefusePointersOnTheWrongSide) {
  std::vector<float> host(8, 1.0f);
  try {
    // A host pointer passed off as GPU memory.
    copy_bytes(host.data(), Device::cpu(), host.data(), Device::cuda(0), 32);
    FAIL() << "copy from a host pointer as GPU memory went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not inside one GPU allocation"), std::string::npos)
        << e.what();
  }
}

#ifdef LOOM_EMU_ASAN
class CudaEmulatorAsan : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(CudaEmulatorAsan, AKernelReadingPastATensorIsReported) {
  EXPECT_DEATH(
      {
        Allocator& gpu = allocator_for(Device::cuda(0));
        auto* x = static_cast<float*>(gpu.allocate(10 * sizeof(float)));
        (void)read_in_kernel(x, 11);  // one float too many
      },
      "use-after-poison|heap-buffer-overflow");
}

TEST_F(CudaEmulatorAsan, AKernelUsingAFreedBlockIsReported) {
  EXPECT_DEATH(
      {
        Allocator& gpu = allocator_for(Device::cuda(0));
        auto* x = static_cast<float*>(gpu.allocate(64 * sizeof(float)));
        gpu.deallocate(x, 64 * sizeof(float));
        (void)read_in_kernel(x, 32);  // the block is back in the cache
      },
      "use-after-poison");
}
#else
TEST(CudaEmulatorAsan, NeedsAddressSanitizer) {
  GTEST_SKIP() << "bounds and use-after-free checks need the preset cuda-emulated-asan";
}
#endif

}  // namespace
}  // namespace loom
