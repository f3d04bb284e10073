// Proves that NCCL is found, linked and loadable (the comm layer builds on it). ncclGetVersion
// needs no GPU, so this runs on every machine of the CUDA build.
#include <gtest/gtest.h>
#include <nccl.h>

namespace {

TEST(NcclLink, ReportsItsVersion) {
  int version = 0;
  const ncclResult_t result = ncclGetVersion(&version);
  ASSERT_EQ(result, ncclSuccess) << ncclGetErrorString(result);
  // The library may be newer than the header we compiled against, never of another major version
  // (NCCL_VERSION_CODE is major * 10000 + minor * 100 + patch since 2.9).
  EXPECT_EQ(version / 10000, NCCL_MAJOR)
      << "header " << NCCL_VERSION_CODE << ", library " << version;
  EXPECT_GE(version, NCCL_VERSION_CODE) << "libnccl is older than nccl.h";
  std::printf("NCCL header %d, library %d\n", NCCL_VERSION_CODE, version);
}

TEST(NcclLink, ErrorStringsComeFromTheLibrary) {
  EXPECT_STRNE(ncclGetErrorString(ncclInvalidArgument), "");
}

}  // namespace
