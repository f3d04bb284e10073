// The CUDA emulator's execution model (device/cuda/emulator/scheduler.h), on kernels written
// against it directly: every thread of a grid runs once with its indices, __syncthreads orders
// a block's shared-memory writes before the reads, warp shuffles exchange lanes' values, and what
// the GPU would hang on or leave undefined (a shuffle with exited lanes, a barrier some threads
// never reach, a bad launch shape) is an error naming the kernel. The CUDA kernels themselves run
// on it in the preset cuda-emulated (tests/cuda).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "device/cuda/emulator/scheduler.h"

namespace loom::cuda_emu {
namespace {

template <typename F>
void expect_error_mentioning(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected loom::Error";
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << needle << " in: " << e.what();
  }
}

int lane() {
  return lane_id();
}

float xor_shuffle(float v, int mask) {
  float out = 0;
  warp_exchange(&v, &out, sizeof v, lane() ^ mask);
  return out;
}

TEST(CudaEmulator, EveryThreadOfTheGridRunsOnceWithItsIndices) {
  const Dim3 grid{3, 2, 2}, block{4, 3, 2};
  std::vector<int> seen(3 * 2 * 2 * 4 * 3 * 2, 0);
  run_kernel("indices", grid, block, [&] {
    const ThreadIndices& t = current();
    EXPECT_EQ(t.block_dim.x, 4u);
    EXPECT_EQ(t.grid_dim.z, 2u);
    const unsigned block_id = (t.block_idx.z * 2 + t.block_idx.y) * 3 + t.block_idx.x;
    const unsigned thread_id = (t.thread_idx.z * 3 + t.thread_idx.y) * 4 + t.thread_idx.x;
    ++seen[block_id * 24 + thread_id];
  });
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "thread " << i;
}

// Each thread writes its slot, then (after the barrier) reads its neighbour's: without the
// barrier thread 0 would read slot 1 before thread 1 wrote it, as fibers run in order.
TEST(CudaEmulator, SyncThreadsOrdersWritesBeforeReads) {
  constexpr int kThreadsPerBlock = 256;
  std::vector<int> out(2 * kThreadsPerBlock, -1);
  run_kernel("neighbours", {2}, {kThreadsPerBlock}, [&] {
    static thread_local int slots[kThreadsPerBlock];  // what __shared__ becomes
    const int t = static_cast<int>(current().thread_idx.x);
    const int b = static_cast<int>(current().block_idx.x);
    slots[t] = 1000 * b + t;
    sync_threads();
    const int neighbour = slots[(t + 1) % kThreadsPerBlock];
    out[static_cast<size_t>(b * kThreadsPerBlock + t)] = neighbour;
  });
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < kThreadsPerBlock; ++t)
      EXPECT_EQ(out[static_cast<size_t>(b * kThreadsPerBlock + t)],
                1000 * b + (t + 1) % kThreadsPerBlock);
}

TEST(CudaEmulator, ThreadsThatExitCountAsArrivedAtTheBarrier) {
  std::vector<int> out(64, 0);
  run_kernel("early exit", {1}, {64}, [&] {
    const unsigned t = current().thread_idx.x;
    if (t >= 40) return;  // whole warps and a part of one
    sync_threads();
    out[t] = 1;
  });
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[static_cast<size_t>(t)], t < 40 ? 1 : 0);
}

TEST(CudaEmulator, XorShufflesSumAWarpInEveryLane) {
  std::vector<float> out(128);
  run_kernel("warp sum", {1}, {128}, [&] {
    const unsigned t = current().thread_idx.x;
    float v = static_cast<float>(t);
    for (int offset = 16; offset > 0; offset >>= 1) v += xor_shuffle(v, offset);
    out[t] = v;
  });
  for (unsigned t = 0; t < 128; ++t) {
    const unsigned w = t / 32;
    const float want = static_cast<float>(32 * (32 * w) + 31 * 32 / 2);
    EXPECT_EQ(out[t], want) << "lane " << t % 32 << " of warp " << w;
  }
}

// The fragments built from PTX's own formulas (lane → element, "Matrix Fragments for
// mma.m16n8k16 with floating point type"); small integers, so every sum is exact. Two warps, so
// one warp's fragments do not leak into the other's.
TEST(CudaEmulator, TensorCoreMmaComputesDPlusABOverPtxFragments) {
  const auto a_value = [](int w, int r, int k) {
    return static_cast<float>((r * 5 + k * 3 + w) % 7 - 3);
  };
  const auto b_value = [](int w, int k, int n) {
    return static_cast<float>((k * 2 + n * 3 + w) % 5 - 2);
  };
  const auto c_value = [](int r, int n) { return static_cast<float>(r - n); };
  const auto bf16_bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u >> 16;  // exact: small integers
  };
  std::vector<float> got(2 * 16 * 8, -1000.0f);
  run_kernel("mma", {1}, {64}, [&] {
    const int lane = static_cast<int>(current().thread_idx.x % 32),
              w = static_cast<int>(current().thread_idx.x / 32), g = lane >> 2, t = lane % 4;
    uint32_t a[4] = {}, b[2] = {};
    float d[4];
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      a[i / 2] |= bf16_bits(a_value(w, row, col)) << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) {
      const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      b[i / 2] |= bf16_bits(b_value(w, row, g)) << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) d[i] = c_value(i < 2 ? g : g + 8, t * 2 + (i & 1));
    warp_mma_m16n8k16_bf16(d, a, b);
    for (int i = 0; i < 4; ++i)
      got[static_cast<size_t>(w * 128 + (i < 2 ? g : g + 8) * 8 + t * 2 + (i & 1))] = d[i];
  });
  for (int w = 0; w < 2; ++w)
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) {
        float want = c_value(r, n);
        for (int k = 0; k < 16; ++k) want += a_value(w, r, k) * b_value(w, k, n);
        EXPECT_EQ(got[static_cast<size_t>(w * 128 + r * 8 + n)], want)
            << "warp " << w << " D(" << r << ", " << n << ")";
      }
}

// ldmatrix .x4, plain and .trans, with each matrix's rows scattered in memory (a row is any 16
// bytes a lane points at): lane l holds row l / 4 (or, transposed, column l / 4), elements
// 2·(l % 4) and the next, of matrix i in r[i] — PTX's "a group of four threads loads an entire
// row", "thread 0 receiving the first fragment".
TEST(CudaEmulator, LdmatrixGivesEachLaneItsFragmentOfFourMatrices) {
  // Matrix i, row r, column c holds 1000·i + 10·r + c; row r of matrix i lives at buffer row
  // (5·(8·i + r) + 3) % 32, 12 values apart.
  constexpr int kLd = 12;
  std::vector<uint16_t> buffer(32 * kLd, 0xffff);
  const auto slot = [](int i, int r) { return (5 * (8 * i + r) + 3) % 32; };
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 8; ++c)
        buffer[static_cast<size_t>(slot(i, r) * kLd + c)] =
            static_cast<uint16_t>(1000 * i + 10 * r + c);
  for (bool transposed : {false, true}) {
    std::vector<uint32_t> got(32 * 4);
    run_kernel("ldmatrix", {1}, {32}, [&] {
      const int lane = static_cast<int>(current().thread_idx.x);
      uint32_t r[4];
      warp_ldmatrix_x4(r, buffer.data() + slot(lane / 8, lane % 8) * kLd, transposed);
      for (int i = 0; i < 4; ++i) got[static_cast<size_t>(lane * 4 + i)] = r[i];
    });
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const int a = lane / 4, b = 2 * (lane % 4);  // row, column (swapped when transposed)
        const uint32_t lo = transposed ? 1000 * i + 10 * b + a : 1000 * i + 10 * a + b;
        const uint32_t hi = transposed ? lo + 10 : lo + 1;
        EXPECT_EQ(got[static_cast<size_t>(lane * 4 + i)], lo | hi << 16)
            << (transposed ? "trans " : "") << "lane " << lane << " matrix " << i;
      }
  }
}

// cp.async lands when its thread waits for its group, the destination garbage before: wait_group 1
// completes all but the newest group; bytes past src_bytes are zeros; exiting with copies never
// waited for is an error.
TEST(CudaEmulator, AsyncCopiesLandWhenTheirGroupIsWaitedFor) {
  constexpr int kThreads = 64;
  std::vector<uint32_t> src(kThreads * 8), dst(kThreads * 8, 7);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(100 + i);
  std::vector<int> before(kThreads), between(kThreads), after(kThreads);
  run_kernel("cp.async", {1}, {kThreads}, [&] {
    const int t = static_cast<int>(current().thread_idx.x);
    uint32_t* first = dst.data() + 8 * t;  // 16 bytes, then 16 more
    cp_async_16(first, src.data() + 8 * t, 16);
    cp_async_commit();
    cp_async_16(first + 4, src.data() + 8 * t + 4, 4);  // one value, then zeros
    cp_async_commit();
    before[t] = first[0] == 0xffffffffu && first[4] == 0xffffffffu;  // garbage until the wait
    cp_async_wait(1);
    between[t] = first[0] == src[8 * t] && first[3] == src[8 * t + 3] && first[4] == 0xffffffffu;
    cp_async_wait(0);
    after[t] = first[4] == src[8 * t + 4] && first[5] == 0 && first[7] == 0;
  });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(before[t]) << "thread " << t << ": a copy landed before its wait";
    EXPECT_TRUE(between[t]) << "thread " << t << ": wait_group 1";
    EXPECT_TRUE(after[t]) << "thread " << t << ": wait_group 0 and the zero fill";
  }
  expect_error_mentioning(
      [&] {
        run_kernel("unwaited copy", {1}, {32}, [&] {
          cp_async_16(dst.data(), src.data(), 16);
          cp_async_commit();
        });
      },
      {"unwaited copy", "exited with cp.async copies it never waited for"});
}

TEST(CudaEmulator, ShuffleFromAMissingLaneGivesTheLanesOwnValue) {
  std::vector<double> out(32);
  run_kernel("shuffle down", {1}, {32}, [&] {
    const unsigned t = current().thread_idx.x;
    double v = t, got = 0;
    warp_exchange(&v, &got, sizeof v, static_cast<int>(t) + 4);  // __shfl_down_sync(.., 4)
    out[t] = got;
  });
  for (unsigned t = 0; t < 32; ++t) EXPECT_EQ(out[t], t + 4 < 32 ? t + 4 : t);
}

TEST(CudaEmulator, ShuffleWithAnExitedLaneIsAnError) {
  expect_error_mentioning(
      [] {
        run_kernel("ragged shuffle", {1}, {32}, [] {
          if (current().thread_idx.x == 7) return;
          (void)xor_shuffle(1.0f, 1);
        });
      },
      {"ragged shuffle", "thread (7, 0, 0) exited", "waits in a warp shuffle"});
}

TEST(CudaEmulator, ABarrierSomeThreadsNeverReachIsADeadlockError) {
  expect_error_mentioning(
      [] {
        run_kernel("split warp", {1}, {32}, [] {
          if (current().thread_idx.x < 16)
            sync_threads();
          else
            (void)xor_shuffle(1.0f, 1);
        });
      },
      {"split warp", "deadlocked", "16 thread(s) wait at __syncthreads", "16 in warp shuffles"});
  // The emulator is usable again after an error.
  int ran = 0;
  run_kernel("after", {2}, {32}, [&] { ++ran; });
  EXPECT_EQ(ran, 64);
}

TEST(CudaEmulator, BadLaunchShapesAreRefused) {
  expect_error_mentioning([] { run_kernel("too wide", {1}, {1025}, [] {}); },
                          {"too wide", "1 to 1024 threads"});
  expect_error_mentioning(
      [] {
        run_kernel("too tall", {1, 65536}, {32}, [] {});
      },
      {"too tall", "65535"});
  expect_error_mentioning([] { run_kernel("empty", {0}, {32}, [] {}); }, {"empty"});
  expect_error_mentioning([] { (void)current(); }, {"outside a kernel"});
}

// Host threads (thread ranks) emulate their kernels independently, with their own shared memory.
TEST(CudaEmulator, HostThreadsRunKernelsIndependently) {
  std::vector<long> totals(4, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([&, r] {
      for (int rep = 0; rep < 20; ++rep)
        run_kernel("per rank", {3}, {64}, [&] {
          static thread_local long block_total[1];
          const unsigned t = current().thread_idx.x;
          if (t == 0) block_total[0] = 0;
          sync_threads();
          if (t % 32 == 0) block_total[0] += r + 1;  // one lane per warp: 2 warps
          sync_threads();
          if (t == 0) totals[static_cast<size_t>(r)] += block_total[0];
        });
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(totals[static_cast<size_t>(r)], 20 * 3 * 2 * (r + 1));
}

}  // namespace
}  // namespace loom::cuda_emu
