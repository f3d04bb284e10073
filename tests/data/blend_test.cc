#include "data/blend.h"

#include <gtest/gtest.h>

#include <cmath>

#include "data/shard.h"
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::TempDir;

// Source d's shard k holds tokens 10000*d + 1000*k + j, so every token says where it came from.
std::vector<std::vector<std::string>> make_sources(const TempDir& dir,
                                                   const std::vector<std::vector<int>>& sizes) {
  std::vector<std::vector<std::string>> sources;
  for (size_t d = 0; d < sizes.size(); ++d) {
    sources.emplace_back();
    for (size_t k = 0; k < sizes[d].size(); ++k) {
      std::vector<uint16_t> tokens(static_cast<size_t>(sizes[d][k]));
      for (size_t j = 0; j < tokens.size(); ++j)
        tokens[j] = static_cast<uint16_t>(10000 * d + 1000 * k + j);
      sources.back().push_back(
          dir.file("s" + std::to_string(d) + "_train_00000" + std::to_string(k) + ".bin"));
      write_shard(sources.back().back(), tokens);
    }
  }
  return sources;
}

struct Rows {
  std::vector<int32_t> inputs, targets;
};

Rows next(BlendedLoader& loader) {
  Rows rows;
  rows.inputs.resize(static_cast<size_t>(loader.batch() * loader.seq_len()));
  rows.targets.resize(rows.inputs.size());
  loader.next_batch(rows.inputs.data(), rows.targets.data());
  return rows;
}

// The stream of sequences `steps` batches give, each sequence as its T input tokens.
std::vector<std::vector<int32_t>> read_sequences(BlendedLoader& loader, int steps) {
  std::vector<std::vector<int32_t>> out;
  const int64_t t = loader.seq_len();
  for (int s = 0; s < steps; ++s) {
    const Rows rows = next(loader);
    for (int64_t b = 0; b < loader.batch(); ++b)
      out.emplace_back(rows.inputs.begin() + b * t, rows.inputs.begin() + (b + 1) * t);
  }
  return out;
}

// Every source's count stays within one sequence of its share at every point of the stream, and
// each source's sequences are its consecutive windows (T apart, targets shifted by one, a short
// shard tail skipped, the source wrapping after its last shard while the others go on).
TEST(BlendedLoader, SharesHoldAtEveryPointAndSourcesReadInOrder) {
  TempDir dir;
  // T = 4: a window reads 5 tokens, so a 30-token shard holds windows at 0, 4, ..., 24 (7), the
  // 100-token one 24, the 21-token one 5.
  const auto sources = make_sources(dir, {{30, 30}, {100}, {21}});
  BlendedLoader loader(sources, {0.5, 0.3, 0.2}, /*batch=*/1, /*seq_len=*/4);
  EXPECT_DOUBLE_EQ(loader.share(0) + loader.share(1) + loader.share(2), 1.0);
  std::vector<int64_t> count(3, 0);
  std::vector<int64_t> expect_offset(3, 0), expect_shard(3, 0);
  const std::vector<std::vector<int>> shard_sizes = {{30, 30}, {100}, {21}};
  for (int g = 1; g <= 300; ++g) {
    const Rows rows = next(loader);
    const int d = rows.inputs[0] / 10000;
    ASSERT_TRUE(d >= 0 && d < 3) << rows.inputs[0];
    // The source's next window.
    const int32_t first =
        static_cast<int32_t>(10000 * d + 1000 * expect_shard[d] + expect_offset[d]);
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(rows.inputs[static_cast<size_t>(i)], first + i) << "sequence " << g;
      ASSERT_EQ(rows.targets[static_cast<size_t>(i)], first + i + 1) << "sequence " << g;
    }
    expect_offset[d] += 4;
    if (expect_offset[d] + 5 > shard_sizes[d][static_cast<size_t>(expect_shard[d])]) {
      expect_offset[d] = 0;
      expect_shard[d] = (expect_shard[d] + 1) % static_cast<int64_t>(shard_sizes[d].size());
    }
    ++count[static_cast<size_t>(d)];
    for (int s = 0; s < 3; ++s)
      ASSERT_LE(std::abs(static_cast<double>(count[static_cast<size_t>(s)]) - loader.share(s) * g),
                1.0)
          << "source " << s << " after " << g << " sequences";
  }
  // Source 2 (21 tokens: 5 windows) has wrapped many times; source 1 (100 tokens) several.
  const std::vector<BlendSourceState> state = loader.state();
  EXPECT_EQ(state[0].sequences + state[1].sequences + state[2].sequences, 300);
  EXPECT_EQ(state[2].position.epoch, state[2].sequences / 5);
  EXPECT_GE(state[2].position.epoch, 11);
  EXPECT_EQ(state[1].position.epoch, state[1].sequences / 24);
  EXPECT_GE(state[1].position.epoch, 3);
  EXPECT_EQ(state[0].position.epoch, state[0].sequences / 14);
}

// Rank r's rows are rows r*B .. r*B + B - 1 of one loader of batch W*B, at every step, in order
// and shuffled; all ranks hold the same state.
TEST(BlendedLoader, RanksPartitionTheSingleLoaderStream) {
  TempDir dir;
  const auto sources = make_sources(dir, {{200, 90}, {150}});
  const int world = 3, batch = 2, t = 5;
  for (const std::optional<uint64_t> shuffle :
       {std::optional<uint64_t>{}, std::optional<uint64_t>{9}}) {
    SCOPED_TRACE(shuffle ? "shuffled" : "in order");
    BlendedLoader single(sources, {2, 1}, world * batch, t, 0, 1, shuffle);
    std::vector<BlendedLoader> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back(sources, std::vector<double>{2, 1}, batch, t, r, world, shuffle);
    for (int step = 0; step < 40; ++step) {
      const Rows all = next(single);
      for (int r = 0; r < world; ++r) {
        const Rows mine = next(ranks[static_cast<size_t>(r)]);
        const auto begin = static_cast<ptrdiff_t>(r * batch * t);
        ASSERT_EQ(mine.inputs, std::vector<int32_t>(all.inputs.begin() + begin,
                                                    all.inputs.begin() + begin + batch * t))
            << "step " << step << " rank " << r;
        ASSERT_EQ(mine.targets, std::vector<int32_t>(all.targets.begin() + begin,
                                                     all.targets.begin() + begin + batch * t));
        ASSERT_EQ(ranks[static_cast<size_t>(r)].state(), single.state());
      }
    }
  }
}

// A state saved under one layout continues the same stream of sequences under another.
TEST(BlendedLoader, ResumesTheStreamUnderAnotherLayout) {
  TempDir dir;
  const auto sources = make_sources(dir, {{64, 64}, {50}, {300}});
  const std::vector<double> weights = {0.25, 0.25, 0.5};
  BlendedLoader reference(sources, weights, /*batch=*/4, 3);
  const auto expected = read_sequences(reference, 20);  // 80 sequences

  BlendedLoader first(sources, weights, /*batch=*/2, 3);
  auto stream = read_sequences(first, 6);  // 12 sequences
  BlendedLoader second(sources, weights, /*batch=*/4, 3, /*rank=*/0, /*world=*/1);
  second.set_state(first.state());
  const auto rest = read_sequences(second, 17);  // 68 more
  stream.insert(stream.end(), rest.begin(), rest.end());
  EXPECT_EQ(stream, expected);
  EXPECT_EQ(second.state(), reference.state());
}

TEST(BlendedLoader, WithoutWeightsSharesAreTheTokenCounts) {
  TempDir dir;
  const auto sources = make_sources(dir, {{100, 200}, {100}});
  BlendedLoader loader(sources, {0, 0}, 1, 4);
  EXPECT_DOUBLE_EQ(loader.share(0), 0.75);
  EXPECT_DOUBLE_EQ(loader.share(1), 0.25);
  EXPECT_EQ(loader.source_tokens(0), 300);
}

TEST(BlendedLoader, BadInputIsAnError) {
  TempDir dir;
  const auto sources = make_sources(dir, {{40}, {40}});
  expect_error([&] { BlendedLoader({}, {}, 1, 4); }, {"no sources"});
  expect_error([&] { BlendedLoader(sources, {1}, 1, 4); }, {"1 weights for 2 sources"});
  expect_error([&] { BlendedLoader(sources, {1, 0}, 1, 4); }, {"source 2's weight 0", "positive"});
  expect_error([&] { BlendedLoader(sources, {1, -1}, 1, 4); }, {"source 2's weight -1"});
  // A shard shorter than one sequence (T + 1 tokens), named.
  expect_error([&] { BlendedLoader(sources, {1, 1}, 1, 40); }, {sources[0][0], "40 tokens"});
  expect_error([&] { BlendedLoader(sources, {1, 1}, 1, 4, 2, 2); }, {"rank 2"});

  BlendedLoader loader(sources, {1, 1}, 1, 4);
  expect_error([&] { loader.set_state({BlendSourceState{}}); },
               {"1 sources, the loader 2", "data.blend"});
  expect_error(
      [&] {
        loader.set_state({BlendSourceState{}, BlendSourceState{{0, 0, 0}, -1}});
      },
      {"source 2's sequence count -1"});
  expect_error(
      [&] {
        loader.set_state({BlendSourceState{{0, 4, 0}, 1}, BlendSourceState{{0, 36, 0}, 9}});
      },
      {"source 2", "offset 36", sources[1][0]});
  EXPECT_EQ(loader.state(), (std::vector<BlendSourceState>(2)));  // unchanged by a refused state
}

// The model's vocabulary is checked on every id read, naming the source's shard.
TEST(BlendedLoader, IdsOutsideTheVocabularyFailNamingTheShard) {
  TempDir dir;
  const auto sources = make_sources(dir, {{40}, {40}});
  BlendedLoader loader(sources, {1, 1}, 2, 4);
  loader.set_vocab_size(10000);  // source 1's ids are 10000 and up
  expect_error([&] { next(loader); }, {sources[1][0], "token id 10000", "model.vocab_size"});
}

}  // namespace
}  // namespace loom
