#include "comm/comm_bench.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "base/error.h"

namespace loom {
namespace {

TEST(CommBench, BusBandwidthFactorsFollowNcclTests) {
  EXPECT_DOUBLE_EQ(busbw_factor("all_reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(busbw_factor("all_gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(busbw_factor("reduce_scatter", 2), 0.5);
  EXPECT_DOUBLE_EQ(busbw_factor("broadcast", 8), 1.0);
  EXPECT_THROW(busbw_factor("all_reduse", 2), Error);
}

TEST(CommBench, AllReduceCeilingIsBTimesNMinusOneOverNSquared) {
  // busbw <= B (n-1) / n^2 (an in-place all-reduce reads and writes each buffer once).
  EXPECT_DOUBLE_EQ(busbw_ceiling("all_reduce", 2, 40.0), 40.0 * 1 / 4);
  EXPECT_DOUBLE_EQ(busbw_ceiling("all_reduce", 4, 40.0), 40.0 * 3 / 16);
}

TEST(CommBench, ParsesSizes) {
  EXPECT_EQ(parse_sizes("1M,16M,64M"), (std::vector<int64_t>{1 << 20, 16 << 20, 64 << 20}));
  EXPECT_EQ(parse_sizes("4096,2k,1G"), (std::vector<int64_t>{4096, 2048, int64_t{1} << 30}));
  EXPECT_THROW(parse_sizes("1M,,2M"), Error);
  EXPECT_THROW(parse_sizes("lots"), Error);
}

TEST(CommBench, MemcpyBandwidthIsPositive) { EXPECT_GT(measure_memcpy_gbps(1, 1 << 20), 0.1); }

TEST(CommBench, MemcpyProbeTakesTheFasterCopy) {
  const MemcpyProbe p = probe_memcpy_bandwidth(2, 8 << 20, 2);
  EXPECT_EQ(p.threads, 2);
  EXPECT_EQ(p.bytes_per_thread, 2 << 20);  // source + destination of 2 threads = 8 MiB
  EXPECT_GT(p.memcpy_gbps, 0.1);
  EXPECT_DOUBLE_EQ(p.gbps, std::max(p.memcpy_gbps, p.stream_gbps));
  EXPECT_EQ(p.method, p.stream_gbps > p.memcpy_gbps ? "avx2 streaming-store copy" : "glibc memcpy");
}

}  // namespace
}  // namespace loom
