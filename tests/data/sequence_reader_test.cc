#include "data/sequence_reader.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <utility>

#include "data/shard.h"
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::make_numbered_shards;
using testing::TempDir;

constexpr int64_t kT = 4;

// The next sequence's inputs; its targets are checked to be them shifted by one.
std::vector<int32_t> next(SequenceReader& reader) {
  std::vector<int32_t> in(kT), tg(kT);
  reader.next(in.data(), tg.data());
  for (int64_t i = 0; i < kT; ++i)
    EXPECT_EQ(tg[static_cast<size_t>(i)], in[static_cast<size_t>(i)] + 1);
  return in;
}

// (shard, window) of a sequence read from make_shards' shards.
std::pair<int, int> where(const std::vector<int32_t>& seq) {
  EXPECT_EQ(seq[0] % 1000 % kT, 0) << "not a window's start: " << seq[0];
  return {seq[0] / 1000, seq[0] % 1000 / static_cast<int>(kT)};
}

// In order, the reader is a DataLoader of batch 1: the same sequences and the same positions,
// across shards with tails shorter than a window and over epochs.
TEST(SequenceReader, InOrderIsADataLoaderOfBatchOne) {
  TempDir dir;
  const auto shards = make_numbered_shards(dir, {23, 9, 40});  // 5, 2 and 9 windows of 4 (+1)
  SequenceReader reader(shards, kT);
  DataLoader loader(shards, 1, kT);
  for (int i = 0; i < 50; ++i) {
    std::vector<int32_t> in(kT), tg(kT);
    loader.next_batch(in.data(), tg.data());
    ASSERT_EQ(next(reader), in) << "sequence " << i;
    ASSERT_EQ(reader.state(), loader.state()) << "sequence " << i;
  }
  EXPECT_EQ(reader.state().epoch, 50 / 16);
}

// Shuffled, an epoch reads every window of every shard once, shard by shard in a permuted shard
// order, each shard's windows permuted; the next epoch orders them differently.
TEST(SequenceReader, ShuffledEpochReadsEveryWindowOnceInAnotherOrder) {
  TempDir dir;
  const auto shards = make_numbered_shards(dir, {81, 41, 61, 101});  // 20, 10, 15, 25 windows
  const std::map<int, int> windows = {{0, 20}, {1, 10}, {2, 15}, {3, 25}};
  SequenceReader reader(shards, kT, /*shuffle_seed=*/5, "test");
  EXPECT_TRUE(reader.shuffled());
  std::vector<std::vector<std::pair<int, int>>> epochs(2);
  for (auto& epoch : epochs) {
    for (int i = 0; i < 70; ++i) epoch.push_back(where(next(reader)));
    const std::set<std::pair<int, int>> distinct(epoch.begin(), epoch.end());
    EXPECT_EQ(distinct.size(), 70u) << "a window read twice in an epoch";
    std::vector<int> shard_runs;  // the shards in the order the epoch visits them
    for (const auto& [shard, window] : epoch) {
      EXPECT_LT(window, windows.at(shard));
      if (shard_runs.empty() || shard_runs.back() != shard) shard_runs.push_back(shard);
    }
    EXPECT_EQ(shard_runs.size(), 4u) << "a shard's windows not read together";
    bool windows_in_order = true;
    for (size_t i = 1; i < epoch.size(); ++i)
      if (epoch[i].first == epoch[i - 1].first && epoch[i].second != epoch[i - 1].second + 1)
        windows_in_order = false;
    EXPECT_FALSE(windows_in_order);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_EQ(reader.state(), (LoaderState{0, 0, 2}));
}

// Epochs read, fractional, in order and shuffled: the completed ones plus the share of this
// epoch's windows read (the shards before the current one in the epoch's order, then its own).
TEST(SequenceReader, EpochsReadCountEveryShardsWindows) {
  TempDir dir;
  const auto shards = make_numbered_shards(dir, {41, 21, 81});  // 10 + 5 + 20 = 35 windows
  for (const std::optional<uint64_t> seed :
       {std::optional<uint64_t>{}, std::optional<uint64_t>{3}}) {
    SequenceReader reader(shards, kT, seed, "e");
    EXPECT_EQ(reader.epochs_read(), 0.0);
    for (int i = 1; i <= 80; ++i) {
      reader.skip();
      ASSERT_DOUBLE_EQ(reader.epochs_read(), i / 35 + static_cast<double>(i % 35) / 35) << i;
    }
  }
}

// The order is a function of (seed, name) and the shards: the same twice, another for another
// seed or name; a reader resumed from a state continues it exactly.
TEST(SequenceReader, ShuffledOrderIsTheSeedsAndResumes) {
  TempDir dir;
  const auto shards = make_numbered_shards(dir, {81, 41, 61});
  const auto read = [&](uint64_t seed, const std::string& name) {
    SequenceReader reader(shards, kT, seed, name);
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < 100; ++i) out.push_back(next(reader));
    return out;
  };
  const auto reference = read(5, "a");
  EXPECT_EQ(read(5, "a"), reference);
  EXPECT_NE(read(6, "a"), reference);
  EXPECT_NE(read(5, "b"), reference);

  SequenceReader first(shards, kT, 5, "a");
  for (int i = 0; i < 37; ++i) ASSERT_EQ(next(first), reference[static_cast<size_t>(i)]);
  SequenceReader second(shards, kT, 5, "a");
  second.set_state(first.state());
  for (size_t i = 37; i < reference.size(); ++i) ASSERT_EQ(next(second), reference[i]) << i;
  // skip() moves as next() does.
  SequenceReader skipping(shards, kT, 5, "a");
  for (int i = 0; i < 60; ++i) skipping.skip();
  EXPECT_EQ(next(skipping), reference[60]);
}

TEST(SequenceReader, OutOfRangeStatesAreNamed) {
  TempDir dir;
  const auto shards = make_numbered_shards(dir, {41, 21});  // 10 and 5 windows
  SequenceReader shuffled(shards, kT, 1, "x");
  expect_error([&] { shuffled.set_state({0, 2, 0}); }, {"offset 2", "shuffled", "sequences of 4"});
  expect_error([&] { shuffled.set_state({2, 0, 0}); }, {"shard 2", "there are 2 shards"});
  expect_error([&] { shuffled.set_state({0, 0, -1}); }, {"epoch -1"});
  // Place 0 of epoch 3 may be either shard; a 6th window of the 5-window shard is out of range,
  // a 10th of the 10-window one too.
  expect_error([&] { shuffled.set_state({0, 40, 3}); }, {"offset 40", "out of range"});
  SequenceReader in_order(shards, kT);
  in_order.set_state({0, 5, 1});  // any offset a window fits at, as a DataLoader's
  EXPECT_EQ(next(in_order)[0], 5);
  expect_error([&] { in_order.set_state({1, 17, 0}); }, {"offset 17", shards[1], "5 sequences"});
}

}  // namespace
}  // namespace loom
