// DirectedP2pCommunicator on thread ranks: messages to other ranks travel over the two split
// communicators (the wrapped one sees none of them: a CountingCommunicator underneath counts
// only what reaches it directly), each arrives intact with its tag, collectives and messages to
// oneself stay on the wrapped communicator.
#include "comm/directed_p2p.h"

#include <gtest/gtest.h>

#include <vector>

#include "comm/counting.h"
#include "host_tensors.h"
#include "harness/thread_ranks.h"

namespace loom {
namespace {

constexpr int kRanks = 3;
using testing::filled;

TEST(DirectedP2p, MessagesGoOverTheDirectionsCommunicatorsCollectivesOverTheBase) {
  testing::run_on_thread_ranks(kRanks, [](Communicator& host) {
    const int r = host.rank(), up = (r + 1) % kRanks, down = (r + kRanks - 1) % kRanks;
    const Device mine = Device::cpu(r);
    CountingCommunicator base(host);
    DirectedP2pCommunicator comm(base);
    EXPECT_EQ(comm.rank(), r);
    EXPECT_EQ(comm.size(), kRanks);
    // Both neighbours at once, sends first on every rank: a ring each way.
    WorkHandle to_up = comm.send_async(filled({1.0f * r, 1}, mine), up, 5);
    WorkHandle to_down = comm.send_async(filled({1.0f * r, 2}, mine), down, 6);
    Tensor from_down = Tensor::zeros({2}, DType::kF32, mine);
    Tensor from_up = Tensor::zeros({2}, DType::kF32, mine);
    comm.recv(from_down, down, 5);
    comm.recv(from_up, up, 6);
    to_up->wait();
    to_down->wait();
    EXPECT_EQ(from_down.data<float>()[0], 1.0f * down);
    EXPECT_EQ(from_down.data<float>()[1], 1.0f);
    EXPECT_EQ(from_up.data<float>()[0], 1.0f * up);
    EXPECT_EQ(from_up.data<float>()[1], 2.0f);
    EXPECT_EQ(base.bytes(), 0) << "messages to other ranks reached the wrapped communicator";

    Tensor sum = filled({1.0f + r}, mine);
    comm.all_reduce(sum, ReduceOp::kSum);
    EXPECT_EQ(sum.data<float>()[0], 6.0f);
    EXPECT_EQ(base.take_bytes(), 4);  // the all-reduce did

    WorkHandle to_self = comm.send_async(filled({7}, mine), r, 9);
    Tensor from_self = Tensor::zeros({1}, DType::kF32, mine);
    comm.recv(from_self, r, 9);
    to_self->wait();
    EXPECT_EQ(from_self.data<float>()[0], 7.0f);
    EXPECT_EQ(base.bytes(), 4);  // so did the message to oneself
  });
}

}  // namespace
}  // namespace loom
