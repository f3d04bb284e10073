#include "tensor/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace loom {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway too: ties to even (up).
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DType, F16ExhaustiveRoundTrip) {
  // Every finite half converts to float and back to itself.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t exp = (h >> 10) & 0x1f;
    if (exp == 31 && (h & 0x3ff)) continue;  // NaN payloads need not survive
    ASSERT_EQ(float_to_f16(f16_to_float(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(DType, F16RoundingAndRange) {
  EXPECT_EQ(f16_to_float(float_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(65520.0f))));
  EXPECT_EQ(f16_to_float(float_to_f16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(float_to_f16(std::ldexp(1.0f, -26))), 0.0f);
  // Halfway between 1 and 1+2^-10 rounds to even (1).
  EXPECT_EQ(f16_to_float(float_to_f16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(parse_dtype("bf16"), DType::kBF16);
}

}  // namespace
}  // namespace loom
