#include "data/loader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "data/shard.h"
#include "device/cuda/emulator/sanitizers.h"  // LOOM_EMU_ASAN, LOOM_EMU_TSAN
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::make_numbered_shards;
using testing::TempDir;

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch next(DataLoader& loader) {
  Batch b;
  b.inputs.resize(loader.batch() * loader.seq_len());
  b.targets.resize(b.inputs.size());
  loader.next_batch(b.inputs.data(), b.targets.data());
  return b;
}

std::vector<int32_t> iota(int32_t first, int n) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

TEST(DataLoader, WindowsAndShiftedTargets) {
  TempDir dir;
  DataLoader loader(make_numbered_shards(dir, {100}), /*batch=*/2, /*seq_len=*/4);
  EXPECT_EQ(loader.total_tokens(), 100);
  EXPECT_EQ(loader.tokens_per_step(), 8);
  // Step 0 reads tokens [0, 9): rows [0..3], [4..7]; targets shifted by one.
  Batch b = next(loader);
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(loader.state(), (LoaderState{0, 8, 0}));
  b = next(loader);
  EXPECT_EQ(b.inputs, iota(8, 8));
  EXPECT_EQ(b.targets, iota(9, 8));
}

// With the model's vocabulary set, every id a batch would hold (its last target included) is
// checked on the host: the first outside [0, V) fails naming the shard, the token's index in it
// and the vocabulary, before anything reaches a device; the position does not move. Ids below V
// pass, and without a vocabulary nothing is checked.
TEST(DataLoader, IdsOutsideTheVocabularyFailNamingTheShard) {
  TempDir dir;
  const std::vector<std::string> shards = make_numbered_shards(dir, {40});  // tokens 0..39
  DataLoader loader(shards, /*batch=*/2, /*seq_len=*/4);
  loader.set_vocab_size(9);  // step 0 reads tokens 0..8: all inside
  EXPECT_EQ(next(loader).targets, iota(1, 8));
  // Step 1 reads tokens 8..16: id 9, the second token of the step, is the first outside [0, 9).
  expect_error([&] { next(loader); },
               {shards[0], "token id 9 at token 9", "vocabulary [0, 9)", "model.vocab_size"});
  EXPECT_EQ(loader.state(), (LoaderState{0, 8, 0}));
  loader.set_vocab_size(17);  // the last target, token 16, inside
  EXPECT_EQ(next(loader).targets, iota(9, 8));
  loader.set_vocab_size(0);
  EXPECT_EQ(next(loader).inputs, iota(16, 8));
}

// uint32 ("llama-3") shards beside uint16 ones: ids past 65535 arrive as they are, the loader
// crossing from one width to the other; an id past int32 is an error naming the shard.
TEST(DataLoader, ReadsUint32ShardsAndMixesWidths) {
  TempDir dir;
  std::vector<uint32_t> wide(20);
  for (int j = 0; j < 20; ++j) wide[j] = 128000u + static_cast<uint32_t>(j);
  const std::string a = dir.file("train_000000.bin"), b = dir.file("train_000001.bin");
  write_shard32(a, wide);
  write_shard(b, std::vector<uint16_t>{5, 6, 7, 8, 9, 10, 11, 12, 13, 14});
  DataLoader loader({a, b}, /*batch=*/1, /*seq_len=*/8);
  Batch first = next(loader);
  EXPECT_EQ(first.inputs, iota(128000, 8));
  EXPECT_EQ(first.targets, iota(128001, 8));
  next(loader);  // tokens 8..16 of the wide shard; the next step does not fit: on to shard 1
  EXPECT_EQ(next(loader).inputs, iota(5, 8));
  EXPECT_EQ(next(loader).inputs, iota(128000, 8));  // wrapped around to the wide shard
  wide[3] = 0x80000000u;
  write_shard32(a, wide);
  DataLoader bad({a}, 1, 8);
  expect_error([&] { next(bad); }, {a, "token 3 is 2147483648"});
  // The shard is mapped, its ids checked as read: windows before a bad id read as ever.
  wide[3] = 3;
  wide[16] = 0x80000000u;  // the last target of the second window
  write_shard32(a, wide);
  DataLoader late({a}, 1, 8);
  EXPECT_EQ(next(late).inputs,
            (std::vector<int32_t>{128000, 128001, 128002, 3, 128004, 128005, 128006, 128007}));
  expect_error([&] { next(late); }, {a, "token 16 is 2147483648"});
}

// A shard replaced by another of a different length between the loader's opening it (its
// header) and its reading is an error naming it, not a read of the wrong tokens.
TEST(DataLoader, AShardChangedOnDiskIsNamed) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {40, 40});
  DataLoader loader(paths, 1, 8);
  write_shard(paths[0], std::vector<uint16_t>(30, 1));
  expect_error([&] { next(loader); }, {paths[0], "changed on disk", "40 tokens", "now 30"});
}

// A mapped shard truncated in place under a reader (which Loom never does: shards are replaced by
// rename) makes the read past its end a SIGBUS: the process ends with status 1 and a line naming
// the shard, not a crash. (Not under the sanitizers, whose own SIGBUS handling comes first.)
TEST(DataLoaderDeathTest, AShardTruncatedWhileMappedIsNamedNotACrash) {
#if LOOM_EMU_ASAN || LOOM_EMU_TSAN
  GTEST_SKIP() << "the sanitizers handle SIGBUS themselves";
#else
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {60000});  // 120 KB of tokens: 30 pages
  EXPECT_EXIT(
      {
        DataLoader loader(paths, 1, 8);
        next(loader);  // the shard is mapped
        if (::truncate(paths[0].c_str(), kShardHeaderBytes + 16) != 0) std::_Exit(3);
        loader.set_state({0, 50000, 0});
        next(loader);
      },
      ::testing::ExitedWithCode(1),
      "token shard '.*train_000000.bin' is shorter than when it was opened");
#endif
}

TEST(DataLoader, CrossesShardsAndWrapsAround) {
  TempDir dir;
  // A step reads 2*4 + 1 = 9 tokens. Shard 0 (20 tokens) holds steps at 0 and 8 (16 + 9 > 20,
  // so its tail 16..19 is skipped); shard 1 (9 tokens) exactly one step; shard 2 (17) two.
  DataLoader loader(make_numbered_shards(dir, {20, 9, 17}), 2, 4);
  const std::vector<std::pair<int32_t, LoaderState>> expect = {
      {0, {0, 8, 0}},    {8, {1, 0, 0}},    {1000, {2, 0, 0}},
      {2000, {2, 8, 0}}, {2008, {0, 0, 1}}, {0, {0, 8, 1}},
  };
  for (size_t step = 0; step < expect.size(); ++step) {
    const Batch b = next(loader);
    EXPECT_EQ(b.inputs, iota(expect[step].first, 8)) << "step " << step;
    EXPECT_EQ(b.targets, iota(expect[step].first + 1, 8)) << "step " << step;
    EXPECT_EQ(loader.state(), expect[step].second) << "step " << step;
  }
  loader.reset();
  EXPECT_EQ(loader.state(), LoaderState{});
  EXPECT_EQ(next(loader).inputs, iota(0, 8));
}

TEST(DataLoader, ResumeFromStateIsExact) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {50, 31, 64});
  DataLoader a(paths, 3, 5);
  for (int i = 0; i < 4; ++i) next(a);
  const LoaderState saved = a.state();
  std::vector<Batch> after;
  for (int i = 0; i < 12; ++i) after.push_back(next(a));  // crosses shards and wraps

  DataLoader b(paths, 3, 5);
  b.set_state(saved);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(next(b), after[i]) << "step " << i;
  EXPECT_EQ(b.state(), a.state());
  EXPECT_GE(a.state().epoch, 1);
}

TEST(DataLoader, BadStateIsAnError) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {50, 31});
  DataLoader loader(paths, 3, 5);  // a step reads 16 tokens
  expect_error([&] { loader.set_state({2, 0, 0}); }, {"shard 2", "out of range", "2 shards"});
  expect_error([&] { loader.set_state({-1, 0, 0}); }, {"shard -1"});
  expect_error([&] { loader.set_state({1, 16, 0}); }, {"offset 16", paths[1], "31 tokens", "16"});
  expect_error([&] { loader.set_state({0, -1, 0}); }, {"offset -1"});
  expect_error([&] { loader.set_state({0, 0, -3}); }, {"epoch -3"});
  loader.set_state({1, 15, 2});  // the last offset where a step fits
  EXPECT_EQ(next(loader).inputs, iota(1015, 15));
  EXPECT_EQ(loader.state(), (LoaderState{0, 0, 3}));
}

// The union over ranks is one loader with batch × world, at every step.
TEST(DataLoader, RanksPartitionTheSingleLoaderBatch) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {61, 25, 100, 49});
  for (int world : {2, 3}) {
    const int64_t batch = 2, seq_len = 4;
    DataLoader whole(paths, batch * world, seq_len);
    std::vector<DataLoader> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(paths, batch, seq_len, r, world);
    for (int step = 0; step < 25; ++step) {
      const Batch expect = next(whole);
      Batch got;
      for (DataLoader& rank : ranks) {
        const Batch part = next(rank);
        got.inputs.insert(got.inputs.end(), part.inputs.begin(), part.inputs.end());
        got.targets.insert(got.targets.end(), part.targets.begin(), part.targets.end());
        EXPECT_EQ(rank.state(), whole.state());
      }
      ASSERT_EQ(got, expect) << "world " << world << " step " << step;
    }
    EXPECT_GE(whole.state().epoch, 1) << "the test should cover the wrap-around";
  }
}

TEST(DataLoader, ConstructionErrors) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {40, 8});
  // world 1, batch 2, seq_len 4: a step reads 9 tokens; shard 1 has 8.
  expect_error([&] { DataLoader(paths, 2, 4); }, {paths[1], "8 tokens", "9"});
  // world 5: 5 × 2 × 4 + 1 = 41 > 40.
  expect_error([&] { DataLoader({paths[0]}, 2, 4, 0, 5); }, {paths[0], "40 tokens", "= 41"});
  expect_error([&] { DataLoader({paths[0]}, 1, 4, 2, 2); }, {"rank 2"});
  expect_error([&] { DataLoader({paths[0]}, 0, 4); }, {"batch = 0"});
  expect_error([&] { DataLoader({}, 1, 4); }, {"no shards"});
  const std::string missing = dir.file("gone.bin");
  expect_error([&] { DataLoader({missing}, 1, 4); }, {missing});
}

}  // namespace
}  // namespace loom
