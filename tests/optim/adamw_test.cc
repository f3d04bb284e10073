#include "optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>

namespace loom {
namespace {

TEST(LrSchedule, WarmupThenCosineToMinimum) {
  // 10 warm-up steps to 1e-3, cosine to 1e-4 at step 110.
  EXPECT_FLOAT_EQ(lr_schedule(0, 110, 10, 1e-3f, 0.1f), 1e-4f);
  EXPECT_FLOAT_EQ(lr_schedule(4, 110, 10, 1e-3f, 0.1f), 5e-4f);
  EXPECT_FLOAT_EQ(lr_schedule(9, 110, 10, 1e-3f, 0.1f), 1e-3f);
  EXPECT_FLOAT_EQ(lr_schedule(10, 110, 10, 1e-3f, 0.1f), 1e-3f);
  EXPECT_NEAR(lr_schedule(60, 110, 10, 1e-3f, 0.1f), 0.55e-3, 1e-9);  // half way: mid point
  EXPECT_NEAR(lr_schedule(110, 110, 10, 1e-3f, 0.1f), 1e-4, 1e-10);
  for (int s = 11; s < 110; ++s)
    EXPECT_LE(lr_schedule(s, 110, 10, 1e-3f, 0.1f), lr_schedule(s - 1, 110, 10, 1e-3f, 0.1f));
  EXPECT_FLOAT_EQ(lr_schedule(5, 5, 0, 2e-3f, 0.1f), 2e-3f * 0.1f);  // no warm-up
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
