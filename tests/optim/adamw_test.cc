#include "optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>

#include "base/error.h"

namespace loom {
namespace {

LrSchedule schedule(LrDecay decay, int64_t total, int64_t warmup, float lr, float min_ratio,
                    double decay_fraction = 0.2) {
  LrSchedule s;
  s.decay = decay;
  s.total = static_cast<double>(total);
  s.warmup = warmup;
  s.lr = lr;
  s.min_ratio = min_ratio;
  s.decay_fraction = decay_fraction;
  return s;
}

TEST(LrSchedule, WarmupThenCosineToMinimum) {
  // 10 warm-up steps to 1e-3, cosine to 1e-4 at step 110.
  const LrSchedule c = schedule(LrDecay::kCosine, 110, 10, 1e-3f, 0.1f);
  EXPECT_FLOAT_EQ(c.at(0), 1e-4f);
  EXPECT_FLOAT_EQ(c.at(4), 5e-4f);
  EXPECT_FLOAT_EQ(c.at(9), 1e-3f);
  EXPECT_FLOAT_EQ(c.at(10), 1e-3f);
  EXPECT_NEAR(c.at(60), 0.55e-3, 1e-9);  // half way: mid point
  EXPECT_NEAR(c.at(35), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(M_PI / 4)), 1e-9);
  EXPECT_NEAR(c.at(110), 1e-4, 1e-10);
  for (int s = 11; s < 110; ++s) EXPECT_LE(c.at(s), c.at(s - 1));
  EXPECT_FLOAT_EQ(schedule(LrDecay::kCosine, 5, 0, 2e-3f, 0.1f).at(5), 2e-3f * 0.1f);  // no warm-up
}

TEST(LrSchedule, LinearConstantAndWarmupStableDecay) {
  // The same warm-up for each.
  for (LrDecay d : {LrDecay::kLinear, LrDecay::kConstant, LrDecay::kWsd}) {
    const LrSchedule s = schedule(d, 110, 10, 1e-3f, 0.1f);
    EXPECT_FLOAT_EQ(s.at(0), 1e-4f);
    EXPECT_FLOAT_EQ(s.at(9), 1e-3f);
    EXPECT_FLOAT_EQ(s.at(10), 1e-3f);
  }
  const LrSchedule linear = schedule(LrDecay::kLinear, 110, 10, 1e-3f, 0.1f);
  EXPECT_NEAR(linear.at(35), 1e-4 + 0.9e-3 * 0.75, 1e-9);  // a quarter of the way: 3/4 left
  EXPECT_NEAR(linear.at(60), 0.55e-3, 1e-9);
  EXPECT_NEAR(linear.at(110), 1e-4, 1e-10);
  EXPECT_FLOAT_EQ(schedule(LrDecay::kConstant, 110, 10, 1e-3f, 0.1f).at(109), 1e-3f);
  // wsd, 20% of 110 = 22 decay steps: stable to step 88, then a line to 1e-4 at 110.
  const LrSchedule wsd = schedule(LrDecay::kWsd, 110, 10, 1e-3f, 0.1f, 0.2);
  EXPECT_FLOAT_EQ(wsd.at(50), 1e-3f);
  EXPECT_FLOAT_EQ(wsd.at(88), 1e-3f);
  EXPECT_NEAR(wsd.at(99), 0.55e-3, 1e-9);
  EXPECT_NEAR(wsd.at(110), 1e-4, 1e-10);
  for (int s = 89; s <= 110; ++s) EXPECT_LT(wsd.at(s), wsd.at(s - 1)) << s;
  // A decay longer than what follows warm-up starts when warm-up ends.
  const LrSchedule long_decay = schedule(LrDecay::kWsd, 110, 10, 1e-3f, 0.0f, 1.0);
  EXPECT_NEAR(long_decay.at(60), 0.5e-3, 1e-9);
  EXPECT_EQ(parse_lr_decay("wsd"), LrDecay::kWsd);
  EXPECT_EQ(parse_lr_decay("linear"), LrDecay::kLinear);
  EXPECT_THROW(parse_lr_decay("step"), Error);
}

// A batch-size ramp-up's steps are fractions of a full batch: the schedule follows the
// sequences consumed. Warm-up by the step's end (never past lr), the decay by its start, over a
// run of a fractional number of full batches.
TEST(LrSchedule, FollowsFractionsOfAFullBatch) {
  for (LrDecay d : {LrDecay::kCosine, LrDecay::kLinear, LrDecay::kWsd}) {
    const LrSchedule s = schedule(d, 110, 10, 1e-3f, 0.1f);
    for (int step = 0; step <= 110; ++step)
      EXPECT_EQ(s.at_progress(step, step + 1), s.at(step)) << step;  // the same bits
  }
  LrSchedule ramp = schedule(LrDecay::kCosine, 0, 2, 1e-3f, 0.1f);
  ramp.total = 10.5;
  EXPECT_FLOAT_EQ(ramp.at_progress(0.0, 0.25), 1e-3f * 0.25f / 2);  // a quarter batch
  EXPECT_FLOAT_EQ(ramp.at_progress(0.25, 0.75), 1e-3f * 0.75f / 2);
  EXPECT_FLOAT_EQ(ramp.at_progress(1.5, 2.5), 1e-3f);  // ends past warm-up: lr, not more
  EXPECT_FLOAT_EQ(ramp.at_progress(2.0, 2.5), 1e-3f);  // the decay's start
  EXPECT_NEAR(ramp.at_progress(6.25, 7.0), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(M_PI * 0.5)),
              1e-9);  // (6.25 - 2) / (10.5 - 2) = half way
  EXPECT_NEAR(ramp.at_progress(10.5, 11.0), 1e-4, 1e-10);
  ramp.decay = LrDecay::kWsd;  // 20% of 10.5 rounds to 2: stable until 8.5
  EXPECT_FLOAT_EQ(ramp.at_progress(8.5, 9.5), 1e-3f);
  EXPECT_NEAR(ramp.at_progress(9.5, 10.5), 0.55e-3, 1e-9);
}

struct Store {
  ParameterStore store;
  Parameter* w = store.add("w", {2, 2}, InitKind::kOnes);
  Parameter* b = store.add("b", {3}, InitKind::kOnes);
  Store() {
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(0);
  }
};

TEST(ClipGradNorm, ScalesOnlyAboveTheLimit) {
  ThreadPool pool(2);
  Store s;
  for (int i = 0; i < 4; ++i) s.w->grad.data<float>()[i] = 3.0f;  // norm of w = 6
  for (int i = 0; i < 3; ++i) s.b->grad.data<float>()[i] = 0.0f;
  s.b->grad.data<float>()[0] = 8.0f;  // total norm 10
  EXPECT_NEAR(clip_grad_norm(pool, s.store, 20.0), 10.0, 1e-9);
  EXPECT_EQ(s.b->grad.data<float>()[0], 8.0f);
  EXPECT_NEAR(clip_grad_norm(pool, s.store, 5.0), 10.0, 1e-9);
  EXPECT_NEAR(s.b->grad.data<float>()[0], 4.0f, 1e-5);
  EXPECT_NEAR(s.w->grad.data<float>()[0], 1.5f, 1e-5);
}

TEST(AdamW, DecoupledDecayOnMatricesOnly) {
  ThreadPool pool(1);
  Store s;
  AdamWConfig cfg;
  cfg.weight_decay = 0.5f;
  AdamW opt(s.store, cfg);
  s.store.zero_grads();  // zero gradient: only weight decay moves the parameters
  opt.step(pool, 0.1f);
  EXPECT_FLOAT_EQ(s.w->value.data<float>()[0], 1.0f - 0.1f * 0.5f);
  EXPECT_FLOAT_EQ(s.b->value.data<float>()[0], 1.0f);
  EXPECT_EQ(opt.steps_taken(), 1);
}

TEST(AdamW, FirstStepMovesByLearningRate) {
  // With bias correction the first update is lr · g / (|g| + eps) ≈ lr · sign(g).
  ThreadPool pool(1);
  Store s;
  AdamWConfig cfg;
  cfg.weight_decay = 0;
  AdamW opt(s.store, cfg);
  for (int i = 0; i < 3; ++i) s.b->grad.data<float>()[i] = i == 1 ? -2.0f : 0.5f;
  opt.step(pool, 0.01f);
  EXPECT_NEAR(s.b->value.data<float>()[0], 0.99f, 1e-6);
  EXPECT_NEAR(s.b->value.data<float>()[1], 1.01f, 1e-6);
}

}  // namespace
}  // namespace loom
