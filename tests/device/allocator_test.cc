#include "device/allocator.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "base/error.h"

namespace loom {
namespace {

TEST(CachingCpuAllocator, CountsInUseAndPeak) {
  CachingCpuAllocator a;
  void* p = a.allocate(1000);
  void* q = a.allocate(5000);
  const int64_t both = static_cast<int64_t>(CachingCpuAllocator::round_size(1000) +
                                            CachingCpuAllocator::round_size(5000));
  EXPECT_EQ(a.stats().bytes_in_use, both);
  a.deallocate(q, 5000);
  EXPECT_EQ(a.stats().bytes_in_use, static_cast<int64_t>(CachingCpuAllocator::round_size(1000)));
  EXPECT_EQ(a.stats().peak_bytes_in_use, both);
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes_in_use, a.stats().bytes_in_use);
  a.deallocate(p, 1000);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
}

TEST(CachingCpuAllocator, ReusesFreedBlocksAndAligns) {
  CachingCpuAllocator a;
  void* p = a.allocate(3 << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  std::memset(p, 1, 3 << 20);
  a.deallocate(p, 3 << 20);
  void* q = a.allocate((3 << 20) - 100);  // same size class
  EXPECT_EQ(p, q);
  EXPECT_EQ(a.stats().cache_hits, 1);
  a.deallocate(q, (3 << 20) - 100);
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_reserved, 0);
}

TEST(CachingCpuAllocator, SizeClassesCoverRequest) {
  for (size_t s : {1ul, 63ul, 64ul, 65ul, 4096ul, 4097ul, 100000ul, 1ul << 30})
    EXPECT_GE(CachingCpuAllocator::round_size(s), s);
  EXPECT_LE(CachingCpuAllocator::round_size(100000), 100000 * 9 / 8 + 64);
}

TEST(CachingCpuAllocator, ThreadSafe) {
  CachingCpuAllocator a;
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&a] {
      for (int i = 0; i < 200; ++i) {
        void* p = a.allocate(64 * (i % 7 + 1));
        a.deallocate(p, 64 * (i % 7 + 1));
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(a.stats().bytes_in_use, 0);
}

TEST(Device, ParseAndErrors) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu(0));
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cpu(2).str(), "cpu:2");
  EXPECT_THROW(Device::parse("tpu"), Error);
  EXPECT_THROW(Device::parse("cuda:x"), Error);
}

TEST(Device, PerDeviceAllocatorsAreSeparate) {
  Allocator& a = allocator_for(Device::cpu(7));
  Allocator& b = allocator_for(Device::cpu(8));
  EXPECT_NE(&a, &b);
  EXPECT_EQ(&a, &allocator_for(Device::cpu(7)));
}

}  // namespace
}  // namespace loom
