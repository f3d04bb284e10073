// MpiCommunicator under mpirun (np 1-4 from CTest), nccl-tests style: inputs are small integers,
// so every expected output is exact and compared bit for bit (avg: within 2 ulp).
#include "comm/mpi/mpi_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "host_tensors.h"

namespace loom {
namespace {

using loom::testing::get_value;
using loom::testing::set_value;

using namespace std::chrono_literals;

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kBF16,
                                DType::kF16, DType::kI32, DType::kI64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
constexpr int64_t kCounts[] = {0, 1, 1001, 512 * 1024};  // the last is 2 MiB of f32

std::unique_ptr<Communicator> world() {
  CommOptions options;
  options.timeout = 30s;  // a hang becomes a failure
  return make_mpi_world(options);
}

// Rank r's element i: a small integer in [-5, 5], so sums over 8 ranks are exact even in bf16.
double value(int r, int64_t i) {
  return static_cast<double>((i * 7 + r * 3) % 11) - 5.0;
}

Tensor filled(DType dtype, int64_t n, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) set_value(t, i, f(i));
  return t;
}

// Bit-for-bit equality; reports the first differing element.
::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want) {
  if (got.numel() != want.numel() || got.dtype() != want.dtype()) {
    return ::testing::AssertionFailure() << "shape or dtype differ";
  }
  const size_t size = dtype_size(got.dtype());
  const auto* a = static_cast<const char*>(got.raw());
  const auto* b = static_cast<const char*>(want.raw());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(a + i * size, b + i * size, size) != 0) {
      return ::testing::AssertionFailure()
             << dtype_name(got.dtype()) << " element " << i << " of " << got.numel() << ": got "
             << get_value(got, i) << ", want " << get_value(want, i);
    }
  }
  return ::testing::AssertionSuccess();
}

// |got - want| within 2 ulp of the dtype at want.
::testing::AssertionResult within_2ulp(const Tensor& got, const Tensor& want) {
  const double epsilon = got.dtype() == DType::kF32    ? std::ldexp(1.0, -23)
                         : got.dtype() == DType::kF64  ? std::ldexp(1.0, -52)
                         : got.dtype() == DType::kBF16 ? std::ldexp(1.0, -7)
                         : got.dtype() == DType::kF16  ? std::ldexp(1.0, -10)
                                                       : 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = get_value(got, i), w = get_value(want, i);
    if (std::abs(g - w) > 2 * epsilon * std::max(std::abs(w), 1e-30)) {
      return ::testing::AssertionFailure()
             << dtype_name(got.dtype()) << " element " << i << ": got " << g << ", want " << w;
    }
  }
  return ::testing::AssertionSuccess();
}

double reduce_expected(ReduceOp op, DType dtype, int size,
                       const std::function<double(int)>& of_rank) {
  double acc = of_rank(0);
  for (int r = 1; r < size; ++r) {
    const double v = of_rank(r);
    acc = op == ReduceOp::kMax   ? std::max(acc, v)
          : op == ReduceOp::kMin ? std::min(acc, v)
                                 : acc + v;
  }
  if (op != ReduceOp::kAvg) return acc;
  if (dtype == DType::kI32 || dtype == DType::kI64)
    return static_cast<double>(static_cast<int64_t>(acc) / size);
  return acc / size;
}

TEST(MpiBackend, Identity) {
  auto comm = world();
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(comm->size(), size);
  EXPECT_EQ(comm->name(), "world");
  EXPECT_EQ(comm->backend(), "mpi");
}

TEST(MpiBackend, AllReduceEveryDTypeOpAndCount) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      for (int64_t count : kCounts) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " " << reduce_op_name(op) << " count " << count);
        Tensor t = filled(dtype, count, [&](int64_t i) { return value(me, i); });
        comm->all_reduce(t, op);
        Tensor want = filled(dtype, count, [&](int64_t i) {
          return reduce_expected(op, dtype, n, [&](int r) { return value(r, i); });
        });
        if (op == ReduceOp::kAvg && is_floating(dtype)) {
          ASSERT_TRUE(within_2ulp(t, want));
        } else {
          ASSERT_TRUE(same_bits(t, want));
        }
      }
    }
  }
}

TEST(MpiBackend, ReduceScatter) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
    for (ReduceOp op : kAllOps) {
      for (int64_t count : kCounts) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " " << reduce_op_name(op) << " count " << count);
        Tensor input = filled(dtype, n * count, [&](int64_t i) { return value(me, i); });
        Tensor output = Tensor::empty({count}, dtype);
        comm->reduce_scatter(input, output, op);
        Tensor want = filled(dtype, count, [&](int64_t i) {
          return reduce_expected(op, dtype, n, [&](int r) { return value(r, me * count + i); });
        });
        if (op == ReduceOp::kAvg && is_floating(dtype)) {
          ASSERT_TRUE(within_2ulp(output, want));
        } else {
          ASSERT_TRUE(same_bits(output, want));
        }
      }
    }
  }
}

TEST(MpiBackend, AllGather) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (DType dtype : {DType::kF32, DType::kF16, DType::kI32}) {
    for (int64_t count : kCounts) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " count " << count);
      Tensor input = filled(dtype, count, [&](int64_t i) { return value(me, i); });
      Tensor output = Tensor::empty({n * count}, dtype);
      comm->all_gather(input, output);
      ASSERT_TRUE(same_bits(output, filled(dtype, n * count, [&](int64_t i) {
                              return value(static_cast<int>(i / count), i % count);
                            })));
    }
  }
}

TEST(MpiBackend, BroadcastFromFirstAndLastRank) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (int root : {0, n - 1}) {
    for (int64_t count : kCounts) {
      SCOPED_TRACE(::testing::Message() << "root " << root << " count " << count);
      Tensor t = filled(DType::kF32, count,
                        [&](int64_t i) { return me == root ? value(root, i) : -99.0; });
      comm->broadcast(t, root);
      ASSERT_TRUE(
          same_bits(t, filled(DType::kF32, count, [&](int64_t i) { return value(root, i); })));
    }
  }
}

TEST(MpiBackend, ReduceLeavesNonRootsUnchanged) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (int root : {0, n - 1}) {
    for (ReduceOp op : kAllOps) {
      for (int64_t count : kCounts) {
        SCOPED_TRACE(::testing::Message()
                     << "root " << root << " " << reduce_op_name(op) << " count " << count);
        Tensor t = filled(DType::kF64, count, [&](int64_t i) { return value(me, i); });
        comm->reduce(t, root, op);
        Tensor want = filled(DType::kF64, count, [&](int64_t i) {
          return me != root
                     ? value(me, i)
                     : reduce_expected(op, DType::kF64, n, [&](int r) { return value(r, i); });
        });
        ASSERT_TRUE(op == ReduceOp::kAvg && me == root ? within_2ulp(t, want) : same_bits(t, want));
      }
    }
  }
}

TEST(MpiBackend, AllToAll) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  // Element k of chunk j on rank i is i·1000 + j·10 + k mod 7.
  auto code = [](int from, int to, int64_t k) {
    return from * 1000.0 + to * 10.0 + static_cast<double>(k % 7);
  };
  for (DType dtype : {DType::kF32, DType::kI64}) {
    for (int64_t chunk : kCounts) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " chunk " << chunk);
      Tensor input = filled(dtype, n * chunk, [&](int64_t i) {
        return code(me, static_cast<int>(i / chunk), i % chunk);
      });
      Tensor output = Tensor::empty({n * chunk}, dtype);
      comm->all_to_all(input, output);
      ASSERT_TRUE(same_bits(output, filled(dtype, n * chunk, [&](int64_t i) {
                              return code(static_cast<int>(i / chunk), me, i % chunk);
                            })));
    }
  }
}

// Blocks of any size between processes, empty ones included: rank i sends rank j
// ((3i + 5j + 1) mod 4) · 1000 elements (rank 0 none to itself).
TEST(MpiBackend, AllToAllV) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  const auto count = [](int from, int to) -> int64_t {
    return from == 0 && to == 0 ? 0 : ((3 * from + 5 * to + 1) % 4) * 1000;
  };
  const auto code = [](int from, int to, int64_t k) {
    return from * 1000.0 + to * 10.0 + static_cast<double>(k % 7);
  };
  std::vector<int64_t> sends, receives;
  std::vector<double> out, want;
  for (int r = 0; r < n; ++r) {
    sends.push_back(count(me, r));
    receives.push_back(count(r, me));
    for (int64_t k = 0; k < count(me, r); ++k) out.push_back(code(me, r, k));
    for (int64_t k = 0; k < count(r, me); ++k) want.push_back(code(r, me, k));
  }
  const int64_t sent = static_cast<int64_t>(out.size()), got = static_cast<int64_t>(want.size());
  Tensor input = filled(DType::kF32, sent, [&](int64_t i) { return out[static_cast<size_t>(i)]; });
  Tensor output = Tensor::empty({got}, DType::kF32);
  comm->all_to_all_v(input, sends, output, receives);
  ASSERT_TRUE(same_bits(
      output, filled(DType::kF32, got, [&](int64_t i) { return want[static_cast<size_t>(i)]; })));
}

TEST(MpiBackend, Barrier) {
  auto comm = world();
  comm->barrier();
  WorkHandle work = comm->barrier_async();
  work->wait();
  EXPECT_TRUE(work->test());
}

TEST(MpiBackend, SendRecvRingMatchesByTag) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (int64_t count : kCounts) {
    SCOPED_TRACE(::testing::Message() << "count " << count);
    Tensor a = filled(DType::kF32, count, [&](int64_t i) { return value(me, i); });
    Tensor b = filled(DType::kF32, count, [&](int64_t i) { return value(me, i) * 2; });
    Tensor got_a = Tensor::zeros({count}), got_b = Tensor::zeros({count});
    // Receives posted in the opposite tag order to the sends: matching is by tag.
    WorkHandle rb = comm->recv_async(got_b, prev, 8);
    WorkHandle ra = comm->recv_async(got_a, prev, 7);
    WorkHandle sa = comm->send_async(a, next, 7);
    WorkHandle sb = comm->send_async(b, next, 8);
    for (const WorkHandle& w : {rb, ra, sa, sb}) w->wait();
    ASSERT_TRUE(
        same_bits(got_a, filled(DType::kF32, count, [&](int64_t i) { return value(prev, i); })));
    ASSERT_TRUE(same_bits(
        got_b, filled(DType::kF32, count, [&](int64_t i) { return value(prev, i) * 2; })));
  }
}

TEST(MpiBackend, SplitEvenOdd) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  auto group = comm->split(me % 2, me);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->name(), me % 2 == 0 ? "world/split(color=0)" : "world/split(color=1)");
  EXPECT_EQ(group->size(), me % 2 == 0 ? (n + 1) / 2 : n / 2);
  EXPECT_EQ(group->rank(), me / 2);
  std::vector<int> members;  // world ranks of this group, in group order
  for (int r = me % 2; r < n; r += 2) members.push_back(r);

  Tensor t = filled(DType::kF32, 1001, [&](int64_t i) { return value(me, i); });
  group->all_reduce(t);
  EXPECT_TRUE(same_bits(t, filled(DType::kF32, 1001, [&](int64_t i) {
                          double sum = 0;
                          for (int r : members) sum += value(r, i);
                          return sum;
                        })));

  Tensor input = filled(DType::kI32, 3, [&](int64_t i) { return me * 10 + i; });
  Tensor output = Tensor::empty({3 * group->size()}, DType::kI32);
  group->all_gather(input, output);
  EXPECT_TRUE(same_bits(output, filled(DType::kI32, output.numel(), [&](int64_t i) {
                          return members[static_cast<size_t>(i / 3)] * 10 + i % 3;
                        })));

  Tensor b =
      filled(DType::kF32, 5, [&](int64_t i) { return group->rank() == 0 ? value(me, i) : 0.0; });
  group->broadcast(b, 0);
  EXPECT_TRUE(
      same_bits(b, filled(DType::kF32, 5, [&](int64_t i) { return value(members[0], i); })));
}

TEST(MpiBackend, SplitOrdersByKeyAndDropsNegativeColor) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  auto reversed = comm->split(0, -me);
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), n - 1 - me);
  auto without_zero = comm->split(me == 0 ? -1 : 0, me);
  if (me == 0) {
    EXPECT_EQ(without_zero, nullptr);
  } else {
    ASSERT_NE(without_zero, nullptr);
    EXPECT_EQ(without_zero->size(), n - 1);
    EXPECT_EQ(without_zero->rank(), me - 1);
    without_zero->barrier();
  }
}

TEST(MpiBackend, GroupOfOneIsARealGroup) {
  auto comm = world();
  auto alone = comm->split(comm->rank(), 0);
  ASSERT_EQ(alone->size(), 1);
  Tensor t = filled(DType::kBF16, 7, [](int64_t i) { return static_cast<double>(i); });
  alone->all_reduce(t, ReduceOp::kAvg);
  EXPECT_TRUE(
      same_bits(t, filled(DType::kBF16, 7, [](int64_t i) { return static_cast<double>(i); })));
  Tensor out = Tensor::empty({7}, DType::kBF16);
  alone->all_to_all(t, out);
  EXPECT_TRUE(same_bits(out, t));
  alone->barrier();
}

TEST(MpiBackend, AsyncOverlapsACompute) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  std::vector<Tensor> tensors;
  std::vector<WorkHandle> works;
  for (int k = 0; k < 4; ++k) {
    tensors.push_back(filled(DType::kF32, 100'003, [&](int64_t i) { return value(me, i + k); }));
    works.push_back(comm->all_reduce_async(tensors.back(), ReduceOp::kSum));
  }
  works.push_back(comm->barrier_async());
  volatile double sink = 0;  // the "compute" overlapping the communication
  for (int i = 0; i < 2'000'000; ++i) sink = sink + std::sin(i * 1e-3);
  for (const WorkHandle& w : works) w->wait();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(
        same_bits(tensors[static_cast<size_t>(k)], filled(DType::kF32, 100'003, [&](int64_t i) {
                    double sum = 0;
                    for (int r = 0; r < n; ++r) sum += value(r, i + k);
                    return sum;
                  })));
  }
}

TEST(MpiBackend, AllReduceOfRandomFloatsGivesIdenticalBitsEverywhereAndEveryRun) {
  auto comm = world();
  const int me = comm->rank(), n = comm->size();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::mt19937 rng(1234 + static_cast<unsigned>(me));
    std::uniform_real_distribution<float> uniform(-1.f, 1.f);
    std::vector<double> values(600'000);
    for (double& v : values) v = uniform(rng);
    const int64_t count = static_cast<int64_t>(values.size());
    Tensor first = filled(dtype, count, [&](int64_t i) { return values[static_cast<size_t>(i)]; });
    Tensor second = first.clone();
    comm->all_reduce(first);
    comm->all_reduce(second);
    EXPECT_TRUE(same_bits(first, second)) << "two runs differ";
    Tensor everyone = Tensor::empty({n * count}, dtype);
    comm->all_gather(first, everyone);
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(same_bits(everyone.narrow(r * count, count), first))
          << "rank " << r << " differs";
    }
  }
}

TEST(MpiBackend, DebugCheckReportsAMismatchOnEveryRank) {
  CommOptions options;
  options.timeout = 30s;
  options.debug_checks = true;
  auto comm = make_mpi_world(options);
  if (comm->size() == 1) GTEST_SKIP() << "needs two ranks to mismatch";
  Tensor t = Tensor::zeros({comm->rank() == 1 ? 6 : 5});
  try {
    comm->all_reduce(t);
    FAIL() << "expected a CommError";
  } catch (const CommError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("all_reduce(5 × f32)"), std::string::npos) << message;
    EXPECT_NE(message.find("all_reduce(6 × f32)"), std::string::npos) << message;
    EXPECT_NE(message.find("sequence number 0"), std::string::npos) << message;
  }
  comm->barrier();  // the group is still usable
}

TEST(MpiBackend, BadShapesThrowNamingTheSizes) {
  auto comm = world();
  Tensor input = Tensor::zeros({comm->size() * 4 + 1});
  Tensor output = Tensor::zeros({4});
  EXPECT_THROW(comm->reduce_scatter(input, output), Error);
  Tensor i32 = Tensor::zeros({4}, DType::kI32);
  EXPECT_THROW(comm->all_gather(i32, output), CommError);
  EXPECT_THROW(comm->broadcast(output, comm->size()), Error);
  comm->barrier();
}

}  // namespace
}  // namespace loom
