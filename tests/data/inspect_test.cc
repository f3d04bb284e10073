#include "data/inspect.h"

#include <gtest/gtest.h>

#include "data/shard.h"
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::make_numbered_shards;
using testing::TempDir;

// Shard s holds ids 1000*s + j: tokens, sequences and the largest id per shard, and the ids past
// a vocabulary counted with the first one's position.
TEST(InspectCorpus, CountsTokensSequencesAndIdsPastTheVocabulary) {
  TempDir dir;
  const auto paths = make_numbered_shards(dir, {41, 21});
  write_shard32(dir.file("train_000002.bin"), std::vector<uint32_t>{128000, 5, 128255});
  const CorpusSummary corpus = inspect_corpus(dir.str(), /*seq_len=*/4, /*vocab_size=*/1010);
  ASSERT_EQ(corpus.shards.size(), 3u);
  EXPECT_EQ(corpus.shards[0].path, paths[0]);
  EXPECT_EQ(corpus.tokens(), 41 + 21 + 3);
  EXPECT_EQ(corpus.shards[0].windows, 10);
  EXPECT_EQ(corpus.shards[1].windows, 5);
  EXPECT_EQ(corpus.shards[2].windows, 0);
  EXPECT_EQ(corpus.windows(), 15);
  EXPECT_EQ(corpus.shards[0].max_id, 40);
  EXPECT_EQ(corpus.shards[1].max_id, 1020);
  EXPECT_EQ(corpus.shards[2].token_bytes, 4);
  EXPECT_EQ(corpus.shards[2].max_id, 128255);
  EXPECT_EQ(corpus.shards[0].ids_outside, 0);
  EXPECT_EQ(corpus.shards[1].ids_outside, 11);  // 1010 .. 1020
  EXPECT_EQ(corpus.shards[1].first_outside, 10);
  EXPECT_EQ(corpus.shards[2].ids_outside, 2);
  EXPECT_EQ(corpus.shards[2].first_outside, 0);
  const std::string text = format_corpus(corpus, 4, 1010);
  EXPECT_NE(text.find("3 shards, 65 tokens, 15 sequences of 4"), std::string::npos) << text;
  EXPECT_NE(text.find("ids >= 1010: 11 in " + paths[1] + ", the first at token 10"),
            std::string::npos)
      << text;
  // Without a vocabulary nothing is scanned; headers only.
  const CorpusSummary headers = inspect_corpus(dir.str(), 0, 0);
  EXPECT_EQ(headers.shards[1].max_id, -1);
  EXPECT_EQ(headers.ids_outside(), 0);
  EXPECT_NE(format_corpus(inspect_corpus(paths[0], 0, 50), 0, 50).find("ids >= 50: none"),
            std::string::npos);
  expect_error([&] { inspect_corpus(dir.file("nope_*.bin"), 0, 0); }, {"nope_*.bin"});
}

// With an end-of-text id: each shard's documents (one per end-of-text token, and the tokens after
// the last one as one more) and the longest, with or without a vocabulary; the corpus line gives
// their count, mean and longest.
TEST(InspectCorpus, CountsDocumentsEndingAtTheEotToken) {
  TempDir dir;
  write_shard(dir.file("train_000000.bin"), std::vector<uint16_t>{1, 2, 9, 3, 9, 4, 5, 6, 7, 9});
  write_shard(dir.file("train_000001.bin"), std::vector<uint16_t>{9, 1, 2, 3});
  const CorpusSummary corpus = inspect_corpus(dir.str(), 0, 0, /*eot=*/9);
  ASSERT_EQ(corpus.shards.size(), 2u);
  EXPECT_EQ(corpus.shards[0].documents, 3);  // [1 2 9] [3 9] [4 5 6 7 9]
  EXPECT_EQ(corpus.shards[0].longest_document, 5);
  EXPECT_EQ(corpus.shards[1].documents, 2);  // [9] [1 2 3]
  EXPECT_EQ(corpus.shards[1].longest_document, 3);
  EXPECT_EQ(corpus.documents(), 5);
  EXPECT_EQ(corpus.shards[0].max_id, -1) << "no vocabulary given";
  const std::string text = format_corpus(corpus, 0, 0, 9);
  EXPECT_NE(text.find("5 documents ending at token 9 (mean 2.8 tokens, longest 5)"),
            std::string::npos)
      << text;
  const CorpusSummary checked = inspect_corpus(dir.str(), 0, 8, 9);
  EXPECT_EQ(checked.documents(), 5);
  EXPECT_EQ(checked.ids_outside(), 4);  // the 9s
  EXPECT_EQ(inspect_corpus(dir.str(), 0, 0).documents(), 0) << "no eot given";
}

}  // namespace
}  // namespace loom
