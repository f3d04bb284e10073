// Loss masks (data.loss_mask; data/shard.h): the file format, and every reader — the loader of
// whole steps (validation's), a shuffled sequence reader, a blend — leaving out exactly the
// targets a shard's mask says, wherever its windows are read from; shards without a mask count
// every target.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "compress.h"
#include "data/blend.h"
#include "data/dataset.h"
#include "data/inspect.h"
#include "data/loader.h"
#include "data/sequence_reader.h"
#include "data/shard.h"
#include "kernels/targets.h"
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::make_numbered_shards;
using testing::TempDir;

// make_numbered_shards' tokens are 1000·s + j: a mask that counts the even ones, beside the
// shards `masked` names.
void write_even_masks(const std::vector<std::string>& shards, const std::vector<size_t>& masked) {
  for (size_t s : masked) {
    const std::vector<uint16_t> tokens = read_shard(shards[s]);
    std::vector<uint8_t> counts(tokens.size());
    for (size_t j = 0; j < tokens.size(); ++j) counts[j] = tokens[j] % 2 == 0 ? 1 : 0;
    write_loss_mask(loss_mask_path(shards[s]), counts);
  }
}

// `masked` is `plain`'s reading with the masks: each target kept where it is even or its shard
// (1000·s + j) has no mask, kIgnoredTarget otherwise. Returns how many are left out.
int64_t expect_masked(const std::vector<int32_t>& plain, const std::vector<int32_t>& masked,
                      const std::vector<size_t>& masked_shards) {
  EXPECT_EQ(plain.size(), masked.size());
  int64_t ignored = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const size_t shard = static_cast<size_t>(plain[i] / 1000);
    const bool has_mask =
        std::find(masked_shards.begin(), masked_shards.end(), shard) != masked_shards.end();
    const int32_t want = has_mask && plain[i] % 2 != 0 ? kIgnoredTarget : plain[i];
    EXPECT_EQ(masked[i], want) << "target " << i << " (token " << plain[i] << ")";
    ignored += masked[i] == kIgnoredTarget ? 1 : 0;
  }
  return ignored;
}

TEST(LossMask, RoundTripsAndRefusesWhatIsNotOne) {
  TempDir dir;
  const std::string path = dir.file("a.bin.mask");
  EXPECT_EQ(loss_mask_path(dir.file("a.bin")), path);
  write_loss_mask(path, {1, 0, 0, 1, 1});
  const LossMaskFile mask(path);
  EXPECT_EQ(mask.tokens(), 5);
  std::vector<uint8_t> got(3);
  mask.read(2, 3, got.data());
  EXPECT_EQ(got, (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ(std::filesystem::file_size(path), static_cast<uintmax_t>(kShardHeaderBytes + 5));

  expect_error(
      [&] {
        write_loss_mask(dir.file("b.mask"), {1, 2});
      },
      {"loss mask '", "b.mask", "entry 1 is 2", "0 or 1"});
  // A token shard is not a loss mask, and a truncated mask is named.
  write_shard(dir.file("c.bin"), {1, 2, 3});
  expect_error([&] { LossMaskFile bad(dir.file("c.bin")); },
               {"loss mask '", "c.bin", "bad magic", std::to_string(kLossMaskMagic)});
  std::filesystem::resize_file(path, kShardHeaderBytes + 3);
  expect_error([&] { LossMaskFile bad(path); }, {"a.bin.mask", "the header says 5 tokens"});
  expect_error([&] { LossMaskFile none(dir.file("none.mask")); },
               {"loss mask '", "none.mask", "cannot open"});
}

// The loader of whole steps (validation's, and the shards' access for every reader): each
// masked shard's targets, across shard ends, ranks and wrap-around; an unmasked shard's all
// kept; without use_loss_masks the masks are not read.
TEST(LossMask, TheLoaderLeavesOutTheTargetsEachShardsMaskSays) {
  TempDir dir;
  const std::vector<std::string> shards = make_numbered_shards(dir, {41, 33, 50});
  write_even_masks(shards, {0, 2});
  for (int rank = 0; rank < 2; ++rank) {
    DataLoader plain(shards, 2, 4, rank, 2), masked(shards, 2, 4, rank, 2);
    EXPECT_EQ(masked.use_loss_masks(), 2);
    int64_t ignored = 0;
    for (int step = 0; step < 12; ++step) {  // past the end of all three shards
      std::vector<int32_t> in(8), tg(8), min(8), mtg(8);
      plain.next_batch(in.data(), tg.data());
      masked.next_batch(min.data(), mtg.data());
      ASSERT_EQ(in, min);
      ignored += expect_masked(tg, mtg, {0, 2});
    }
    EXPECT_GT(ignored, 12 * 8 / 4);
  }
  // A mask of another length than its shard is refused naming both.
  write_loss_mask(loss_mask_path(shards[1]), std::vector<uint8_t>(32, 1));
  DataLoader loader(shards, 2, 4);
  expect_error([&] { loader.use_loss_masks(); },
               {"loss mask '", "train_000001.bin.mask", "has 32 entries", "has 33 tokens"});
}

// A shuffled sequence reader and a blend read windows in their own orders: each target is still
// masked by its own entry.
TEST(LossMask, ShuffledAndBlendedReadsMaskEachTargetByItsOwnEntry) {
  TempDir dir;
  const std::vector<std::string> shards = make_numbered_shards(dir, {41, 33, 50});
  write_even_masks(shards, {1, 2});
  SequenceReader plain(shards, 4, 7), masked(shards, 4, 7);
  EXPECT_EQ(masked.use_loss_masks(), 2);
  int64_t ignored = 0;
  for (int i = 0; i < 60; ++i) {
    std::vector<int32_t> in(4), tg(4), min(4), mtg(4);
    plain.next(in.data(), tg.data());
    masked.next(min.data(), mtg.data());
    ASSERT_EQ(in, min);
    ignored += expect_masked(tg, mtg, {1, 2});
  }
  EXPECT_GT(ignored, 60 * 4 / 4);
  const std::vector<std::vector<std::string>> sources = {{shards[0]}, {shards[1], shards[2]}};
  BlendedLoader blend_plain(sources, {0.4, 0.6}, 3, 4, 0, 1, 11),
      blend_masked(sources, {0.4, 0.6}, 3, 4, 0, 1, 11);
  EXPECT_EQ(blend_masked.use_loss_masks(), (std::vector<int64_t>{0, 2}));
  for (int i = 0; i < 20; ++i) {
    std::vector<int32_t> in(12), tg(12), min(12), mtg(12);
    blend_plain.next_batch(in.data(), tg.data());
    blend_masked.next_batch(min.data(), mtg.data());
    ASSERT_EQ(in, min);
    ignored += expect_masked(tg, mtg, {1, 2});
  }
  EXPECT_GT(ignored, 60 * 4 / 4 + 20 * 12 / 4);
}

// Writing a shard removes a mask beside it (made for its old tokens).
TEST(LossMask, ANewShardRemovesTheOldMask) {
  TempDir dir;
  const std::string shard = dir.file("train_000000.bin");
  write_shard(shard, {1, 2, 3});
  write_loss_mask(loss_mask_path(shard), {1, 1, 0});
  ASSERT_TRUE(std::filesystem::exists(loss_mask_path(shard)));
  write_shard(shard, {4, 5, 6});
  EXPECT_FALSE(std::filesystem::exists(loss_mask_path(shard)));
}

// The synthetic corpus' answer masks count the answers and their newlines only; `loom data
// inspect` reports the masked shards and the share they count.
TEST(LossMask, AdditionAnswerMasksCountTheAnswers) {
  TempDir dir;
  const SynthResult r = synthesize_addition(dir.file("synth"), 3000, 0, 5);
  const int64_t counted = write_addition_answer_masks(r.train_shards);
  const std::vector<uint16_t> tokens = read_shard(r.train_shards[0]);
  const LossMaskFile mask(loss_mask_path(r.train_shards[0]));
  std::vector<uint8_t> counts(tokens.size());
  mask.read(0, static_cast<int64_t>(tokens.size()), counts.data());
  // "12+34=46\n": 0 0 0 0 0 0 1 1 1.
  bool after_equals = false;
  int64_t answers = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    ASSERT_EQ(counts[i], after_equals ? 1 : 0) << i;
    answers += counts[i];
    if (tokens[i] == '=') after_equals = true;
    if (tokens[i] == '\n') after_equals = false;
  }
  EXPECT_EQ(counted, answers);
  EXPECT_GT(answers, 3000 / 5);
  EXPECT_LT(answers, 3000 / 2);
  const CorpusSummary corpus = inspect_corpus(r.train_shards[0], 0, 0);
  EXPECT_EQ(corpus.masked_shards(), 1);
  ASSERT_EQ(corpus.shards.size(), 1u);
  EXPECT_EQ(corpus.shards[0].mask_counted, answers);
  EXPECT_NE(format_corpus(corpus, 0, 0)
                .find("loss masks beside 1 of the shards: " + std::to_string(answers) +
                      " of their 3000 tokens"),
            std::string::npos)
      << format_corpus(corpus, 0, 0);
}

// The entries of shard `path`'s loss mask.
std::vector<uint8_t> mask_of(const std::string& path) {
  const LossMaskFile mask(loss_mask_path(path));
  std::vector<uint8_t> counts(static_cast<size_t>(mask.tokens()));
  mask.read(0, mask.tokens(), counts.data());
  return counts;
}

// Prompt-completion JSONL into shards with masks: each example's prompt bytes (entries 0), its
// completion's and the end-of-text byte (1); the last examples, whole, held out; shards cut at
// shard_tokens each with its mask; stale shards of a bigger earlier run gone with their masks.
TEST(LossMask, PreparedSftExamplesCountTheirCompletions) {
  TempDir dir;
  const std::string jsonl = dir.file("sft.jsonl");
  std::ofstream(jsonl) << R"({"prompt": "2+2=", "completion": "4"})"
                       << "\n"
                       << R"({"prompt": "Hi", "completion": " there", "id": 7})"
                       << "\n\n"
                       << R"({"prompt": "", "completion": "ok"})"
                       << "\n"
                       << R"({"prompt": "9+1=", "completion": "10"})"
                       << "\n";
  PrepareOptions options;
  options.val_fraction = 0.25;  // one of the four examples
  options.shard_tokens = 1000;
  const PrepareResult r = prepare_sft_dataset({jsonl}, dir.file("out"), options, '\n');
  ASSERT_EQ(r.train_shards.size(), 1u);
  ASSERT_EQ(r.val_shards.size(), 1u);
  const std::string train_text = "2+2=4\nHi there\nok\n", val_text = "9+1=10\n";
  const std::vector<uint8_t> train_mask = {0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
                             val_mask = {0, 0, 0, 0, 1, 1, 1};
  EXPECT_EQ(read_shard(r.train_shards[0]),
            std::vector<uint16_t>(train_text.begin(), train_text.end()));
  EXPECT_EQ(mask_of(r.train_shards[0]), train_mask);
  EXPECT_EQ(read_shard(r.val_shards[0]), std::vector<uint16_t>(val_text.begin(), val_text.end()));
  EXPECT_EQ(mask_of(r.val_shards[0]), val_mask);
  EXPECT_EQ(r.train_tokens, 18);
  EXPECT_EQ(r.val_tokens, 7);
  // Compressed, the same examples (data/input_file.h).
  testing::write_bytes(dir.file("sft.jsonl.zst"), testing::zstd(testing::read_bytes(jsonl)));
  const PrepareResult packed =
      prepare_sft_dataset({dir.file("sft.jsonl.zst")}, dir.file("packed"), options, '\n');
  EXPECT_EQ(read_shard(packed.train_shards[0]), read_shard(r.train_shards[0]));
  EXPECT_EQ(mask_of(packed.train_shards[0]), train_mask);
  EXPECT_EQ(mask_of(packed.val_shards[0]), val_mask);
  // Tokenized by three threads in batches of a line or two: the same shards and masks.
  PrepareOptions parallel = options;
  parallel.threads = 3;
  parallel.batch_bytes = 40;
  const PrepareResult dealt =
      prepare_sft_dataset({dir.file("sft.jsonl.zst")}, dir.file("dealt"), parallel, '\n');
  EXPECT_EQ(read_shard(dealt.train_shards[0]), read_shard(r.train_shards[0]));
  EXPECT_EQ(read_shard(dealt.val_shards[0]), read_shard(r.val_shards[0]));
  EXPECT_EQ(mask_of(dealt.train_shards[0]), train_mask);
  EXPECT_EQ(mask_of(dealt.val_shards[0]), val_mask);

  // Shards of 5 tokens: four of train, each with its mask; then a run of bigger shards leaves
  // one, the other three and their masks removed.
  options.shard_tokens = 5;
  const PrepareResult cut = prepare_sft_dataset({jsonl}, dir.file("out"), options, '\n');
  ASSERT_EQ(cut.train_shards.size(), 4u);
  std::vector<uint8_t> joined;
  for (const std::string& shard : cut.train_shards) {
    const std::vector<uint8_t> part = mask_of(shard);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  EXPECT_EQ(joined, train_mask);
  options.shard_tokens = 1000;
  prepare_sft_dataset({jsonl}, dir.file("out"), options, '\n');
  EXPECT_TRUE(std::filesystem::exists(loss_mask_path(dir.file("out/train_000000.bin"))));
  for (const char* gone :
       {"out/train_000001.bin", "out/train_000001.bin.mask", "out/train_000003.bin.mask"})
    EXPECT_FALSE(std::filesystem::exists(dir.file(gone))) << gone;

  // Bad lines are named by file and line before anything is written.
  const std::string bad = dir.file("bad.jsonl");
  std::ofstream(bad) << R"({"prompt": "a", "completion": "b"})"
                     << "\n"
                     << R"({"prompt": "a"})";
  expect_error([&] { prepare_sft_dataset({bad}, dir.file("bad_out"), options); },
               {"bad.jsonl' line 2", "no string \"completion\""});
  EXPECT_FALSE(std::filesystem::exists(dir.file("bad_out")));
  std::ofstream(bad) << "{\"prompt\": \"a\", \"completion\": 3}\n";
  expect_error([&] { prepare_sft_dataset({bad}, dir.file("bad_out"), options); },
               {"bad.jsonl' line 1", "no string \"completion\""});
  std::ofstream(bad) << "not json\n";
  expect_error([&] { prepare_sft_dataset({bad}, dir.file("bad_out"), options); },
               {"bad.jsonl' line 1", "not JSON"});
  // A number past a double's range (found by tests/fuzz: the JSON library's out_of_range, not a
  // parse error, escaped as an internal error).
  std::ofstream(bad) << R"({"prompt": "a", "completion": "b", "weight": 1e999})"
                     << "\n";
  expect_error([&] { prepare_sft_dataset({bad}, dir.file("bad_out"), options); },
               {"bad.jsonl' line 1", "not JSON", "number overflow"});
}

}  // namespace
}  // namespace loom
