// Tests of the local backend, in the style of nccl-tests: inputs crafted so that the exact output
// is computable (small integers, exact in every dtype), compared bit for bit; average within
// 2 ulp. Then sub-groups, async overlap, point to point, determinism, and the failure paths:
// timeouts, a throwing rank, mismatched calls.
#include "comm/local/local_backend.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness/thread_ranks.h"
#include "host_tensors.h"

namespace loom {
namespace {

using loom::testing::get_value;
using loom::testing::set_value;

using loom::testing::run_on_thread_ranks;
using loom::testing::run_ranks_collect;
using Clock = std::chrono::steady_clock;

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr int64_t kBig = 65536 + 3;  // sanitizers are ~10× slower
#else
constexpr int64_t kBig = (2 << 20) / 4;  // 2 MiB of f32
#endif

const DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kBF16,
                            DType::kF16, DType::kI32, DType::kI64};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

// The nccl-tests style input: rank r, element i holds (r + 1) · (i % 7 + 1).
double pattern(int r, int64_t i) {
  return (r + 1) * (i % 7 + 1);
}

Tensor filled(int64_t n, DType dtype, int r) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) set_value(t, i, pattern(r, i));
  return t;
}

// Expected op over ranks 0..n-1 of pattern(r, i), as the dtype stores it.
double expected_reduce(ReduceOp op, DType dtype, int n, int64_t i) {
  const double base = static_cast<double>(i % 7 + 1);
  const double sum = base * n * (n + 1) / 2;
  switch (op) {
    case ReduceOp::kSum:
      return sum;
    case ReduceOp::kMax:
      return base * n;
    case ReduceOp::kMin:
      return base;
    case ReduceOp::kAvg:
      if (dtype == DType::kI32 || dtype == DType::kI64)
        return static_cast<double>(static_cast<int64_t>(sum) / n);
      return sum / n;
  }
  return 0;
}

// Bitwise for everything but avg, which is allowed 2 ulp of the dtype.
void expect_reduced(const Tensor& t, ReduceOp op, int n, const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < t.numel() && bad < 3; ++i) {
    const double want = expected_reduce(op, t.dtype(), n, i);
    const double got = get_value(t, i);
    double tol = 0;
    if (op == ReduceOp::kAvg) {
      const double eps = t.dtype() == DType::kF32    ? 0x1p-23
                         : t.dtype() == DType::kF64  ? 0x1p-52
                         : t.dtype() == DType::kBF16 ? 0x1p-7
                         : t.dtype() == DType::kF16  ? 0x1p-10
                                                     : 0;
      tol = 2 * eps * std::fabs(want);
    }
    if (std::fabs(got - want) > tol) {
      ++bad;
      ADD_FAILURE() << what << " element " << i << ": got " << got << ", want " << want;
    }
  }
}

std::string label(const char* op, DType dtype, int64_t count) {
  return std::string(op) + " " + std::string(dtype_name(dtype)) + " count " + std::to_string(count);
}

class GroupSize : public ::testing::TestWithParam<int> {};

TEST_P(GroupSize, AllReduceEveryDtypeAndOp) {
  const int n = GetParam();
  run_on_thread_ranks(n, [&](Communicator& comm) {
    ASSERT_EQ(comm.size(), n);
    EXPECT_EQ(comm.backend(), "local");
    EXPECT_EQ(comm.name(), "world");
    for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{1001}, kBig}) {
      for (DType dtype : kAllDTypes) {
        for (ReduceOp op : kAllOps) {
          if (count == kBig && dtype != DType::kF32 && op != ReduceOp::kSum)
            continue;  // keep it quick
          Tensor t = filled(count, dtype, comm.rank());
          comm.all_reduce(t, op);
          expect_reduced(t, op, n,
                         label("all_reduce", dtype, count) + " " + std::string(reduce_op_name(op)));
        }
      }
    }
  });
}

TEST_P(GroupSize, ReduceScatterAllGatherAllToAll) {
  const int n = GetParam();
  run_on_thread_ranks(n, [&](Communicator& comm) {
    const int me = comm.rank();
    for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{1001}, kBig / n}) {
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
        // reduce_scatter: my output is the sum over ranks of chunk `me` of the pattern.
        Tensor input = filled(n * count, dtype, me);
        Tensor output = Tensor::empty({count}, dtype);
        comm.reduce_scatter(input, output, ReduceOp::kSum);
        for (int64_t i = 0; i < count; ++i) {
          const double want = expected_reduce(ReduceOp::kSum, dtype, n, me * count + i);
          if (get_value(output, i) != want) {
            ADD_FAILURE() << label("reduce_scatter", dtype, count) << " element " << i;
            break;
          }
        }
        // all_gather: chunk r of the output is rank r's input, 8·r + i % 8.
        Tensor mine = Tensor::empty({count}, dtype);
        for (int64_t i = 0; i < count; ++i) set_value(mine, i, 8.0 * me + i % 8);  // exact in bf16
        Tensor gathered = Tensor::empty({n * count}, dtype);
        comm.all_gather(mine, gathered);
        for (int r = 0; r < n; ++r) {
          for (int64_t i = 0; i < count; ++i) {
            if (get_value(gathered, r * count + i) != 8.0 * r + i % 8) {
              ADD_FAILURE() << label("all_gather", dtype, count) << " chunk " << r << " element "
                            << i;
              r = n;
              break;
            }
          }
        }
        // all_to_all: chunk j of rank i's input lands in chunk i of rank j's output.
        Tensor send = Tensor::empty({n * count}, dtype);
        for (int j = 0; j < n; ++j) {
          for (int64_t k = 0; k < count; ++k)
            set_value(send, j * count + k, (me * 8 + j) * 2 + k % 2);  // < 128: exact in bf16
        }
        Tensor recv = Tensor::empty({n * count}, dtype);
        comm.all_to_all(send, recv);
        for (int i = 0; i < n; ++i) {
          for (int64_t k = 0; k < count; ++k) {
            if (get_value(recv, i * count + k) != (i * 8 + me) * 2 + k % 2) {
              ADD_FAILURE() << label("all_to_all", dtype, count) << " chunk " << i << " element "
                            << k;
              i = n;
              break;
            }
          }
        }
      }
    }
  });
}

// all_to_all_v: blocks of any size, empty ones included (rank i sends rank j
// ((3i + 5j + 1) mod 4) · 257 elements, the first also none to itself), each element saying where
// it came from and went to; twice, the second time without waiting in between.
TEST_P(GroupSize, AllToAllVMovesBlocksOfAnySize) {
  const int n = GetParam();
  const auto count = [](int from, int to) -> int64_t {
    return from == 0 && to == 0 ? 0 : ((3 * from + 5 * to + 1) % 4) * 257;
  };
  const auto code = [](int from, int to, int64_t k) { return from * 8.0 + to + 0.5 * (k % 2); };
  run_on_thread_ranks(n, [&](Communicator& comm) {
    const int me = comm.rank();
    for (DType dtype : {DType::kF32, DType::kBF16}) {  // the codes: exact in bf16
      std::vector<int64_t> sends(static_cast<size_t>(n)), receives(static_cast<size_t>(n));
      int64_t out_total = 0, in_total = 0;
      for (int r = 0; r < n; ++r) {
        out_total += sends[static_cast<size_t>(r)] = count(me, r);
        in_total += receives[static_cast<size_t>(r)] = count(r, me);
      }
      // The counts themselves through the host helper: what each rank sends this one.
      EXPECT_EQ(all_to_all_values(comm, sends), receives);
      Tensor send = Tensor::empty({out_total}, dtype);
      int64_t at = 0;
      for (int j = 0; j < n; ++j)
        for (int64_t k = 0; k < count(me, j); ++k) set_value(send, at++, code(me, j, k));
      Tensor first = Tensor::empty({in_total}, dtype), second = Tensor::empty({in_total}, dtype);
      WorkHandle a = comm.all_to_all_v_async(send, sends, first, receives);
      WorkHandle b = comm.all_to_all_v_async(send, sends, second, receives);
      a->wait();
      b->wait();
      for (const Tensor* got : {&first, &second}) {
        at = 0;
        for (int i = 0; i < n; ++i)
          for (int64_t k = 0; k < count(i, me); ++k, ++at)
            if (get_value(*got, at) != code(i, me, k)) {
              ADD_FAILURE() << "all_to_all_v " << dtype_name(dtype) << ": element " << k
                            << " from rank " << i << " on rank " << me;
              i = n;
              break;
            }
      }
    }
    // A block one rank sends and its receiver expects at another length: every rank refuses the
    // exchange, naming the pair (none is left waiting for the others).
    if (n >= 2) {
      std::vector<int64_t> out_counts(static_cast<size_t>(n), 0), in_counts = out_counts;
      if (me == 0) out_counts[1] = 1;
      if (me == 1) in_counts[0] = 2;
      Tensor out_t = Tensor::zeros({me == 0 ? 1 : 0}, DType::kF32);
      Tensor in_t = Tensor::zeros({me == 1 ? 2 : 0}, DType::kF32);
      try {
        comm.all_to_all_v(out_t, out_counts, in_t, in_counts);
        ADD_FAILURE() << "rank " << me << " took mismatched blocks";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 0 sends rank 1 1 elements, which expects 2"),
                  std::string::npos)
            << e.what();
      }
    }
    // Counts that do not add up to the tensors are refused by name.
    Tensor t = Tensor::empty({3}, DType::kF32);
    std::vector<int64_t> wrong(static_cast<size_t>(n), 0);
    try {
      comm.all_to_all_v(t, wrong, t, wrong);
      ADD_FAILURE() << "counts summing to 0 for 3 elements were taken";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("counts sum to 0, the tensor holds 3"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST_P(GroupSize, BroadcastReduceBarrier) {
  const int n = GetParam();
  run_on_thread_ranks(n, [&](Communicator& comm) {
    const int me = comm.rank();
    for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{1001}, kBig}) {
      for (int root = 0; root < n; ++root) {
        Tensor t = filled(count, DType::kF32, me);
        comm.broadcast(t, root);
        for (int64_t i = 0; i < count; ++i) {
          if (get_value(t, i) != pattern(root, i)) {
            ADD_FAILURE() << "broadcast count " << count << " root " << root << " element " << i;
            break;
          }
        }
        Tensor r = filled(count, DType::kF32, me);
        comm.reduce(r, root, ReduceOp::kSum);
        for (int64_t i = 0; i < count; ++i) {
          const double want =
              me == root ? expected_reduce(ReduceOp::kSum, DType::kF32, n, i) : pattern(me, i);
          if (get_value(r, i) != want) {
            ADD_FAILURE() << "reduce count " << count << " root " << root << " on rank " << me
                          << " element " << i;
            break;
          }
        }
        comm.barrier();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Local, GroupSize, ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "ranks" + std::to_string(p.param);
                         });

// Host scalars through a communicator (what training loops exchange): staged on its
// tensor_device(), which is the host for local ranks; sums, means and gathers in rank order.
TEST_P(GroupSize, HostValuesAllReduceAndAllGather) {
  const int n = GetParam();
  run_on_thread_ranks(n, [&](Communicator& comm) {
    EXPECT_TRUE(comm.tensor_device().is_cpu());
    const int r = comm.rank();
    EXPECT_EQ(all_reduce_value(comm, r + 1.0), n * (n + 1) / 2.0);
    EXPECT_EQ(all_reduce_value(comm, r + 1.0, ReduceOp::kMax), double(n));
    EXPECT_DOUBLE_EQ(all_reduce_value(comm, 2.0 * r, ReduceOp::kAvg), double(n - 1));
    const std::vector<double> all = all_gather_values(comm, {double(r), 10.0 * r});
    ASSERT_EQ(all.size(), size_t(2 * n));
    for (int q = 0; q < n; ++q) {
      EXPECT_EQ(all[2 * q], double(q));
      EXPECT_EQ(all[2 * q + 1], 10.0 * q);
    }
  });
}

TEST(LocalBackend, SplitEvenOdd) {
  const int n = 5;
  run_on_thread_ranks(n, [&](Communicator& comm) {
    const int me = comm.rank();
    // Even/odd groups; key = -rank reverses the order inside each group.
    std::unique_ptr<Communicator> sub = comm.split(me % 2, -me);
    ASSERT_NE(sub, nullptr);
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r) {
      if (r % 2 == me % 2) members.push_back(r);
    }
    ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
    EXPECT_EQ(members[sub->rank()], me);
    EXPECT_EQ(sub->name(), "world/split(color=" + std::to_string(me % 2) + ")");
    // Collectives inside the sub-group, interleaved with the parent's.
    Tensor t = Tensor::from_vector({static_cast<float>(me + 1), 1.0f}, {2});
    sub->all_reduce(t);
    double want = 0;
    for (int r : members) want += r + 1;
    EXPECT_EQ(t.data<float>()[0], want);
    EXPECT_EQ(t.data<float>()[1], static_cast<float>(members.size()));
    Tensor all = Tensor::from_vector({1.0f}, {1});
    comm.all_reduce(all);
    EXPECT_EQ(all.data<float>()[0], n);
    Tensor b = Tensor::from_vector({static_cast<float>(me)}, {1});
    sub->broadcast(b, 0);
    EXPECT_EQ(b.data<float>()[0], members[0]);
    // color < 0 joins no group; nested splits.
    std::unique_ptr<Communicator> only_zero = comm.split(me == 0 ? 0 : -1, 0);
    EXPECT_EQ(only_zero != nullptr, me == 0);
    if (only_zero) {
      EXPECT_EQ(only_zero->size(), 1);
      Tensor x = Tensor::from_vector({3.0f}, {1});
      only_zero->all_reduce(x);
      only_zero->barrier();
      EXPECT_EQ(x.data<float>()[0], 3.0f);
    }
    std::unique_ptr<Communicator> nested = sub->split(0, sub->rank());
    ASSERT_NE(nested, nullptr);
    EXPECT_EQ(nested->size(), sub->size());
    nested->barrier();
  });
}

TEST(LocalBackend, AsyncOverlapsCompute) {
  run_on_thread_ranks(4, [&](Communicator& comm) {
    Tensor t = filled(kBig, DType::kF32, comm.rank());
    WorkHandle work = comm.all_reduce_async(t, ReduceOp::kSum);
    // A compute loop while the all-reduce runs on the progress thread.
    std::vector<float> x(4096, 1.0f);
    float acc = 0;
    for (int step = 0; step < 200; ++step) {
      for (float& v : x) v = v * 0.999f + 0.001f;
      acc += x[step];
    }
    EXPECT_GT(acc, 0.0f);
    work->wait();
    EXPECT_TRUE(work->test());
    expect_reduced(t, ReduceOp::kSum, 4, "async all_reduce");
  });
}

TEST(LocalBackend, OutstandingAsyncOpsCompleteInOrder) {
  const int n = 3;
  run_on_thread_ranks(n, [&](Communicator& comm) {
    std::vector<Tensor> tensors;
    std::vector<WorkHandle> works;
    for (int k = 0; k < 6; ++k) {
      tensors.push_back(filled(1001 + k, DType::kF32, comm.rank()));
      works.push_back(k % 2 ? comm.all_reduce_async(tensors.back(), ReduceOp::kMax)
                            : comm.all_reduce_async(tensors.back(), ReduceOp::kSum));
    }
    Tensor b = Tensor::from_vector({static_cast<float>(comm.rank())}, {1});
    WorkHandle last = comm.broadcast_async(b, 2);
    last->wait();  // issue order: every earlier operation is complete too
    for (auto& w : works) EXPECT_TRUE(w->test());
    EXPECT_EQ(b.data<float>()[0], 2.0f);
    for (int k = 5; k >= 0; --k) {
      works[k]->wait();
      expect_reduced(tensors[k], k % 2 ? ReduceOp::kMax : ReduceOp::kSum, n,
                     "async #" + std::to_string(k));
    }
  });
}

TEST(LocalBackend, SendRecvRingWithTags) {
  for (int n : {1, 2, 5}) {
    run_on_thread_ranks(n, [&](Communicator& comm) {
      const int me = comm.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
      // Three messages: tag 7 twice (FIFO), tag 3 once; received in a different tag order.
      for (int k = 0; k < 2; ++k) {
        comm.send(Tensor::from_vector({static_cast<float>(me), static_cast<float>(k)}, {2}), next,
                  7);
      }
      WorkHandle s = comm.send_async(filled(1001, DType::kI32, me), next, 3);
      Tensor big = Tensor::empty({1001}, DType::kI32);
      comm.recv(big, prev, 3);
      s->wait();
      expect_reduced(big, ReduceOp::kMax, prev + 1,
                     "recv tag 3");  // pattern(prev, i) = max over prev+1 ranks
      for (int k = 0; k < 2; ++k) {
        Tensor m = Tensor::empty({2});
        comm.recv(m, prev, 7);
        EXPECT_EQ(m.data<float>()[0], prev);
        EXPECT_EQ(m.data<float>()[1], k);
      }
    });
  }
}

// Random floats: the result must equal the serial sum in rank order, on every rank, every run.
TEST(LocalBackend, DeterministicAndIdenticalOnAllRanks) {
  const int n = 5;
  const int64_t count = 100003;
  auto input = [&](int r) {
    std::mt19937 gen(1234 + r);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(count);
    for (float& x : v) x = dist(gen);
    return v;
  };
  std::vector<float> reference = input(0);
  for (int r = 1; r < n; ++r) {
    std::vector<float> v = input(r);
    for (int64_t i = 0; i < count; ++i) reference[i] += v[i];
  }
  for (int run = 0; run < 2; ++run) {
    std::vector<std::vector<float>> results(n);
    run_on_thread_ranks(n, [&](Communicator& comm) {
      Tensor t = Tensor::from_vector(input(comm.rank()), {count});
      comm.all_reduce(t);
      results[comm.rank()] = t.to_vector();
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(results[r].size(), reference.size());
      EXPECT_EQ(std::memcmp(results[r].data(), reference.data(), count * sizeof(float)), 0)
          << "run " << run << " rank " << r << " differs from the serial rank-order sum";
    }
  }
}

TEST(LocalBackend, SkippedCollectiveTimesOutNamingTheMissingRank) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(300);
  const auto start = Clock::now();
  auto results = run_ranks_collect(
      4,
      [](Communicator& comm) {
        Tensor t = filled(10, DType::kF32, comm.rank());
        comm.all_reduce(t);
        if (comm.rank() == 3) return;  // skips the second all_reduce
        comm.all_reduce(t);
      },
      options);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(results[3].ok) << results[3].error;
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(results[r].ok) << "rank " << r;
    const std::string& e = results[r].error;
    EXPECT_NE(e.find("all_reduce #1 on group 'world' (local, 4 ranks)"), std::string::npos) << e;
    EXPECT_NE(e.find("timed out after 0.3 s waiting for ranks 3 (arrived: 0, 1, 2)"),
              std::string::npos)
        << e;
  }
}

TEST(LocalBackend, ThrowingRankStopsTheOthersPromptly) {
  CommOptions options;
  options.timeout = std::chrono::seconds(30);
  const auto start = Clock::now();
  auto results = run_ranks_collect(
      4,
      [](Communicator& comm) {
        Tensor t = filled(1000, DType::kF32, comm.rank());
        comm.all_reduce(t);
        if (comm.rank() == 2) throw std::runtime_error("boom");
        std::unique_ptr<Communicator> sub = comm.split(comm.rank() % 2, 0);  // rank 2 never comes
        sub->all_reduce(t);
      },
      options);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(results[2].failure_order, 0);
  EXPECT_EQ(results[2].error, "boom");
  for (int r : {0, 1, 3}) {
    ASSERT_FALSE(results[r].ok) << "rank " << r;
    EXPECT_NE(results[r].error.find("aborted: rank 2 failed: boom"), std::string::npos)
        << results[r].error;
    EXPECT_NE(results[r].error.find("split #1"), std::string::npos) << results[r].error;
  }
}

TEST(LocalBackend, AbortWakesSubGroups) {
  CommOptions options;
  options.timeout = std::chrono::seconds(30);
  const auto start = Clock::now();
  auto results = run_ranks_collect(
      4,
      [](Communicator& comm) {
        std::unique_ptr<Communicator> sub = comm.split(comm.rank() % 2, 0);
        if (comm.rank() == 1) throw std::runtime_error("bad batch");
        Tensor t = filled(8, DType::kF32, comm.rank());
        sub->all_reduce(t);  // rank 3 waits for rank 1 here
      },
      options);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  // Ranks 0 and 2 finish or are aborted, depending on timing.
  EXPECT_NE(results[3].error.find("on group 'world/split(color=1)'"), std::string::npos)
      << results[3].error;
  EXPECT_NE(results[3].error.find("rank 1 failed: bad batch"), std::string::npos)
      << results[3].error;
}

TEST(LocalBackend, MismatchedCallsAreReported) {
  CommOptions options;
  options.debug_checks = true;
  options.timeout = std::chrono::seconds(10);
  auto results = run_ranks_collect(
      3,
      [](Communicator& comm) {
        comm.barrier();
        Tensor t = filled(comm.rank() == 1 ? 10 : 8, DType::kF32, comm.rank());
        comm.all_reduce(t);
      },
      options);
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(results[r].ok);
    EXPECT_NE(results[r].error.find("all_reduce #1 on group 'world'"), std::string::npos)
        << results[r].error;
    EXPECT_NE(results[r].error.find(
                  "rank 0 called all_reduce(count=8, dtype=f32, op=sum) but rank 1 called "
                  "all_reduce(count=10, dtype=f32, op=sum)"),
              std::string::npos)
        << results[r].error;
  }
  auto kinds = run_ranks_collect(
      2,
      [](Communicator& comm) {
        Tensor t = filled(4, DType::kBF16, comm.rank());
        if (comm.rank() == 0)
          comm.broadcast(t, 0);
        else
          comm.all_reduce(t);
      },
      options);
  for (auto& result : kinds) {
    EXPECT_NE(
        result.error.find("broadcast(count=4, dtype=bf16, root=0) but rank 1 called all_reduce"),
        std::string::npos)
        << result.error;
  }
}

TEST(LocalBackend, RecvSizeMismatchAndTimeout) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(200);
  auto results = run_ranks_collect(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0) {
          comm.send(Tensor::empty({3}), 1, 0);
        } else {
          Tensor small = Tensor::empty({2});
          comm.recv(small, 0, 0);
        }
      },
      options);
  EXPECT_TRUE(results[0].ok);
  EXPECT_NE(results[1].error.find(
                "recv #0 from rank 0 (tag 0) on group 'world' (local, 2 ranks): rank 0 sent 3 f32 "
                "elements, the receive buffer holds 2 f32"),
            std::string::npos)
      << results[1].error;
  results = run_ranks_collect(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 1) {
          Tensor never = Tensor::empty({2});
          WorkHandle first = comm.recv_async(never, 0, 5);
          WorkHandle second = comm.recv_async(never, 0, 5);
          EXPECT_THROW(second->wait(), CommError);  // skipped after the first failed
          first->wait();
        }
      },
      options);
  EXPECT_TRUE(results[0].ok);
  EXPECT_NE(results[1].error.find(
                "recv #0 from rank 0 (tag 5) on group 'world' (local, 2 ranks): timed out after "
                "0.2 s waiting for ranks 0"),
            std::string::npos)
      << results[1].error;
}

// The harness itself: a throwing rank is one test failure naming it.
TEST(ThreadRanksHarness, ReportsTheFailingRank) {
  EXPECT_NONFATAL_FAILURE(run_on_thread_ranks(2,
                                              [](Communicator& comm) {
                                                if (comm.rank() == 1) throw Error("bad shard");
                                              }),
                          "rank 1 failed: bad shard");
}

TEST(ThreadRanksHarness, TestTimeoutNamesUnfinishedRanks) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  auto results = run_ranks_collect(
      3,
      [](Communicator& comm) {
        if (comm.rank() == 0) return;
        Tensor t = Tensor::empty({1});
        comm.recv(t, 0, 0);  // never sent
      },
      options, std::chrono::seconds(1));
  EXPECT_TRUE(results[0].ok);
  for (int r : {1, 2}) {
    EXPECT_FALSE(results[r].ok);
    EXPECT_NE(results[r].error.find("did not finish within the test timeout of 1 s"),
              std::string::npos)
        << results[r].error;
  }
}

}  // namespace
}  // namespace loom
