// Tests of the nccl backend, in the style of nccl-tests: small-integer inputs whose exact outputs
// are computed on the host, compared exactly (average: within a few ulp, NCCL pre-multiplies
// floats by 1/n). A group of one runs on any machine with a GPU (NCCL refuses two ranks on one
// GPU); the multi-rank tests run thread ranks over a local bootstrap, one GPU per rank, and skip
// when there are fewer GPUs than ranks. Without a GPU every test skips except the one that
// checks the error make_nccl_world gives then.
#include "comm/nccl/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "comm/flight_recorder.h"
#include "comm/host_tensors.h"
#include "comm/local/local_backend.h"
#include "device/cuda/cuda_backend.h"
#include "harness/error_of.h"
#include "harness/thread_ranks.h"

namespace loom {
namespace {

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

const DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kBF16,
                            DType::kF16, DType::kI32, DType::kI64};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

// A GPU tensor of `dtype` holding `values` (small integers: exact in every dtype).
Tensor gpu_tensor(const std::vector<double>& values, DType dtype, int device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, dtype);
  for (size_t i = 0; i < values.size(); ++i)
    loom::testing::set_value(t, static_cast<int64_t>(i), values[i]);
  return t.to(Device::cuda(device));
}

std::vector<double> host_values(const Tensor& gpu) {
  const Tensor t = gpu.to(Device::cpu());
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = loom::testing::get_value(t, static_cast<int64_t>(i));
  return out;
}

// Rank r's input element i: small integers of both signs, distinct per rank.
double input(int r, int64_t i) {
  return static_cast<double>((r + 1) * (i % 7 - 3));
}
std::vector<double> inputs(int r, int64_t n, int64_t offset = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = input(r, offset + i);
  return v;
}

// op over ranks 0..size-1 of input(r, i), as the backend must compute it (avg: exact sum / n,
// integer division truncating toward zero for i32/i64).
double reduced(ReduceOp op, DType dtype, int size, int64_t i) {
  double acc = input(0, i);
  for (int r = 1; r < size; ++r) {
    const double x = input(r, i);
    acc = op == ReduceOp::kMax   ? std::max(acc, x)
          : op == ReduceOp::kMin ? std::min(acc, x)
                                 : acc + x;
  }
  if (op != ReduceOp::kAvg) return acc;
  return is_floating(dtype) ? acc / size : std::trunc(acc / size);
}

// Exact, except avg on floats: within 2 ulp (f32/f64) or `size` ulp (16-bit, one rounding per
// addition) of the exact quotient.
void expect_values(const std::vector<double>& got, const std::function<double(int64_t)>& want,
                   DType dtype, ReduceOp op, int size, const std::string& what) {
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want(static_cast<int64_t>(i));
    if (op == ReduceOp::kAvg && is_floating(dtype)) {
      const double eps = dtype == DType::kF32    ? 0x1p-23
                         : dtype == DType::kF64  ? 0x1p-52
                         : dtype == DType::kBF16 ? 0x1p-7
                                                 : 0x1p-10;
      const double ulps = dtype == DType::kF32 || dtype == DType::kF64 ? 2 : size;
      ASSERT_NEAR(got[i], w, ulps * eps * std::max(1.0, std::fabs(w))) << what << " [" << i << "]";
    } else {
      ASSERT_EQ(got[i], w) << what << " [" << i << "]";
    }
  }
}

std::string label(const char* op, DType dtype) {
  return std::string(op) + " " + std::string(dtype_name(dtype));
}

// Every collective and dtype on `comm` (any size), exact expected outputs.
void check_collectives(Communicator& comm, int device) {
  const int n = comm.size(), me = comm.rank();
  const int64_t m = 5;  // elements per rank chunk
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      Tensor t = gpu_tensor(inputs(me, n * m), dt, device);
      comm.all_reduce(t, op);
      expect_values(
          host_values(t), [&](int64_t i) { return reduced(op, dt, n, i); }, dt, op, n,
          label("all_reduce", dt) + " " + std::string(reduce_op_name(op)));

      Tensor out = gpu_tensor(std::vector<double>(m, 0.0), dt, device);
      comm.reduce_scatter(gpu_tensor(inputs(me, n * m), dt, device), out, op);
      expect_values(
          host_values(out), [&](int64_t i) { return reduced(op, dt, n, me * m + i); }, dt, op, n,
          label("reduce_scatter", dt));

      const int root = n - 1;
      Tensor r = gpu_tensor(inputs(me, m), dt, device);
      comm.reduce(r, root, op);
      expect_values(
          host_values(r),
          [&](int64_t i) { return me == root ? reduced(op, dt, n, i) : input(me, i); }, dt,
          me == root ? op : ReduceOp::kSum, n, label("reduce", dt));
    }
    Tensor gathered = gpu_tensor(std::vector<double>(n * m, 0.0), dt, device);
    comm.all_gather(gpu_tensor(inputs(me, m, me * m), dt, device), gathered);
    expect_values(
        host_values(gathered), [&](int64_t i) { return input(static_cast<int>(i / m), i); }, dt,
        ReduceOp::kSum, n, label("all_gather", dt));

    Tensor b = gpu_tensor(inputs(me, m), dt, device);
    comm.broadcast(b, n - 1);
    expect_values(
        host_values(b), [&](int64_t i) { return input(n - 1, i); }, dt, ReduceOp::kSum, n,
        label("broadcast", dt));

    // Chunk j of rank i lands in chunk i of rank j: out[j·m + k] = input(j, me·m + k).
    Tensor a2a = gpu_tensor(std::vector<double>(n * m, 0.0), dt, device);
    comm.all_to_all(gpu_tensor(inputs(me, n * m), dt, device), a2a);
    expect_values(
        host_values(a2a), [&](int64_t i) { return input(static_cast<int>(i / m), me * m + i % m); },
        dt, ReduceOp::kSum, n, label("all_to_all", dt));

    // all_to_all_v: rank i sends rank j ((i + 2j) mod 3) · m elements (some blocks empty), the
    // k-th of them input(i, 100·j + k).
    const auto count = [&](int from, int to) -> int64_t { return (from + 2 * to) % 3 * m; };
    std::vector<int64_t> sends, receives;
    std::vector<double> out, want;
    for (int r = 0; r < n; ++r) {
      sends.push_back(count(me, r));
      receives.push_back(count(r, me));
      for (int64_t k = 0; k < count(me, r); ++k) out.push_back(input(me, 100 * r + k));
      for (int64_t k = 0; k < count(r, me); ++k) want.push_back(input(r, 100 * me + k));
    }
    Tensor varied = gpu_tensor(std::vector<double>(want.size(), 0.0), dt, device);
    comm.all_to_all_v(gpu_tensor(out, dt, device), sends, varied, receives);
    expect_values(
        host_values(varied), [&](int64_t i) { return want[static_cast<size_t>(i)]; }, dt,
        ReduceOp::kSum, n, label("all_to_all_v", dt));
  }
  comm.barrier();
  // Empty tensors are legal and complete.
  Tensor empty = gpu_tensor({}, DType::kF32, device);
  comm.all_reduce(empty);
  comm.broadcast(empty, 0);
}

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no GPU: " << cuda::unavailable_reason();
  }
};

// A group of one on GPU 0, made through a local bootstrap of one rank.
std::unique_ptr<Communicator> solo(const CommOptions& options = {}) {
  auto bootstrap = make_local_world(1);
  return make_nccl_world(*bootstrap[0], 0, options);
}

TEST(NcclNoGpu, MakeWorldFailsWithAClearError) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is present";
  auto bootstrap = make_local_world(1);
  try {
    make_nccl_world(*bootstrap[0], 0);
    FAIL() << "make_nccl_world succeeded without a GPU";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("creating group 'world' (size 1, rank 0) on cuda:0"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(NcclTest, GroupOfOneDescribesItself) {
  auto comm = solo();
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->name(), "world");
  EXPECT_EQ(dynamic_cast<NcclCommunicator&>(*comm).cuda_device(), 0);
}

TEST_F(NcclTest, GroupOfOneEveryCollectiveAndDType) {
  auto comm = solo();
  check_collectives(*comm, 0);
}

TEST_F(NcclTest, GroupOfOneAsyncHandles) {
  auto comm = solo();
  Tensor t = gpu_tensor(inputs(0, 1 << 20), DType::kF32, 0);
  WorkHandle work = comm->all_reduce_async(t, ReduceOp::kMax);
  while (!work->test()) {
  }
  EXPECT_TRUE(work->test());
  work->wait();  // after completion: returns at once
  // A dropped handle keeps its buffers alive until the stream is past them.
  comm->all_reduce_async(t, ReduceOp::kSum);
  comm->barrier();
  EXPECT_EQ(host_values(t)[1], input(0, 1));
}

TEST_F(NcclTest, GroupOfOneSendToSelfMatchesByTag) {
  auto comm = solo();
  for (DType dt : kAllDTypes) {
    Tensor a = gpu_tensor({1, 2, 3}, dt, 0), b = gpu_tensor({4, 5, 6, 7}, dt, 0);
    comm->send(a, 0, /*tag=*/1);
    comm->send(b, 0, /*tag=*/2);
    Tensor rb = gpu_tensor({0, 0, 0, 0}, dt, 0), ra = gpu_tensor({0, 0, 0}, dt, 0);
    comm->recv(rb, 0, 2);
    comm->recv(ra, 0, 1);
    EXPECT_EQ(host_values(ra), (std::vector<double>{1, 2, 3})) << dtype_name(dt);
    EXPECT_EQ(host_values(rb), (std::vector<double>{4, 5, 6, 7})) << dtype_name(dt);
  }
  Tensor r = gpu_tensor({0}, DType::kF32, 0);
  EXPECT_THROW(comm->recv(r, 0, 9), CommError);  // nothing was sent with tag 9
}

TEST_F(NcclTest, GroupOfOneSplit) {
  auto comm = solo();
  EXPECT_EQ(comm->split(-1, 0), nullptr);
  auto child = comm->split(3, 0);
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->name(), "world/split(color=3)");
  EXPECT_EQ(child->size(), 1);
  check_collectives(*child, 0);
}

TEST_F(NcclTest, HostTensorsAndBadArgumentsAreCommErrors) {
  auto comm = solo();
  Tensor host = Tensor::zeros({4});
  try {
    comm->all_reduce(host);
    FAIL() << "a host tensor was accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor is on cpu:0; the nccl backend needs tensors on "
                                         "cuda:0"),
              std::string::npos)
        << e.what();
  }
  Tensor gpu = gpu_tensor({1, 2, 3, 4}, DType::kF32, 0);
  Tensor small = gpu_tensor({0, 0}, DType::kF32, 0);
  EXPECT_THROW(comm->all_gather(host, gpu), CommError);
  EXPECT_THROW(comm->send(host, 0, 0), CommError);
  EXPECT_THROW(comm->reduce_scatter(gpu, small), CommError);  // 4 != 1 × 2
  EXPECT_THROW(comm->broadcast(gpu, 1), CommError);           // root outside the group
  Tensor ints = gpu_tensor({0, 0, 0, 0}, DType::kI32, 0);
  EXPECT_THROW(comm->all_gather(gpu, ints), CommError);  // f32 into i32
  EXPECT_THROW(make_nccl_world(*make_local_world(1)[0], gpu_count()), CommError);
  comm->all_reduce(gpu);  // still usable after refused calls
}

// ---- several GPUs: thread ranks over a local bootstrap, rank r on GPU r ----------------------

// Well under the harness's 60 s test timeout: a rank stuck in NCCL fails instead of outliving it
// (the local world's abort does not reach NCCL waits).
CommOptions test_options() {
  CommOptions options;
  options.timeout = std::chrono::seconds(20);
  return options;
}

// Runs body(nccl communicator) on `ranks` thread ranks; false when there are too few GPUs.
bool on_gpus(int ranks, const std::function<void(Communicator&)>& body,
             const CommOptions& options = test_options()) {
  if (gpu_count() < ranks) return false;
  loom::testing::run_on_thread_ranks(ranks, [&](Communicator& bootstrap) {
    auto comm = make_nccl_world(bootstrap, bootstrap.rank(), options);
    body(*comm);
  });
  return true;
}

TEST_F(NcclTest, ThreadRanksEveryCollectiveAndDType) {
  int ran = 0;
  for (int ranks : {2, 3, 4, 8}) {
    ran += on_gpus(ranks, [](Communicator& comm) {
      check_collectives(comm, dynamic_cast<NcclCommunicator&>(comm).cuda_device());
    });
  }
  if (ran == 0) GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

TEST_F(NcclTest, ThreadRanksSplitByParity) {
  if (!on_gpus(4, [](Communicator& comm) {
        auto child = comm.split(comm.rank() % 2, -comm.rank());  // reversed order inside
        ASSERT_NE(child, nullptr);
        EXPECT_EQ(child->size(), 2);
        EXPECT_EQ(child->rank(), 1 - comm.rank() / 2);
        Tensor t = gpu_tensor({static_cast<double>(comm.rank())}, DType::kI32, comm.rank());
        child->all_reduce(t);
        EXPECT_EQ(host_values(t)[0], comm.rank() % 2 == 0 ? 0 + 2 : 1 + 3);
      }))
    GTEST_SKIP() << "needs 4 GPUs, found " << gpu_count();
}

// A ring: even ranks send first, odd ranks receive first (NCCL sends wait for their recv).
TEST_F(NcclTest, ThreadRanksSendRecvRing) {
  int ran = 0;
  for (int ranks : {2, 3}) {
    ran += on_gpus(ranks, [](Communicator& comm) {
      const int n = comm.size(), me = comm.rank(), dev = me;
      Tensor out = gpu_tensor(inputs(me, 1000), DType::kBF16, dev);
      Tensor in = gpu_tensor(std::vector<double>(1000, 0.0), DType::kBF16, dev);
      if (me % 2 == 0) {
        comm.send(out, (me + 1) % n, 5);
        comm.recv(in, (me + n - 1) % n, 5);
      } else {
        comm.recv(in, (me + n - 1) % n, 5);
        comm.send(out, (me + 1) % n, 5);
      }
      EXPECT_EQ(host_values(in), inputs((me + n - 1) % n, 1000));
    });
  }
  if (ran == 0) GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// send_recv: every rank sends to its next and receives from its previous at once (context
// parallelism's ring). Sent and received in one NCCL group, so the ring needs no ordering of
// ranks — posted apart, every rank's send first, it would deadlock (the emulator's NCCL blocks
// sends as NCCL does: EmulatedSendsBlockUntilReceivedSoCrossedSendsTimeOut). Several steps, the
// block passed on each time, as the ring passes its blocks; a group of one sends to itself.
TEST_F(NcclTest, ThreadRanksSendRecvTogetherMakeARingInAnyOrder) {
  int ran = 0;
  for (int ranks : {1, 2, 3, 4}) {
    ran += on_gpus(ranks, [](Communicator& comm) {
      const int n = comm.size(), me = comm.rank(), dev = me;
      Tensor block = gpu_tensor(inputs(me, 1000), DType::kF32, dev);
      for (int step = 1; step <= n; ++step) {
        Tensor in = gpu_tensor(std::vector<double>(1000, -1.0), DType::kF32, dev);
        comm.send_recv(block, (me + 1) % n, in, (me + n - 1) % n, /*tag=*/3);
        EXPECT_EQ(host_values(in), inputs((me - step % n + n) % n, 1000)) << "step " << step;
        block = in;
      }
      // A mismatched message is still named: the peer's tag 4 where tag 3 was expected.
      if (n == 2) {
        Tensor in = gpu_tensor(std::vector<double>(1000, 0.0), DType::kF32, dev);
        try {
          comm.send_recv(block, 1 - me, in, 1 - me, /*tag=*/3 + me);
          ADD_FAILURE() << "a message with another tag was taken";
        } catch (const CommError& e) {
          EXPECT_NE(std::string(e.what()).find("got a message with tag"), std::string::npos)
              << e.what();
        }
      }
    });
  }
  if (ran == 0) GTEST_SKIP() << "needs a GPU, found " << gpu_count();
}

TEST_F(NcclTest, ThreadRanksRecvInAnotherOrderThanTheSendsIsACommError) {
  if (!on_gpus(2, [](Communicator& comm) {
        Tensor t = gpu_tensor({1, 2, 3}, DType::kF32, comm.rank());
        if (comm.rank() == 0) {
          WorkHandle first = comm.send_async(t, 1, /*tag=*/1);
          comm.send(t, 1, /*tag=*/2);
          first->wait();
          return;
        }
        try {
          comm.recv(t, 0, /*tag=*/2);
          ADD_FAILURE() << "a message with tag 1 was taken for tag 2";
        } catch (const CommError& e) {
          EXPECT_NE(std::string(e.what()).find("got a message with tag 1"), std::string::npos)
              << e.what();
        }
        EXPECT_THROW(comm.recv(t, 0, /*tag=*/1), CommError);
      }))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// wait_on_device: the compute stream waits for the operation, the host does not (no wait() is
// counted by nccl_host_waits). What runs after it on the GPU sees the result: a chain of
// all-reduces, each reading the last one's output, a bf16 ring step and an all-gather, read back
// once at the end. A device-waited recv's header check runs on the watchdog: a message with
// another tag fails the communicator, and check() says so naming the recv.
TEST_F(NcclTest, ThreadRanksDeviceWaitsOrderTheGpuWithoutTheHost) {
  if (!on_gpus(2, [](Communicator& comm) {
        const int me = comm.rank(), other = 1 - me;
        const int64_t host_waits = nccl_host_waits();
        Tensor t = gpu_tensor(inputs(me, 1000), DType::kF32, me);
        for (int i = 0; i < 4; ++i) comm.all_reduce_async(t, ReduceOp::kSum)->wait_on_device();
        Tensor in = gpu_tensor(std::vector<double>(1000, 0.0), DType::kBF16, me);
        comm.send_recv_async(gpu_tensor(inputs(me, 1000), DType::kBF16, me), other, in, other, 2)
            ->wait_on_device();
        Tensor all = gpu_tensor(std::vector<double>(2000, 0.0), DType::kBF16, me);
        comm.all_gather_async(in, all)->wait_on_device();
        // Both ranks' inputs summed, then doubled three times: 8 (input(0, i) + input(1, i)).
        std::vector<double> want(1000);
        for (int64_t i = 0; i < 1000; ++i) want[i] = 8 * (input(0, i) + input(1, i));
        EXPECT_EQ(host_values(t), want);
        std::vector<double> gathered = inputs(1, 1000), first = inputs(0, 1000);
        gathered.insert(gathered.end(), first.begin(), first.end());  // rank 0 got rank 1's
        EXPECT_EQ(host_values(all), gathered);
        comm.check();  // nothing failed
        EXPECT_EQ(nccl_host_waits(), host_waits) << "a device wait blocked the host";

        if (me == 0) {
          comm.send_async(t, 1, /*tag=*/7)->wait_on_device();
          return;
        }
        comm.recv_async(t, 0, /*tag=*/8)->wait_on_device();
        (void)host_values(t);  // the recv completed; the watchdog checks its header
        const std::string what = testutil::error_of([&] { comm.check(); });
        EXPECT_NE(what.find("recv(src=0, tag=8) #1 on group 'world' (size 2, rank 1): got a "
                            "message with tag 7"),
                  std::string::npos)
            << what;
        EXPECT_THROW(comm.barrier(), CommError);  // aborted: refuses further calls
      }))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// The host no longer blocks where the GPU waits, so the backend times the compute stream's stall
// instead (events around each cudaStreamWaitEvent): a rank whose peer comes 300 ms late stalls
// ~300 ms, the late one hardly at all; taking the figure restarts it.
TEST_F(NcclTest, ThreadRanksDeviceWaitsTimeTheGpusStall) {
  if (!on_gpus(2, [](Communicator& comm) {
        comm.barrier();
        const int me = comm.rank();
        if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        Tensor t = gpu_tensor({1, 2, 3}, DType::kF32, me);
        comm.all_reduce_async(t, ReduceOp::kSum)->wait_on_device();
        EXPECT_EQ(host_values(t), (std::vector<double>{2, 4, 6}));  // the stream is past the wait
        const double stalled = comm.take_device_wait_seconds();
        if (me == 0) {
          EXPECT_GE(stalled, 0.25);
          EXPECT_LT(stalled, 10.0);
        } else {
          EXPECT_LT(stalled, 0.1);
        }
        EXPECT_EQ(comm.take_device_wait_seconds(), 0.0);
      }))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// A collective the GPU waits for but a peer skipped: the watchdog aborts the communicator after
// the timeout, which releases the GPU's stream (and the host's copy behind it), and check()
// names the operation; the communicator then refuses further calls.
TEST_F(NcclTest, ThreadRanksSkippedCollectiveWaitedOnTheGpuTimesOutNamingIt) {
  CommOptions options;
  options.timeout = std::chrono::seconds(2);
  if (!on_gpus(
          2,
          [](Communicator& comm) {
            comm.barrier();
            if (comm.rank() == 1) {
              std::this_thread::sleep_for(std::chrono::seconds(4));  // past rank 0's timeout
              return;
            }
            Tensor t = gpu_tensor({1, 2}, DType::kF32, 0);
            const auto t0 = std::chrono::steady_clock::now();
            comm.all_reduce_async(t, ReduceOp::kSum)->wait_on_device();
            (void)host_values(t);  // released by the abort
            EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
            const std::string what = testutil::error_of([&] { comm.check(); });
            EXPECT_NE(what.find("timed out after 2.0 s waiting (on the GPU) for all_reduce #1 "
                                "(sum, 2 × f32) on group 'world' (size 2, rank 0); rank(s) 1 did "
                                "not arrive"),
                      std::string::npos)
                << what;
            EXPECT_THROW(comm.barrier(), CommError);
          },
          options))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

#ifdef LOOM_CUDA_EMULATE
// NCCL's asynchronous error while the GPU waits: the emulator's NCCL fails a rank that posts a
// collective of another size than its peer's (real NCCL may hang or corrupt instead, which the
// timeout then reports). The watchdog sees the error, aborts, and check() names the operation
// and NCCL's reason on that rank; the peer, whose part is left waiting, times out.
TEST_F(NcclTest, EmulatedMismatchWaitedOnTheGpuFailsThroughTheWatchdog) {
  CommOptions options;
  options.timeout = std::chrono::seconds(2);
  ASSERT_TRUE(on_gpus(
      2,
      [](Communicator& comm) {
        comm.barrier();
        const int me = comm.rank();
        if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // posts second
        Tensor t = gpu_tensor(std::vector<double>(3 + me, 1.0), DType::kF32, me);
        comm.all_reduce_async(t, ReduceOp::kSum)->wait_on_device();
        (void)host_values(t);  // released by the abort
        const std::string what = testutil::error_of([&] { comm.check(); });
        if (me == 1) {
          EXPECT_NE(what.find("all_reduce #1 (sum, 4 × f32) on group 'world' (size 2, rank 1) "
                              "failed: invalid usage"),
                    std::string::npos)
              << what;
          EXPECT_NE(what.find("rank 1 posted ncclAllReduce of 4"), std::string::npos) << what;
        } else {
          EXPECT_NE(what.find("timed out after 2.0 s waiting (on the GPU) for all_reduce #1"),
                    std::string::npos)
              << what;
        }
      },
      options));
}

// NCCL documents a send as blocking for the GPU until its receive runs, and a communicator's
// operations run in issue order: two ranks that each send to the other before receiving, outside
// a group, deadlock. The emulator's NCCL keeps those semantics (its first version buffered sends,
// which hid such deadlocks), so the backend's timeout reports it here as it would on GPUs.
TEST_F(NcclTest, EmulatedSendsBlockUntilReceivedSoCrossedSendsTimeOut) {
  CommOptions options;
  options.timeout = std::chrono::seconds(1);
  ASSERT_TRUE(on_gpus(
      2,
      [](Communicator& comm) {
        const int other = 1 - comm.rank();
        Tensor out = gpu_tensor({1, 2, 3}, DType::kF32, comm.rank());
        Tensor in = gpu_tensor({0, 0, 0}, DType::kF32, comm.rank());
        WorkHandle sent = comm.send_async(out, other, 7);
        try {
          comm.recv(in, other, 7);
          ADD_FAILURE() << "crossed blocking sends completed";
        } catch (const CommError& e) {
          EXPECT_NE(std::string(e.what()).find("timed out after 1.0 s"), std::string::npos)
              << e.what();
        }
      },
      options));
}
#endif

TEST_F(NcclTest, ThreadRanksSkippedCollectiveTimesOutNamingIt) {
  CommOptions options;
  options.timeout = std::chrono::seconds(3);
  if (!on_gpus(
          2,
          [](Communicator& comm) {
            comm.barrier();  // connections up, so the enqueue itself does not wait
            if (comm.rank() == 1) {
              // Skips the all-reduce, and stays alive past rank 0's timeout, so that rank 0
              // sees a timeout rather than a vanished peer.
              std::this_thread::sleep_for(std::chrono::seconds(5));
              return;
            }
            Tensor t = gpu_tensor({1, 2}, DType::kF32, 0);
            try {
              comm.all_reduce(t);
              ADD_FAILURE() << "an all-reduce missing a rank completed";
            } catch (const CommError& e) {
              const std::string what = e.what();
              EXPECT_NE(what.find("timed out after 3.0 s"), std::string::npos) << what;
              EXPECT_NE(what.find("all_reduce #1 (sum, 2 × f32) on group 'world' (size 2, rank 0); "
                                  "rank(s) 1 did not arrive"),
                        std::string::npos)
                  << what;
            }
            EXPECT_THROW(comm.barrier(), CommError);  // aborted: refuses further calls
          },
          options))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// cudaDeviceSynchronize waits for the current GPU's streams, not for another GPU's: rank 0 can
// synchronise its GPU while rank 1's all-reduce, queued on GPU 1, waits for rank 0 (the CUDA
// emulator once waited for every GPU's streams, which deadlocked here).
TEST_F(NcclTest, ThreadRanksSynchronizingOneGpuDoesNotWaitForAnothersCollective) {
  if (!on_gpus(2, [](Communicator& comm) {
        const int me = comm.rank();
        comm.barrier();
        Tensor t = gpu_tensor({1, 2}, DType::kF32, me);
        if (me == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 1's is queued
          cuda::synchronize(0);
        }
        comm.all_reduce(t);
        EXPECT_EQ(host_values(t), (std::vector<double>{2, 4}));
      }))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
}

// CommOptions::debug_checks: matching collectives pass (the whole check_collectives suite), a
// mismatch in count throws on both ranks naming both calls before NCCL sees it, and the group
// goes on.
TEST_F(NcclTest, ThreadRanksDebugChecksNameAMismatchOnEveryRank) {
  CommOptions options = test_options();
  options.debug_checks = true;
  std::vector<std::string> errors(2);
  if (!on_gpus(
          2,
          [&](Communicator& comm) {
            const int me = comm.rank();
            check_collectives(comm, me);
            Tensor t = gpu_tensor(std::vector<double>(5 + me, 1.0), DType::kF32, me);
            errors[static_cast<size_t>(me)] = testutil::error_of([&] { comm.all_reduce(t); });
            Tensor u = gpu_tensor({1, 2}, DType::kF32, me);
            comm.all_reduce(u);  // still usable
            EXPECT_EQ(host_values(u), (std::vector<double>{2, 4}));
          },
          options))
    GTEST_SKIP() << "needs 2 GPUs, found " << gpu_count();
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("nccl debug check: at sequence number"), std::string::npos) << e;
    EXPECT_NE(e.find(r == 0 ? "rank 0 calls all_reduce(sum, 5 × f32) but rank 1 calls "
                              "all_reduce(sum, 6 × f32)"
                            : "rank 1 calls all_reduce(sum, 6 × f32) but rank 0 calls "
                              "all_reduce(sum, 5 × f32)"),
              std::string::npos)
        << e;
  }
}

// The flight recorder under nccl: the first rank to time out dumps its records and those of
// its world's other ranks in this process (thread ranks), before its abort, to
// flight_dir/rank_NNNNN.nccl.json; `loom debug hang` (analyze_flight_dumps) then names the rank
// that never reached the collective, and a split group is recorded with its members' world ranks.
TEST_F(NcclTest, ThreadRanksThatTimeOutDumpEveryRanksFlightRecords) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("loom_nccl_flight_" + std::to_string(getpid()));
  fs::remove_all(dir);
  CommOptions options;
  options.timeout = std::chrono::seconds(2);
  options.flight_dir = dir.string();
  std::vector<std::string> errors(4);
  if (!on_gpus(
          4,
          [&](Communicator& comm) {
            const int me = comm.rank();
            comm.barrier();                                   // #0
            auto pair = comm.split(me % 2, me);               // #1: {0, 2} and {1, 3}
            Tensor t = gpu_tensor({1, 2, 3}, DType::kF32, me);
            pair->all_reduce(t);
            if (me == 3) {  // skips the world's all-reduce, alive past the others' timeouts
              std::this_thread::sleep_for(std::chrono::seconds(4));
              return;
            }
            if (me != 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
            errors[static_cast<size_t>(me)] = testutil::error_of([&] { comm.all_reduce(t); });
          },
          options))
    GTEST_SKIP() << "needs 4 GPUs, found " << gpu_count();
  EXPECT_NE(errors[0].find("all_reduce #2 (sum, 3 × f32) on group 'world' (size 4, rank 0); "
                           "rank(s) 3 did not arrive"),
            std::string::npos)
      << errors[0];
  for (int r = 0; r < 4; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.nccl.json", r);
    ASSERT_TRUE(fs::exists(dir / name)) << name;
  }
  const HangReport report = analyze_flight_dumps(dir.string());
  ASSERT_FALSE(report.findings.empty());
  const std::string& line = report.findings.front();
  EXPECT_NE(line.find("group 'nccl:world' (ranks 0, 1, 2, 3): rank(s) 0, 1, 2 wait in "
                      "all_reduce #2; rank(s) 3 never reached #2"),
            std::string::npos)
      << report.text();
  EXPECT_TRUE(report.missing_dumps.empty());
  // Rank 3's dump: the split group with its members' world ranks, its all-reduce completed.
  std::ifstream in(dir / "rank_00003.nccl.json");
  const nlohmann::json dump = nlohmann::json::parse(in);
  EXPECT_EQ(dump.at("backend"), "nccl");
  EXPECT_EQ(dump.at("groups").at("nccl:world/split(color=1)"), (std::vector<int>{1, 3}));
  bool pair_done = false;
  for (const auto& rec : dump.at("records"))
    if (rec.at("group") == "nccl:world/split(color=1)" && rec.at("op") == "all_reduce")
      pair_done = rec.at("state") == "completed";
  EXPECT_TRUE(pair_done) << dump.dump(1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom
