// StagedCommunicator on CPU: thread ranks keep their tensors on cpu:r and stage them through
// another cpu device, which runs the very code GPU tensors take (copy out at issue, the host
// operation, copy back on completion). Every operation is checked against values computed here.
#include "comm/staged.h"

#include <gtest/gtest.h>

#include <vector>

#include "host_tensors.h"
#include "harness/thread_ranks.h"

namespace loom {
namespace {

constexpr int kRanks = 3;
using testing::filled;
using testing::values_of;

TEST(StagedCommunicator, EveryOperationMatchesTheHostBackend) {
  testing::run_on_thread_ranks(kRanks, [](Communicator& host) {
    const int r = host.rank();
    const Device mine = Device::cpu(r), staging = Device::cpu(10 + r);
    StagedCommunicator comm(host, staging);
    EXPECT_EQ(comm.tensor_device(), staging);
    EXPECT_EQ(comm.size(), kRanks);

    Tensor a = filled({1.0f + r, 10.0f * r}, mine);
    comm.all_reduce(a, ReduceOp::kSum);
    EXPECT_EQ(values_of(a), (std::vector<float>{6, 30}));
    EXPECT_EQ(a.device(), mine);

    Tensor in = filled({1.0f * r, 2.0f * r, 3.0f * r}, mine), out = Tensor::zeros({1}, DType::kF32, mine);
    comm.reduce_scatter(in, out, ReduceOp::kSum);  // sums 0+1+2 = 3 times (1, 2, 3)
    EXPECT_EQ(values_of(out), (std::vector<float>{3.0f * (r + 1)}));

    Tensor mine1 = filled({100.0f + r}, mine), all = Tensor::zeros({kRanks}, DType::kF32, mine);
    comm.all_gather(mine1, all);
    EXPECT_EQ(values_of(all), (std::vector<float>{100, 101, 102}));

    Tensor b = filled({r == 2 ? 7.0f : -1.0f}, mine);
    comm.broadcast(b, 2);
    EXPECT_EQ(values_of(b), (std::vector<float>{7}));

    Tensor red = filled({2.0f + r}, mine);
    comm.reduce(red, 1, ReduceOp::kMax);
    EXPECT_EQ(values_of(red), (std::vector<float>{r == 1 ? 4.0f : 2.0f + r}))
        << "the root gets the result, the others keep theirs";

    Tensor send = filled({10.0f * r, 10.0f * r + 1, 10.0f * r + 2}, mine);
    Tensor got = Tensor::zeros({kRanks}, DType::kF32, mine);
    comm.all_to_all(send, got);  // element j of rank i goes to rank j's slot i
    EXPECT_EQ(values_of(got), (std::vector<float>{0.0f + r, 10.0f + r, 20.0f + r}));

    // all_to_all_v of staged tensors: rank i sends rank j i + j elements 10i + j (rank 0 none to
    // itself), staged message by message.
    std::vector<float> outgoing, want;
    std::vector<int64_t> sends, receives;
    for (int j = 0; j < kRanks; ++j) {
      sends.push_back(r + j);
      receives.push_back(j + r);
      for (int k = 0; k < r + j; ++k) outgoing.push_back(10.0f * r + j);
      for (int k = 0; k < j + r; ++k) want.push_back(10.0f * j + r);
    }
    Tensor varied = Tensor::zeros({static_cast<int64_t>(want.size())}, DType::kF32, mine);
    comm.all_to_all_v(filled(outgoing, mine), sends, varied, receives);
    EXPECT_EQ(values_of(varied), want);

    // A ring with tags (buffered sends first, as the host backend allows): completion seen by
    // test() copies back once, and a later wait() changes nothing.
    Tensor inbox = Tensor::zeros({2}, DType::kF32, mine);
    WorkHandle tx = comm.send_async(filled({1.0f * r, -1.0f * r}, mine), (r + 1) % kRanks, 5);
    WorkHandle rx = comm.recv_async(inbox, (r + kRanks - 1) % kRanks, 5);
    while (!rx->test()) {
    }
    const float from = static_cast<float>((r + kRanks - 1) % kRanks);
    EXPECT_EQ(values_of(inbox), (std::vector<float>{from, -from}));
    inbox.data<float>()[0] = 42;
    rx->wait();
    EXPECT_EQ(inbox.data<float>()[0], 42.0f) << "the result was copied back twice";
    tx->wait();

    // Split: ranks 0 and 2 form a group, still staged.
    std::unique_ptr<Communicator> sub = comm.split(r == 1 ? 1 : 0, r);
    Tensor s = filled({1.0f + r}, mine);
    sub->all_reduce(s, ReduceOp::kAvg);
    EXPECT_EQ(values_of(s), (std::vector<float>{2}));  // (1 + 3) / 2, and 2 alone
    EXPECT_EQ(sub->tensor_device(), staging);

    // Tensors on the staging device pass straight through.
    Tensor direct = filled({1.0f}, staging);
    comm.all_reduce(direct, ReduceOp::kSum);
    EXPECT_EQ(values_of(direct), (std::vector<float>{3}));
  });
}

}  // namespace
}  // namespace loom
