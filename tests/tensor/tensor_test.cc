#include "tensor/tensor.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "device/allocator.h"

namespace loom {
namespace {

TEST(Tensor, ShapeNumelAndViews) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.nbytes(), 96u);
  for (int i = 0; i < 24; ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor r = t.reshape({6, 4});
  EXPECT_EQ(r.data<float>(), t.data<float>());
  Tensor n = r.narrow(2, 3);
  EXPECT_EQ(n.shape(), (Shape{3, 4}));
  EXPECT_EQ(n.data<float>()[0], 8.0f);
  EXPECT_THROW(t.reshape({5, 5}), Error);
  EXPECT_THROW(r.narrow(5, 2), Error);
}

// zero_(pool) zeroes exactly the tensor's own bytes, over the pool's threads for a large one (a
// view in the middle of a bigger buffer: its neighbours keep their values), and small ones too.
TEST(Tensor, ZeroOverAPoolZeroesExactlyItsBytes) {
  ThreadPool pool(3);
  const int64_t n = (int64_t{9} << 20) / 4 + 13;  // 9 MiB and a ragged end: several pieces
  Tensor all = Tensor::empty({n + 200}, DType::kF32);
  for (int64_t size : {n, int64_t{5}}) {
    float* p = all.data<float>();
    for (int64_t i = 0; i < n + 200; ++i) p[i] = 1.5f;
    Tensor middle = all.narrow(100, size);
    middle.zero_(pool);
    for (int64_t i = 0; i < n + 200; ++i) {
      const bool inside = i >= 100 && i < 100 + size;
      ASSERT_EQ(p[i], inside ? 0.0f : 1.5f) << "size " << size << ", element " << i;
    }
  }
}

TEST(Tensor, ErrorsNameShapes) {
  Tensor t = Tensor::zeros({2, 3});
  try {
    t.expect_shape({3, 2}, "blocks.0.attn.qkv.weight");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "blocks.0.attn.qkv.weight: expected shape [3, 2], got [2, 3]");
  }
}

TEST(Tensor, AllocatorCountsTensorBytes) {
  const Device dev = Device::cpu(31);
  Allocator& alloc = allocator_for(dev);
  const int64_t before = alloc.stats().bytes_in_use;
  {
    Tensor t = Tensor::empty({1024, 1024}, DType::kF32, dev);
    EXPECT_GE(alloc.stats().bytes_in_use - before, 4 << 20);
    Tensor view = t.narrow(0, 10);  // views do not allocate
    EXPECT_LT(alloc.stats().bytes_in_use - before, (4 << 20) + 4096 * 2);
  }
  EXPECT_EQ(alloc.stats().bytes_in_use, before);
  EXPECT_GE(alloc.stats().peak_bytes_in_use, before + (4 << 20));
}

TEST(Tensor, ConvertRoundTrips) {
  Tensor t = Tensor::from_vector({1.0f, -2.5f, 0.1f, 65504.0f}, {4});
  Tensor h = t.to(DType::kF16);
  Tensor b = t.to(DType::kBF16);
  EXPECT_EQ(h.to(DType::kF32).to_vector()[3], 65504.0f);
  EXPECT_EQ(b.to(DType::kF32).to_vector()[1], -2.5f);
  EXPECT_NEAR(b.to_vector()[2], 0.1f, 1e-3);
  EXPECT_NEAR(h.to_vector()[2], 0.1f, 1e-4);
  Tensor c = t.clone();
  c.data<float>()[0] = 9;
  EXPECT_EQ(t.data<float>()[0], 1.0f);
}

}  // namespace
}  // namespace loom
