#include "data/dataset.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "compress.h"
#include "data/shard.h"
#include "test_files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;
using testing::TempDir;

std::string shard_text(const std::string& path) {
  std::string text;
  for (uint16_t t : read_shard(path)) text += static_cast<char>(t);
  return text;
}

std::string shards_text(const std::vector<std::string>& paths) {
  std::string text;
  for (const std::string& p : paths) text += shard_text(p);
  return text;
}

TEST(ResolveShards, FileDirectoryGlob) {
  TempDir dir;
  // Created out of order; results must be sorted.
  for (const char* name : {"val_000000.bin", "train_000001.bin", "train_000000.bin"})
    write_shard(dir.file(name), {1, 2, 3});
  testing::write_bytes(dir.file("README.txt"), "not a shard");
  fs::create_directory(dir.file("sub.bin"));  // a directory is never a shard

  EXPECT_EQ(resolve_shards(dir.file("train_000001.bin"), "data.train"),
            std::vector<std::string>{dir.file("train_000001.bin")});
  EXPECT_EQ(resolve_shards(dir.str(), "data.train"),
            (std::vector<std::string>{dir.file("train_000000.bin"), dir.file("train_000001.bin"),
                                      dir.file("val_000000.bin")}));
  EXPECT_EQ(resolve_shards(dir.file("train_*.bin"), "data.train"),
            (std::vector<std::string>{dir.file("train_000000.bin"), dir.file("train_000001.bin")}));
  EXPECT_EQ(resolve_shards(dir.file("val_00000[0-9].bin"), "data.val"),
            std::vector<std::string>{dir.file("val_000000.bin")});
}

TEST(ResolveShards, NoMatchNamesKeyAndSpec) {
  TempDir dir;
  const std::string pattern = dir.file("train_*.bin");
  expect_error([&] { resolve_shards(pattern, "data.train"); },
               {"data.train", pattern, "matches no files"});
  const std::string missing = dir.file("missing.bin");
  expect_error([&] { resolve_shards(missing, "data.val"); }, {"data.val", missing, "no such file"});
  expect_error([&] { resolve_shards(dir.str(), "data.train"); },
               {"data.train", dir.str(), "no *.bin files"});
  expect_error([&] { resolve_shards("", "data.train"); }, {"data.train", "empty"});
}

TEST(ShardFileName, SixDigits) {
  EXPECT_EQ(shard_file_name("train", 0), "train_000000.bin");
  EXPECT_EQ(shard_file_name("val", 123), "val_000123.bin");
}

TEST(PrepareDataset, SplitsTheTailIntoValidation) {
  TempDir dir;
  const std::string a = "The first document.\n", b = "And a second, longer document!\n";
  testing::write_bytes(dir.file("a.txt"), a);
  testing::write_bytes(dir.file("b.txt"), b);
  const std::string out = dir.file("out");  // created by prepare_dataset
  const int64_t n = static_cast<int64_t>(a.size() + b.size());

  const PrepareResult r =
      prepare_dataset({dir.file("a.txt"), dir.file("b.txt")}, out, {.val_fraction = 0.25});
  EXPECT_EQ(r.train_shards, std::vector<std::string>{out + "/train_000000.bin"});
  EXPECT_EQ(r.val_shards, std::vector<std::string>{out + "/val_000000.bin"});
  EXPECT_EQ(r.val_tokens, std::llround(n * 0.25));
  EXPECT_EQ(r.train_tokens + r.val_tokens, n);
  const std::string all = a + b;
  EXPECT_EQ(shard_text(r.train_shards[0]), all.substr(0, r.train_tokens));
  EXPECT_EQ(shard_text(r.val_shards[0]), all.substr(r.train_tokens));  // the tail
  EXPECT_EQ(resolve_shards(out + "/train_*.bin", "data.train"), r.train_shards);
}

TEST(PrepareDataset, SmallShardTokensGiveManyShardsAndStaleOnesGo) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 20; ++i) text += "line " + std::to_string(i) + "\n";
  testing::write_bytes(dir.file("t.txt"), text);
  const std::string out = dir.str();
  const int64_t n = static_cast<int64_t>(text.size());

  const PrepareResult r =
      prepare_dataset({dir.file("t.txt")}, out, {.val_fraction = 0.1, .shard_tokens = 16});
  const int64_t n_train = n - std::llround(n * 0.1);
  ASSERT_EQ(static_cast<int64_t>(r.train_shards.size()), (n_train + 15) / 16);
  for (size_t i = 0; i < r.train_shards.size(); ++i) {
    EXPECT_EQ(r.train_shards[i], dir.file(shard_file_name("train", static_cast<int64_t>(i))));
    const int64_t expect = i + 1 < r.train_shards.size() ? 16 : n_train - 16 * int64_t(i);
    EXPECT_EQ(read_shard_header(r.train_shards[i]).num_tokens, expect) << i;
  }
  EXPECT_EQ(r.train_tokens, n_train);
  EXPECT_EQ(shards_text(r.train_shards) + shards_text(r.val_shards), text);

  // A rerun into the same directory with bigger shards leaves exactly its own shards.
  const PrepareResult r2 = prepare_dataset({dir.file("t.txt")}, out, {.val_fraction = 0.0});
  EXPECT_EQ(r2.train_tokens, n);
  EXPECT_EQ(r2.val_tokens, 0);
  EXPECT_TRUE(r2.val_shards.empty());
  EXPECT_EQ(resolve_shards(out + "/*.bin", "data"), r2.train_shards);
  EXPECT_TRUE(fs::exists(dir.file("t.txt")));
}

TEST(PrepareDataset, BadInputs) {
  TempDir dir;
  const std::string missing = dir.file("missing.txt");
  expect_error([&] { prepare_dataset({missing}, dir.file("out")); }, {missing, "not found"});
  testing::write_bytes(dir.file("x.txt"), "abc");
  expect_error([&] { prepare_dataset({dir.file("x.txt")}, dir.str(), {.val_fraction = 1.0}); },
               {"val_fraction"});
  expect_error([&] { prepare_dataset({dir.file("x.txt")}, dir.str(), {.shard_tokens = 0}); },
               {"shard_tokens"});
  testing::write_bytes(dir.file("e.txt"), "");
  expect_error([&] { prepare_dataset({dir.file("e.txt")}, dir.str()); }, {"empty"});
  // JSON Lines documents need an end-of-text token between them: a tokenizer's.
  testing::write_bytes(dir.file("c.jsonl.gz"), testing::gzip("{\"text\": \"abc\"}\n"));
  expect_error([&] { prepare_dataset({dir.file("c.jsonl.gz")}, dir.str()); },
               {dir.file("c.jsonl.gz"), "JSON Lines", "--tokenizer"});
  testing::write_bytes(dir.file("cut.txt.zst"), testing::zstd("some text").substr(0, 8));
  expect_error(
      [&] {
        prepare_dataset({dir.file("x.txt"), dir.file("cut.txt.zst")}, dir.str());
      },
      {dir.file("cut.txt.zst"), "ends early"});
}

// Compressed text files give the bytes of the plain ones: the same shards and split.
TEST(PrepareDataset, CompressedTextIsReadAsThePlainText) {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 300; ++i) a += "first file, line " + std::to_string(i) + "\n";
  for (int i = 0; i < 200; ++i) b += "second " + std::to_string(i * i) + "\n";
  testing::write_bytes(dir.file("a.txt"), a);
  testing::write_bytes(dir.file("b.txt"), b);
  testing::write_bytes(dir.file("a.txt.gz"), testing::gzip(a));
  testing::write_bytes(dir.file("b.txt.zst"), testing::zstd(b));
  const PrepareOptions options{.val_fraction = 0.2, .shard_tokens = 1000};
  const PrepareResult plain =
      prepare_dataset({dir.file("a.txt"), dir.file("b.txt")}, dir.file("plain"), options);
  const PrepareResult packed =
      prepare_dataset({dir.file("a.txt.gz"), dir.file("b.txt.zst")}, dir.file("packed"), options);
  EXPECT_EQ(packed.train_tokens, plain.train_tokens);
  EXPECT_EQ(packed.val_tokens, plain.val_tokens);
  EXPECT_EQ(shards_text(packed.train_shards), shards_text(plain.train_shards));
  EXPECT_EQ(shards_text(packed.val_shards), shards_text(plain.val_shards));
  EXPECT_EQ(shards_text(packed.train_shards) + shards_text(packed.val_shards), a + b);
}

// Parses "a+b=c" lines; the last line of a split may be cut, and is then skipped.
int check_additions(const std::string& text) {
  int lines = 0;
  size_t start = 0;
  while (true) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) break;  // cut last line
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t plus = line.find('+'), eq = line.find('=');
    EXPECT_TRUE(plus != std::string::npos && eq != std::string::npos && plus < eq) << line;
    if (plus == std::string::npos || eq == std::string::npos) continue;
    const std::string sa = line.substr(0, plus), sb = line.substr(plus + 1, eq - plus - 1),
                      sc = line.substr(eq + 1);
    for (const std::string* s : {&sa, &sb, &sc}) {
      EXPECT_FALSE(s->empty()) << line;
      EXPECT_EQ(s->find_first_not_of("0123456789"), std::string::npos) << line;
      EXPECT_TRUE(s->size() == 1 || (*s)[0] != '0') << "leading zero: " << line;
    }
    EXPECT_LE(sa.size(), 3u);
    EXPECT_LE(sb.size(), 3u);
    EXPECT_EQ(std::stol(sa) + std::stol(sb), std::stol(sc)) << line;
    ++lines;
  }
  return lines;
}

TEST(SynthesizeAddition, DeterministicAndCorrect) {
  TempDir dir;
  const SynthResult r1 = synthesize_addition(dir.file("s1"), 5000, 700, 42);
  const SynthResult r2 = synthesize_addition(dir.file("s2"), 5000, 700, 42);
  const SynthResult r3 = synthesize_addition(dir.file("s3"), 5000, 700, 43);
  EXPECT_EQ(r1.train_tokens, 5000);
  EXPECT_EQ(r1.val_tokens, 700);
  ASSERT_EQ(r1.train_shards, std::vector<std::string>{dir.file("s1/train_000000.bin")});
  ASSERT_EQ(r1.val_shards, std::vector<std::string>{dir.file("s1/val_000000.bin")});
  EXPECT_EQ(testing::read_bytes(r1.train_shards[0]), testing::read_bytes(r2.train_shards[0]));
  EXPECT_EQ(testing::read_bytes(r1.val_shards[0]), testing::read_bytes(r2.val_shards[0]));
  EXPECT_NE(testing::read_bytes(r1.train_shards[0]), testing::read_bytes(r3.train_shards[0]));

  const std::string train = shard_text(r1.train_shards[0]), val = shard_text(r1.val_shards[0]);
  EXPECT_GT(check_additions(train), 400);
  EXPECT_GT(check_additions(val), 50);
  EXPECT_NE(train.substr(0, 700), val);  // val continues the stream, it does not repeat it
  // Operands of every length occur.
  bool three_digit = false, one_digit = false;
  for (size_t i = 0; i + 4 < train.size(); ++i) {
    if (train[i] == '\n' && train.substr(i + 1, 4).find('+') == 3) three_digit = true;
    if (train[i] == '\n' && train[i + 2] == '+') one_digit = true;
  }
  EXPECT_TRUE(three_digit && one_digit);

  const SynthResult no_val = synthesize_addition(dir.file("s1"), 100, 0, 42);
  EXPECT_TRUE(no_val.val_shards.empty());
  EXPECT_FALSE(fs::exists(dir.file("s1/val_000000.bin")));
  EXPECT_EQ(shard_text(no_val.train_shards[0]), train.substr(0, 100));
}

}  // namespace
}  // namespace loom
