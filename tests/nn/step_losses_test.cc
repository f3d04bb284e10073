// StepLosses (nn/step_losses.h): a step's micro-batch losses, and beside them the z-loss's Σ lse²
// entries, kept in one set of slots and read at once.
#include "nn/step_losses.h"

#include <gtest/gtest.h>

#include <vector>

#include "base/thread_pool.h"

namespace loom {
namespace {

TEST(StepLosses, KeepsTheLossesAndTheLseSquaresApartInOneRead) {
  ThreadPool pool(1);
  const Exec ex{&pool, Device::cpu()};
  StepLosses losses(Device::cpu());
  // More entries than the first allocation's 16 slots: the slots grow, the entries stay.
  std::vector<double> want_losses, want_squares;
  for (int i = 0; i < 12; ++i) {
    const Tensor l = Tensor::from_vector(std::vector<float>{1.0f * i, 2.0f, 3.0f}, {3});
    losses.add_mean_of(ex, l, 2);  // the first two rows
    want_losses.push_back((1.0 * i + 2.0) / 2);
    *losses.add_lse_square_sum_of(4) = 8.0 * i;
    want_squares.push_back(2.0 * i);
  }
  EXPECT_EQ(losses.take(), want_losses);
  EXPECT_EQ(losses.taken_lse_square_means(), want_squares);
  // The next step starts empty, also for the lse squares.
  losses.add_mean_of(ex, Tensor::from_vector(std::vector<float>{5.0f}, {1}), 1);
  EXPECT_EQ(losses.take(), std::vector<double>{5.0});
  EXPECT_TRUE(losses.taken_lse_square_means().empty());
}

}  // namespace
}  // namespace loom
