#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include "test_files.h"

namespace loom {
namespace {

TEST(ByteTokenizer, AllBytesRoundTrip) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const ByteTokenizer tok;
  const std::vector<int32_t> ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok.decode(ids), all);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tok.decode(b), std::string(1, static_cast<char>(b)));
  EXPECT_EQ(ByteTokenizer::kVocabSize, 256);
}

TEST(ByteTokenizer, Utf8IsLossless) {
  using namespace std::string_literals;
  const std::string text = "h\xc3\xa9llo, \xe4\xb8\x96\n\t\0end\xff"s;  // UTF-8, NUL, invalid byte
  ASSERT_EQ(text.size(), 18u);
  const ByteTokenizer tok;
  EXPECT_EQ(tok.encode(text).size(), text.size());
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(ByteTokenizer, OutOfVocabularyIsAnError) {
  const ByteTokenizer tok;
  testing::expect_error([&] { tok.decode(std::vector<int32_t>{65, 256}); }, {"256", "position 1"});
  testing::expect_error([&] { tok.decode(-1); }, {"-1"});
}

}  // namespace
}  // namespace loom
