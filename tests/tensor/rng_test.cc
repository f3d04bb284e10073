#include "tensor/rng.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace loom {
namespace {

TEST(Philox, KnownAnswer) {
  // Random123's published known-answer vectors for philox4x32-10.
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r, (PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  r = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(r, (PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  r = philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(r, (PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Init, ShardsInitialiseExactlyAsSlicesOfTheWhole) {
  const Shape shape{8, 12};
  Tensor whole = Tensor::empty(shape);
  init_normal(whole, 1234, "blocks.0.mlp.fc.weight", 0.0f, 0.02f);
  const float* w = whole.data<float>();
  // 4 row slices
  for (int s = 0; s < 4; ++s) {
    Tensor part = Tensor::empty({2, 12});
    init_normal(part, 1234, "blocks.0.mlp.fc.weight", 0.0f, 0.02f, Region::slice(shape, 0, 2 * s));
    EXPECT_EQ(std::memcmp(part.data<float>(), w + s * 24, 24 * sizeof(float)), 0) << "row slice " << s;
  }
  // 4 column slices
  for (int s = 0; s < 4; ++s) {
    Tensor part = Tensor::empty({8, 3});
    init_normal(part, 1234, "blocks.0.mlp.fc.weight", 0.0f, 0.02f, Region::slice(shape, 1, 3 * s));
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 3; ++j)
        ASSERT_EQ(std::memcmp(&part.data<float>()[i * 3 + j], &w[i * 12 + 3 * s + j], 4), 0)
            << "column slice " << s << " (" << i << "," << j << ")";
  }
}

TEST(Init, LargeBlocksSplitOverThreadsGiveTheSameBits) {
  // Blocks over 1M elements are filled by several threads (where the machine has several cores):
  // every element must still be normal_at(key, its global index), whatever the split, and a
  // column shard (its rows strided in the whole) must match the whole's columns.
  const Shape shape{1500, 1536};  // 2.3M elements
  Tensor whole = Tensor::empty(shape);
  init_normal(whole, 99, "wte", 0.0f, 0.02f);
  const PhiloxKey key = philox_key(99, "wte");
  const float* w = whole.data<float>();
  for (int64_t g : {int64_t{0}, int64_t{1} << 20, int64_t{1152000}, int64_t{1500 * 1536 - 1}})
    ASSERT_EQ(w[g], static_cast<float>(static_cast<double>(0.02f) * normal_at(key, g)))
        << "element " << g;
  Tensor part = Tensor::empty({1500, 768});
  init_normal(part, 99, "wte", 0.0f, 0.02f, Region::slice(shape, 1, 768));
  for (int64_t i = 0; i < 1500; ++i)
    ASSERT_EQ(std::memcmp(part.data<float>() + i * 768, w + i * 1536 + 768, 768 * sizeof(float)), 0)
        << "row " << i;
}

TEST(Init, DependsOnSeedAndName) {
  Tensor a = Tensor::empty({64}), b = Tensor::empty({64}), c = Tensor::empty({64});
  init_normal(a, 1, "x", 0, 1);
  init_normal(b, 2, "x", 0, 1);
  init_normal(c, 1, "y", 0, 1);
  EXPECT_NE(std::memcmp(a.raw(), b.raw(), 256), 0);
  EXPECT_NE(std::memcmp(a.raw(), c.raw(), 256), 0);
}

TEST(Init, NormalMoments) {
  Tensor t = Tensor::empty({200000});
  init_normal(t, 7, "moments", 1.0f, 2.0f);
  double s = 0, s2 = 0;
  for (float v : t.to_vector()) { s += v; s2 += double(v) * v; }
  const double mean = s / t.numel(), var = s2 / t.numel() - mean * mean;
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_NEAR(std::sqrt(var), 2.0, 0.02);
}

TEST(RandomStream, ResumesFromPosition) {
  RandomStream a(5, "sampler");
  for (int i = 0; i < 7; ++i) a.next_u32();
  RandomStream b(5, "sampler");
  b.set_position(a.position());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next_u32(), b.next_u32());
  float u = a.next_uniform();
  EXPECT_GE(u, 0.0f);
  EXPECT_LT(u, 1.0f);
}

}  // namespace
}  // namespace loom
