#include "data/shard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::TempDir;

// A header with the given fields followed by `n_token_bytes` zero bytes.
std::string raw_shard(int32_t magic, int32_t version, int32_t count, size_t n_token_bytes) {
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(n_token_bytes, '\0');
  return bytes;
}

TEST(Shard, RoundTrip) {
  TempDir dir;
  const std::string path = dir.file("tokens.bin");
  std::vector<uint16_t> tokens = {0, 1, 2, 50256, 65535, 7};
  for (int i = 0; i < 1000; ++i) tokens.push_back(static_cast<uint16_t>(i * 37));
  write_shard(path, tokens);
  EXPECT_EQ(read_shard(path), tokens);
  const ShardInfo info = read_shard_header(path);
  EXPECT_EQ(info.path, path);
  EXPECT_EQ(info.num_tokens, static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(info.version, 1);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  // The bytes are llm.c's layout: little-endian header, then uint16 tokens.
  const std::string bytes = testing::read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024 + 2 * tokens.size());
  const auto u8 = [&](size_t i) { return static_cast<unsigned char>(bytes[i]); };
  EXPECT_EQ(u8(0) | u8(1) << 8 | u8(2) << 16 | u8(3) << 24, 20240520);
  EXPECT_EQ(u8(4), 1);
  EXPECT_EQ(u8(8) | u8(9) << 8, static_cast<int>(tokens.size()));
  for (size_t i = 12; i < 1024; ++i) ASSERT_EQ(u8(i), 0) << i;
  EXPECT_EQ(u8(1024 + 3 * 2), 0x50);  // 50256 = 0xc450, little endian
  EXPECT_EQ(u8(1024 + 3 * 2 + 1), 0xc4);
}

// llm.c's "llama-3" shards: magic 20240801, version 7, uint32 tokens (ids past 65535).
TEST(Shard, Uint32RoundTripInLlmcsLlama3Layout) {
  TempDir dir;
  const std::string path = dir.file("llama3.bin");
  std::vector<uint32_t> tokens = {0, 1, 65535, 65536, 128000, 128255, 7};
  write_shard32(path, tokens);
  EXPECT_EQ(read_shard32(path), tokens);
  const ShardInfo info = read_shard_header(path);
  EXPECT_EQ(info.num_tokens, 7);
  EXPECT_EQ(info.version, 7);
  EXPECT_EQ(info.token_bytes, 4);
  const std::string bytes = testing::read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024 + 4 * tokens.size());
  const auto u8 = [&](size_t i) { return static_cast<unsigned char>(bytes[i]); };
  EXPECT_EQ(u8(0) | u8(1) << 8 | u8(2) << 16 | u8(3) << 24, 20240801);
  EXPECT_EQ(u8(4), 7);
  EXPECT_EQ(u8(1024 + 4 * 4) | u8(1024 + 4 * 4 + 1) << 8 | u8(1024 + 4 * 4 + 2) << 16, 128000);
  // A uint16 reader is told what it got; the widening reader takes uint16 shards too.
  expect_error([&] { read_shard(path); }, {path, "uint32"});
  write_shard(path, std::vector<uint16_t>{3, 65535});
  EXPECT_EQ(read_shard32(path), (std::vector<uint32_t>{3, 65535}));
  // A count that does not match four bytes a token is named with the width.
  testing::write_bytes(path, raw_shard(20240801, 7, 10, 20));
  expect_error([&] { read_shard_header(path); }, {path, "10 tokens", "4 bytes per token"});
}

TEST(Shard, EmptyAndOverwrite) {
  TempDir dir;
  const std::string path = dir.file("empty.bin");
  write_shard(path, {});
  EXPECT_TRUE(read_shard(path).empty());
  write_shard(path, {9, 8});
  EXPECT_EQ(read_shard(path), (std::vector<uint16_t>{9, 8}));
}

TEST(Shard, MissingFileNamesIt) {
  TempDir dir;
  const std::string path = dir.file("nope.bin");
  expect_error([&] { read_shard(path); }, {path, "cannot open"});
  expect_error([&] { read_shard_header(path); }, {path, "cannot open"});
}

TEST(Shard, TruncatedHeader) {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  testing::write_bytes(path, raw_shard(kShardMagic, 1, 0, 0).substr(0, 100));
  expect_error([&] { read_shard(path); }, {path, "truncated header", "100 bytes", "1024"});
}

TEST(Shard, WrongMagicSaysWhatWasFoundAndExpected) {
  TempDir dir;
  const std::string path = dir.file("text.bin");
  testing::write_bytes(path, raw_shard(12345, 1, 0, 0));
  expect_error([&] { read_shard(path); },
               {path, "bad magic 12345", "expected 20240520", "not an llm.c token shard"});
  testing::write_bytes(path, raw_shard(20240801, 6, 0, 0));  // llama-3 shards are version 7
  expect_error([&] { read_shard_header(path); },
               {path, "unsupported version 6", "version 7 of uint32 shards"});
  testing::write_bytes(path, raw_shard(20240326, 3, 0, 0));
  expect_error([&] { read_shard_header(path); }, {path, "model checkpoint"});
  // A text file is the usual mistake.
  testing::write_bytes(path, std::string(2000, 'a'));
  expect_error([&] { read_shard(path); }, {path, "bad magic", "not an llm.c token shard"});
}

TEST(Shard, UnsupportedVersion) {
  TempDir dir;
  const std::string path = dir.file("v2.bin");
  testing::write_bytes(path, raw_shard(kShardMagic, 2, 0, 0));
  expect_error([&] { read_shard(path); }, {path, "unsupported version 2", "version 1"});
}

TEST(Shard, CountMustMatchFileSize) {
  TempDir dir;
  const std::string path = dir.file("cut.bin");
  write_shard(path, std::vector<uint16_t>(100, 3));
  std::filesystem::resize_file(path, 1024 + 199);  // torn last token
  expect_error([&] { read_shard(path); }, {path, "100 tokens", "1224 bytes", "1223 bytes"});
  expect_error([&] { read_shard_header(path); }, {path, "100 tokens"});
  testing::write_bytes(path, raw_shard(kShardMagic, 1, 10, 30));  // trailing garbage
  expect_error([&] { read_shard(path); }, {path, "10 tokens", "1054 bytes"});
  testing::write_bytes(path, raw_shard(kShardMagic, 1, -5, 0));
  expect_error([&] { read_shard(path); }, {path, "-5 tokens"});
}

// A shard streamed a piece at a time is the file write_shard writes, byte for byte (and a loss
// mask write_loss_mask's); unfinished — an exception between its pieces — it leaves the old file
// as it was and no temporary file behind.
TEST(Shard, StreamedFilesAreTheWholeWritesAndUnfinishedOnesLeaveNothing) {
  TempDir dir;
  std::vector<uint16_t> tokens(70000);
  std::vector<uint32_t> wide(1000);
  std::vector<uint8_t> counts(70000);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint16_t>(i * 7919);
    counts[i] = static_cast<uint8_t>(i % 3 == 0);
  }
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<uint32_t>(i * 104729);
  write_shard(dir.file("whole.bin"), tokens);
  write_shard32(dir.file("whole32.bin"), wide);
  write_loss_mask(dir.file("whole.mask"), counts);
  {
    StreamedShardFile shard(dir.file("streamed.bin"), StreamedShardFile::Kind::tokens16);
    StreamedShardFile shard32(dir.file("streamed32.bin"), StreamedShardFile::Kind::tokens32);
    StreamedShardFile mask(dir.file("streamed.mask"), StreamedShardFile::Kind::loss_mask);
    for (size_t from = 0; from < tokens.size(); from += 4096) {
      const auto n = static_cast<int64_t>(std::min<size_t>(4096, tokens.size() - from));
      shard.append(tokens.data() + from, n);
      mask.append(counts.data() + from, n);
    }
    shard32.append(wide.data(), 600);
    shard32.append(wide.data() + 600, 400);
    EXPECT_EQ(shard.count(), 70000);
    shard.finish();
    shard32.finish();
    mask.finish();
  }
  EXPECT_EQ(testing::read_bytes(dir.file("streamed.bin")),
            testing::read_bytes(dir.file("whole.bin")));
  EXPECT_EQ(testing::read_bytes(dir.file("streamed32.bin")),
            testing::read_bytes(dir.file("whole32.bin")));
  EXPECT_EQ(testing::read_bytes(dir.file("streamed.mask")),
            testing::read_bytes(dir.file("whole.mask")));
  // Unfinished over an existing shard: the shard stays, no .tmp.
  {
    StreamedShardFile shard(dir.file("whole.bin"), StreamedShardFile::Kind::tokens16);
    shard.append(tokens.data(), 5);
    EXPECT_TRUE(std::filesystem::exists(dir.file("whole.bin.tmp")));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("whole.bin.tmp")));
  EXPECT_EQ(read_shard(dir.file("whole.bin")), tokens);
}

TEST(Shard, WriteIntoMissingDirectoryNamesTheFile) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/x.bin");
  expect_error([&] { write_shard(path, {1}); }, {path, "cannot create"});
}

}  // namespace
}  // namespace loom
