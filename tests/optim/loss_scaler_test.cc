#include "optim/loss_scaler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "base/error.h"

namespace loom {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

LossScalerConfig dynamic(double init, int64_t window, double min = 1) {
  return {LossScaleMode::kDynamic, init, window, min};
}

TEST(LossScaler, AutoIsDynamicUnderFp16GemmsOnly) {
  EXPECT_EQ(parse_loss_scale_mode("auto", "fp16"), LossScaleMode::kDynamic);
  EXPECT_EQ(parse_loss_scale_mode("auto", "bf16"), LossScaleMode::kNone);
  EXPECT_EQ(parse_loss_scale_mode("auto", "fp32"), LossScaleMode::kNone);
  EXPECT_EQ(parse_loss_scale_mode("static", "fp32"), LossScaleMode::kStatic);
  EXPECT_EQ(parse_loss_scale_mode("none", "fp16"), LossScaleMode::kNone);
  EXPECT_THROW(parse_loss_scale_mode("fp16", "fp16"), Error);
}

TEST(LossScaler, NoneScalesByOneAndNeverSkips) {
  LossScaler s({LossScaleMode::kNone, 1024, 10, 1});
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_FALSE(s.enabled());
  EXPECT_TRUE(s.update(kInf));  // without scaling an overflow is divergence, not a skip
  EXPECT_EQ(s.scale(), 1.0);
}

TEST(LossScaler, DynamicDoublesAfterAWindowOfGoodStepsAndHalvesOnOverflow) {
  LossScaler s(dynamic(1024, 3));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.update(0.5));
  EXPECT_TRUE(s.update(0.5));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.update(0.5));
  EXPECT_EQ(s.scale(), 2048) << "three good steps in a row";
  EXPECT_TRUE(s.update(0.5));
  EXPECT_TRUE(s.update(0.5));
  EXPECT_FALSE(s.update(kInf));
  EXPECT_EQ(s.scale(), 1024) << "an overflow halves";
  EXPECT_EQ(s.state().good_steps, 0) << "and restarts the window";
  EXPECT_FALSE(s.update(kNaN));
  EXPECT_EQ(s.scale(), 512);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(s.update(1.0));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_TRUE(s.update(1.0));
  EXPECT_EQ(s.scale(), 1024);
}

TEST(LossScaler, DynamicStopsAtItsFloorWithAClearError) {
  LossScaler s(dynamic(4, 100, 2));
  EXPECT_FALSE(s.update(kInf));
  EXPECT_EQ(s.scale(), 2);
  try {
    s.update(kInf);
    FAIL() << "an overflow at the minimum scale must end the run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.loss_scale_min"), std::string::npos) << e.what();
  }
}

TEST(LossScaler, DynamicNeverGrowsPast2To64) {
  LossScaler s(dynamic(std::ldexp(1.0, 63), 1));
  EXPECT_TRUE(s.update(1.0));
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 64));
  EXPECT_TRUE(s.update(1.0));
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 64));
}

TEST(LossScaler, StaticSkipsOverflowsWithoutChangingTheScale) {
  LossScaler s({LossScaleMode::kStatic, 256, 1, 1});
  EXPECT_TRUE(s.update(3.0));
  EXPECT_FALSE(s.update(kInf));
  EXPECT_TRUE(s.update(3.0));
  EXPECT_EQ(s.scale(), 256);
}

TEST(LossScaler, RefusesScalesThatAreNotExactPowersOfTwo) {
  EXPECT_THROW(LossScaler(dynamic(1000, 10)), Error);
  EXPECT_THROW(LossScaler(dynamic(0.5, 10)), Error);
  EXPECT_THROW(LossScaler(dynamic(std::ldexp(1.0, 65), 10)), Error);
  EXPECT_THROW(LossScaler(dynamic(1024, 0)), Error);
  EXPECT_THROW(LossScaler(dynamic(1024, 10, 2048)), Error) << "min above init";
  EXPECT_NO_THROW(LossScaler({LossScaleMode::kNone, 1000, 0, 3})) << "unused settings";
  LossScaler s(dynamic(1024, 10));
  EXPECT_THROW(s.set_state({3.0, 0}), Error);
  EXPECT_THROW(s.set_state({kInf, 0}), Error);
  s.set_state({64, 7});
  EXPECT_EQ(s.scale(), 64);
  EXPECT_EQ(s.state().good_steps, 7);
}

}  // namespace
}  // namespace loom
