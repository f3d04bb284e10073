// Sharded parameters (tensor parallelism): a shard initialises to exactly its blocks of the full
// parameter — row blocks, column blocks, a QKV weight split by heads (three pieces), and
// vocabulary padding rows that stay zero — also through ZeRO-3's initialize_slice.
#include <gtest/gtest.h>

#include "base/error.h"
#include "nn/parameter.h"

namespace loom {
namespace {

// The full parameter, initialised on one device.
Tensor full_param(const std::string& name, const Shape& shape) {
  ParameterStore store;
  store.add(name, shape, InitKind::kNormal, 0.02f);
  store.allocate(DType::kF32, Device::cpu());
  store.initialize(7);
  return store.get(name).value.clone();
}

TEST(ParameterShard, BlocksEqualTheFullParameter) {
  const Shape full = {12, 8};
  const Tensor ref = full_param("w", full);
  const int tp = 2;
  auto at = [&](int64_t i, int64_t j) { return ref.data<float>()[i * 8 + j]; };
  // One store per shard; returns the shard's values, checking initialize_slice (ZeRO-3, no full
  // buffer) gives the same bits.
  auto shard = [&](const Shape& local, std::vector<ShardPiece> pieces) {
    ParameterStore store;
    Parameter* p = store.add_shard("w", local, full, std::move(pieces), InitKind::kNormal);
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(7);
    Tensor slice = Tensor::empty({store.numel()}, DType::kF32);
    store.initialize_slice(7, 0, store.numel(), slice);
    for (int64_t i = 0; i < store.numel(); ++i)
      EXPECT_EQ(slice.data<float>()[i], store.values().data<float>()[i]) << "initialize_slice " << i;
    return p->value.clone();
  };
  for (int r = 0; r < tp; ++r) {
    // Column-parallel (rows split), row-parallel (columns split), QKV by heads (3 pieces of 2
    // rows from each third), and a padded shard: 7 local rows, rank 1's last 2 are padding.
    const Tensor rows = shard({6, 8}, {{0, 6, Region{full, {6 * r, 0}}}});
    const Tensor cols = shard({12, 4}, {{0, 12, Region{full, {0, 4 * r}}}});
    std::vector<ShardPiece> qkv;
    for (int k = 0; k < 3; ++k) qkv.push_back({2 * k, 2, Region{full, {4 * k + 2 * r, 0}}});
    const Tensor heads = shard({6, 8}, qkv);
    const int64_t real = r == 0 ? 7 : 5;
    const Tensor padded = shard({7, 8}, {{0, real, Region{full, {7 * r, 0}}}});
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(rows.data<float>()[i * 8 + j], at(6 * r + i, j));
    for (int64_t i = 0; i < 12; ++i)
      for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(cols.data<float>()[i * 4 + j], at(i, 4 * r + j));
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 8; ++j)
        EXPECT_EQ(heads.data<float>()[i * 8 + j], at(4 * (i / 2) + 2 * r + i % 2, j));
    for (int64_t i = 0; i < 7; ++i)
      for (int64_t j = 0; j < 8; ++j)
        EXPECT_EQ(padded.data<float>()[i * 8 + j], i < real ? at(7 * r + i, j) : 0.0f) << i;
  }
}

TEST(ParameterShard, PiecesThatDoNotFitAreErrors) {
  ParameterStore store;
  EXPECT_THROW(store.add_shard("w", {6, 8}, {12, 8}, {{0, 7, Region{{12, 8}, {0, 0}}}}, InitKind::kNormal), Error);
  EXPECT_THROW(store.add_shard("v", {6, 8}, {12, 8}, {{0, 6, Region{{12, 9}, {0, 0}}}}, InitKind::kNormal), Error);
}

}  // namespace
}  // namespace loom
