// Device requirements of multi-rank tests (thread and process ranks alike).
//
//   TEST(NcclAllReduce, TwoGpus) {
//     LOOM_SKIP_UNLESS_CUDA_DEVICES(2);  // reported as skipped, with the reason, not as passed
//     ...
//   }
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace loom::testing {

// "" when at least `n` CUDA devices are visible, else why not ("needs 2 CUDA devices, 0
// visible: built without CUDA (LOOM_CUDA=OFF)").
std::string cuda_devices_missing(int n);

}  // namespace loom::testing

// Skips the current test when fewer than n CUDA devices are visible (cuda::device_count()). A
// macro, so that the GTEST_SKIP returns from the test itself rather than from a helper.
#define LOOM_SKIP_UNLESS_CUDA_DEVICES(n)                                                \
  do {                                                                                  \
    const std::string loom_missing_devices_ = ::loom::testing::cuda_devices_missing(n); \
    if (!loom_missing_devices_.empty()) GTEST_SKIP() << loom_missing_devices_;          \
  } while (0)
