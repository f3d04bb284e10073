#include "kernels/cpu/cross_entropy.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "kernel_test_util.h"
#include "kernels/targets.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

std::vector<int32_t> make_targets(int64_t N, int64_t V) {
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 5 + 3) % V);
  return targets;
}

TEST(CrossEntropy, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t N = 10, V = 11;
  const auto targets = make_targets(N, V);
  for (double offset : {0.0, 1000.0}) {  // exp(1000) overflows unless the max is shifted out
    auto logits = random_vector(N * V, 1, -3, 3);
    for (double& x : logits) x += offset;
    std::vector<double> losses(N), lse(N);
    cross_entropy_forward(pool, losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    std::vector<double> expected_losses(N), expected_lse(N);
    for (int64_t i = 0; i < N; ++i) {
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[i * V + v] - offset);
      expected_lse[i] = offset + std::log(sum);
      expected_losses[i] = expected_lse[i] - logits[i * V + targets[i]];
    }
    ktest::expect_close("losses", losses, expected_losses, 1e-13);
    ktest::expect_close("lse", lse, expected_lse, 1e-15);
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 10, V = 11;
  const double dloss = 0.37;  // L = dloss · Σ losses
  const auto targets = make_targets(N, V);
  auto logits = random_vector(N * V, 1, -3, 3);
  std::vector<double> losses(N), lse(N);
  auto loss = [&] {
    cross_entropy_forward(pool, losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    double total = 0;
    for (double l : losses) total += dloss * l;
    return total;
  };
  loss();
  auto dlogits = ktest::nan_vector(N * V);
  cross_entropy_backward(pool, dlogits.data(), logits.data(), lse.data(), targets.data(), dloss, N,
                         V);
  ktest::expect_gradient("dlogits", logits, loss, dlogits);

  // In place, over the logits themselves (after a forward at the unperturbed logits again).
  loss();
  auto in_place = logits;
  cross_entropy_backward(pool, in_place.data(), in_place.data(), lse.data(), targets.data(), dloss,
                         N, V);
  EXPECT_EQ(in_place, dlogits);
}

// With PaLM's z-loss the backward is the gradient of Σ dloss · (loss + z · lse²); an ignored row
// has neither term.
TEST(CrossEntropy, ZLossBackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t N = 10, V = 11;
  const double dloss = 0.37;
  const float z = 0.25f;  // large, for the term to show against the cross-entropy's
  auto targets = make_targets(N, V);
  targets[6] = kIgnoredTarget;
  auto logits = random_vector(N * V, 1, -3, 3);
  for (int64_t v = 0; v < V; ++v) logits[2 * V + v] += 4.0;  // a row whose lse is far from 0
  std::vector<double> losses(N), lse(N);
  auto loss = [&] {
    cross_entropy_forward(pool, losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    double total = 0;
    for (int64_t r = 0; r < N; ++r)
      if (targets[r] != kIgnoredTarget) total += dloss * (losses[r] + z * lse[r] * lse[r]);
    return total;
  };
  loss();
  auto dlogits = ktest::nan_vector(N * V);
  cross_entropy_backward(pool, dlogits.data(), logits.data(), lse.data(), targets.data(), dloss, N,
                         V, z);
  ktest::expect_gradient("dlogits with z-loss", logits, loss, dlogits);
  // The z-loss moved the gradient: without it, row 2's sums to 0; with it, to 2 · z · lse · dloss.
  double row_sum = 0;
  for (int64_t v = 0; v < V; ++v) row_sum += dlogits[2 * V + v];
  EXPECT_NEAR(row_sum, 2.0 * z * lse[2] * dloss, 1e-12);
  EXPECT_GT(std::abs(row_sum), 0.5);
}

TEST(CrossEntropy, BadTargetThrowsNamingIt) {
  ThreadPool pool(2);
  const int64_t N = 4, V = 11;
  const auto logits = random_vector(N * V, 1);
  std::vector<double> losses(N), lse(N, 0.0), dlogits(N * V);
  for (int32_t bad : {11, -3}) {
    auto targets = make_targets(N, V);
    targets[2] = bad;
    for (int pass = 0; pass < 2; ++pass) {
      try {
        if (pass == 0)
          cross_entropy_forward(pool, losses.data(), lse.data(), logits.data(), targets.data(), N,
                                V);
        else
          cross_entropy_backward(pool, dlogits.data(), logits.data(), lse.data(), targets.data(),
                                 1.0, N, V);
        ADD_FAILURE() << "target " << bad << " accepted";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("target " + std::to_string(bad) + " in row 2"), std::string::npos)
            << msg;
        EXPECT_NE(msg.find("[0, 11)"), std::string::npos) << msg;
      }
    }
  }
}

// Rows whose target is kIgnoredTarget (data.eod_mask_loss) have loss 0 and a zero gradient,
// whatever their logits; every other row is bit for bit what it is with no row ignored.
TEST(CrossEntropy, IgnoredTargetsHaveNoLossAndNoGradient) {
  ThreadPool pool(3);
  const int64_t N = 10, V = 11;
  const auto logits = random_vector(N * V, 1, -3, 3);
  const auto targets = make_targets(N, V);
  auto ignored = targets;
  for (int64_t r : {0, 4, 9}) ignored[r] = kIgnoredTarget;
  const auto run = [&](const std::vector<int32_t>& t, std::vector<double>* losses,
                       std::vector<double>* dlogits) {
    std::vector<double> lse(N);
    losses->assign(N, -1.0);
    dlogits->assign(N * V, -1.0);
    cross_entropy_forward(pool, losses->data(), lse.data(), logits.data(), t.data(), N, V);
    cross_entropy_backward(pool, dlogits->data(), logits.data(), lse.data(), t.data(), 0.25, N, V);
  };
  std::vector<double> all_losses, all_dlogits, losses, dlogits;
  run(targets, &all_losses, &all_dlogits);
  run(ignored, &losses, &dlogits);
  for (int64_t r = 0; r < N; ++r) {
    const bool is_ignored = ignored[r] == kIgnoredTarget;
    EXPECT_EQ(losses[r], is_ignored ? 0.0 : all_losses[r]) << "row " << r;
    EXPECT_GT(all_losses[r], 0.0) << "row " << r;
    for (int64_t v = 0; v < V; ++v)
      ASSERT_EQ(dlogits[r * V + v], is_ignored ? 0.0 : all_dlogits[r * V + v])
          << "row " << r << ", logit " << v;
  }
  // Only -100 is ignored: another negative target is still refused.
  ignored[5] = -99;
  EXPECT_THROW(run(ignored, &losses, &dlogits), Error);
}

// losses, lse and dlogits of one forward/backward in Real, in a row.
template <typename Real>
std::vector<Real> run_cross_entropy(ThreadPool& pool, int64_t N, int64_t V) {
  const auto logits = convert<Real>(random_vector(N * V, 1, -4, 4));
  const auto targets = make_targets(N, V);
  std::vector<Real> losses(N), lse(N), dlogits(N * V);
  cross_entropy_forward(pool, losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  cross_entropy_backward(pool, dlogits.data(), logits.data(), lse.data(), targets.data(),
                         Real(1) / Real(N), N, V);
  losses.insert(losses.end(), lse.begin(), lse.end());
  losses.insert(losses.end(), dlogits.begin(), dlogits.end());
  return losses;
}

TEST(CrossEntropy, FloatMatchesDouble) {
  ThreadPool pool(2);
  ktest::expect_close("all outputs", run_cross_entropy<float>(pool, 20, 1000),
                      run_cross_entropy<double>(pool, 20, 1000), 1e-5);
}

TEST(CrossEntropy, BitwiseSameForAnyPoolSize) {
  auto runs = ktest::expect_reproducible(
      "cross_entropy", [](ThreadPool& pool) { return run_cross_entropy<float>(pool, 40, 300); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

}  // namespace
}  // namespace loom::cpu
