#include "data/bpe_tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "compress.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "harness/error_of.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using testutil::error_of;

const std::string kFixtures = LOOM_SOURCE_DIR "/tests/data/tokenizers";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

class BpeGolden : public ::testing::TestWithParam<const char*> {};

// Every string of tools/make_tokenizer_fixtures.py — contractions, digits, whitespace runs,
// Windows line ends, accented and non-Latin letters, emoji, Unicode spaces, added tokens in the
// text, a long run — gives HuggingFace tokenizers' ids (its BOS included where the tokenizer
// adds one) and decodes to its text.
TEST_P(BpeGolden, EncodesAndDecodesAsHuggingFaceTokenizers) {
  const std::string name = GetParam();
  const nlohmann::json expected = read_json(kFixtures + "/expected.json");
  const BpeTokenizer tok(kFixtures + "/" + name + ".json");
  const auto& strings = expected.at("strings");
  const auto& ids = expected.at(name).at("ids");
  const auto& decoded = expected.at(name).at("decoded");
  ASSERT_EQ(strings.size(), ids.size());
  for (size_t i = 0; i < strings.size(); ++i) {
    const std::string text = strings[i].get<std::string>();
    SCOPED_TRACE(text);
    const std::vector<int32_t> got = tok.encode(text);
    EXPECT_EQ(got, ids[i].get<std::vector<int32_t>>());
    EXPECT_EQ(tok.decode(got), decoded[i].get<std::string>());
  }
  EXPECT_EQ(tok.vocab_size(), 600);
}

INSTANTIATE_TEST_SUITE_P(Styles, BpeGolden,
                         ::testing::Values("gpt2", "llama3", "smollm", "qwen2", "llama2",
                                           "metaspace"));

// Writes `j` as a tokenizer.json in a directory of the test's own; returns the directory.
class BpeTokenizerFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_bpe_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const nlohmann::json& j) {
    std::ofstream(dir_ / "tokenizer.json") << j.dump();
    return dir_.string();
  }
  fs::path dir_;
};

// The Hub's older files write merges as "a b" strings; a directory is read through its
// tokenizer.json; the end-of-text token is found by name; bytes that are not UTF-8 still encode,
// losslessly, and so does every byte value; without add_special no BOS.
TEST_F(BpeTokenizerFile, MergesAsStringsDirectoriesEndOfTextAndAnyBytes) {
  nlohmann::json j = read_json(kFixtures + "/gpt2.json");
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  const BpeTokenizer as_strings(write(j)), as_pairs(kFixtures + "/gpt2.json");
  EXPECT_EQ(as_strings.path(), (dir_ / "tokenizer.json").string());
  const std::string text = "First Citizen: we are accounted poor citizens, the patricians good.";
  EXPECT_EQ(as_strings.encode(text), as_pairs.encode(text));
  EXPECT_EQ(as_pairs.end_of_text(), as_pairs.token_id("<|endoftext|>"));
  EXPECT_TRUE(as_pairs.end_of_text().has_value());

  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  bytes += "\xff\xfe caf\xc3 \xe2\x82 end";  // cut-short and stray bytes
  for (const char* name : {"gpt2", "llama3", "smollm"}) {
    const BpeTokenizer tok(kFixtures + "/" + std::string(name) + ".json");
    EXPECT_EQ(tok.decode(tok.encode(bytes, /*add_special=*/false)), bytes) << name;
  }
  const BpeTokenizer llama3(kFixtures + "/llama3.json");
  EXPECT_EQ(llama3.encode("Hello").front(), *llama3.token_id("<|begin_of_text|>"));
  EXPECT_NE(llama3.encode("Hello", false).front(), *llama3.token_id("<|begin_of_text|>"));
  EXPECT_EQ(llama3.end_of_text(), llama3.token_id("<|end_of_text|>"));
}

// What Loom cannot run is refused naming the file and the key: a normalizer other than Prepend,
// Replace and the Unicode forms (Lowercase, a regex replace), a byte-level tokenizer mixed with
// Metaspace or without its ByteLevel decoder, a sentencepiece-style one without a decoder, an
// unknown decoder or prepend scheme, a bad regex, a missing file, ids out of the vocabulary.
TEST_F(BpeTokenizerFile, WhatItCannotRunIsNamed) {
  const nlohmann::json good = read_json(kFixtures + "/gpt2.json");
  const auto error_with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = good;
    change(j);
    const std::string dir = write(j);
    return error_of([&] { BpeTokenizer t(dir); });
  };
  std::string e = error_with([](nlohmann::json& j) {
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}};
  });
  EXPECT_NE(
      e.find("tokenizer " + (dir_ / "tokenizer.json").string() + ": normalizer \"Lowercase\""),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("tools/tokenize_hf.py"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) {
    j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", " +"}}}, {"content", "_"}};
  });
  EXPECT_NE(e.find("a normalizer Replace on a regex, not a string"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", {{{"type", "Metaspace"}}, {{"type", "ByteLevel"}}}}};
  });
  EXPECT_NE(e.find("a pre_tokenizer whose one ByteLevel is not its last step"), std::string::npos)
      << e;
  e = error_with([](nlohmann::json& j) { j["decoder"] = {{"type", "Fuse"}}; });
  EXPECT_NE(e.find("a byte-level tokenizer whose decoder is not ByteLevel"), std::string::npos)
      << e;
  e = error_with([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Metaspace"}};
    j["decoder"] = nullptr;
  });
  EXPECT_NE(e.find("no decoder"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"prepend_scheme", "sometimes"}};
  });
  EXPECT_NE(e.find("a Metaspace prepend_scheme \"sometimes\""), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Metaspace"}};
    j["decoder"] = {{"type", "CTC"}};
  });
  EXPECT_NE(e.find("decoder \"CTC\" in a tokenizer that is not byte-level"), std::string::npos)
      << e;
  e = error_with([](nlohmann::json& j) { j["model"]["unk_token"] = "<unk>"; });
  EXPECT_NE(e.find("unk_token \"<unk>\", not in model.vocab"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"},
                             {"pattern", {{"Regex", "(unclosed"}}},
                             {"behavior", "Isolated"},
                             {"invert", false}},
                            {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  });
  EXPECT_NE(e.find("the regex '(unclosed' does not compile"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) { j["model"]["vocab"] = 5; });
  EXPECT_NE(e.find("model.vocab is not an object"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) { j["model"]["merges"][0] = 7; });
  EXPECT_NE(e.find("not a tokenizer.json Loom reads"), std::string::npos) << e;
  e = error_with([](nlohmann::json& j) { j["model"]["vocab"]["x"] = 1 << 30; });
  EXPECT_NE(e.find("ids up to 1073741824 for 601 tokens"), std::string::npos) << e;
  e = error_of([&] { BpeTokenizer t((dir_ / "nowhere").string()); });
  EXPECT_NE(e.find("nowhere: cannot read"), std::string::npos) << e;

  const BpeTokenizer tok(kFixtures + "/gpt2.json");
  e = error_of([&] { tok.decode({5, 600}); });
  EXPECT_NE(e.find("token 600 at position 1 is not in its vocabulary"), std::string::npos) << e;
}

// Added tokens' flags as HuggingFace applies them (expected.json's "added_flags", from
// tools/make_tokenizer_fixtures.py): lstrip / rstrip take Unicode whitespace beside a match
// (never past the previous token), single_word passes over a match inside a word (Unicode word
// characters: 日thee, éthee, _thee), and a "normalized" token is matched after the others, in
// the stretches they leave (m>! before <norm> in "<norm>!"). Byte-level (GPT-2) and
// sentencepiece-style (Llama 2, its normalizer) tokenizers.
TEST_F(BpeTokenizerFile, AddedTokensFlagsGiveTokenizersIds) {
  const nlohmann::json flags = read_json(kFixtures + "/expected.json").at("added_flags");
  const auto& strings = flags.at("strings");
  for (const char* name : {"gpt2", "llama2"}) {
    SCOPED_TRACE(name);
    nlohmann::json j = read_json(kFixtures + "/" + name + ".json");
    for (const nlohmann::json& entry : flags.at(name).at("added_tokens"))
      j["added_tokens"].push_back(entry);
    const BpeTokenizer tok(write(j));
    for (size_t i = 0; i < strings.size(); ++i)
      EXPECT_EQ(tok.encode(strings[i].get<std::string>()),
                flags.at(name).at("ids").at(i).get<std::vector<int32_t>>())
          << strings[i];
    EXPECT_FALSE(tok.lossless());  // "a   <mask>" decodes as "a<mask>"
  }
  // With a normalizer, a "normalized" added token would be matched in the normalized text: not
  // modelled, so refused by name rather than tokenized otherwise.
  nlohmann::json j = read_json(kFixtures + "/llama2.json");
  j["added_tokens"].push_back({{"id", 600},
                               {"content", "<norm>"},
                               {"single_word", false},
                               {"lstrip", false},
                               {"rstrip", false},
                               {"normalized", true},
                               {"special", false}});
  const std::string e = error_of([&] { BpeTokenizer t(write(j)); });
  EXPECT_NE(e.find("the added token \"<norm>\" is matched after the normalizer"), std::string::npos)
      << e;
}

// Unicode normalizers (utf8proc): Qwen 2's NFC, and NFD, NFKC, NFKD in its place, give
// tokenizers' ids on composed and decomposed letters, Hangul jamo, ligatures, circled and
// full-width forms; bytes that are not UTF-8 pass through them as they are.
TEST_F(BpeTokenizerFile, UnicodeNormalizersGiveTokenizersIds) {
  const nlohmann::json expected = read_json(kFixtures + "/expected.json");
  const auto& strings = expected.at("strings");
  nlohmann::json j = read_json(kFixtures + "/qwen2.json");
  ASSERT_EQ(j["normalizer"]["type"], "NFC");
  EXPECT_FALSE(BpeTokenizer(kFixtures + "/qwen2.json").lossless());  // NFC composes "e\u0301"
  for (const char* form : {"NFD", "NFKC", "NFKD"}) {
    SCOPED_TRACE(form);
    j["normalizer"] = {{"type", form}};
    const BpeTokenizer tok(write(j));
    for (size_t i = 0; i < strings.size(); ++i)
      EXPECT_EQ(tok.encode(strings[i].get<std::string>()),
                expected.at("normalizer_variants").at(form).at(i).get<std::vector<int32_t>>())
          << strings[i];
  }
  const BpeTokenizer nfc(kFixtures + "/qwen2.json");
  const std::string mixed =
      "e\u0301\xff\xfe"
      "A\u030a";  // valid, stray bytes, valid
  EXPECT_EQ(nfc.decode(nfc.encode(mixed, false)), "\u00e9\xff\xfe\u00c5");
}

// `loom sample --tokenizer` prints the prompt, then the text the new tokens add to it: with
// Llama 2's decoder, decoding the new tokens alone would strip the first one's space ("▁world"
// after "Hello" is " world"); a byte-level tokenizer's bytes of one character split across the
// prompt and the continuation come out whole.
TEST_F(BpeTokenizerFile, TheTextNewTokensAddAfterAPrompt) {
  const BpeTokenizer llama2(kFixtures + "/llama2.json"), gpt2(kFixtures + "/gpt2.json");
  const std::vector<int32_t> prompt = llama2.encode("Hello");             // <s> ▁H ell o
  const std::vector<int32_t> more = llama2.encode("world again", false);  // ▁wor ld ▁again
  EXPECT_EQ(llama2.decode(more), "world again");  // what printing decode(new) got wrong
  EXPECT_EQ(llama2.decode_after(prompt, more), " world again");
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), more.begin(), more.end());
  EXPECT_EQ(llama2.decode(all), "<s> Hello world again");
  // A character cut by the split: the prompt ends with 日's first byte token, the rest follow.
  const std::vector<int32_t> ji = llama2.encode("\u65e5", false);  // ▁ <0xE6> <0x97> <0xA5>
  ASSERT_EQ(ji.size(), 4u);
  EXPECT_EQ(llama2.decode_after({ji[0], ji[1]}, {ji[2], ji[3]}), "\x97\xa5");
  const std::vector<int32_t> p = gpt2.encode("ROMEO:"), q = gpt2.encode(" O, she", false);
  EXPECT_EQ(gpt2.decode_after(p, q), " O, she");
}

// A pair listed twice among the merges takes its later rank, as in HuggingFace's map of merges
// (checked with tokenizers 0.23: " th" is then "Ġ" "th", not "Ġth"); a merge of a token the
// vocabulary lacks is refused, as tokenizers refuses it.
TEST_F(BpeTokenizerFile, ARepeatedMergeTakesItsLaterRank) {
  nlohmann::json j = read_json(kFixtures + "/gpt2.json");
  const BpeTokenizer once(kFixtures + "/gpt2.json");
  const auto id = [&](const char* token) { return *once.token_id(token); };
  EXPECT_EQ(once.encode(" th"), (std::vector<int32_t>{id("\u0120th")}));
  j["model"]["merges"].push_back(j["model"]["merges"][0]);  // ["Ġ", "t"], the first merge
  ASSERT_EQ(j["model"]["merges"][0], nlohmann::json::array({"\u0120", "t"}));
  const BpeTokenizer twice(write(j));
  EXPECT_EQ(twice.encode(" th"), (std::vector<int32_t>{id("\u0120"), id("th")}));
  j["model"]["merges"].push_back({"q", "\u00ff"});
  EXPECT_NE(error_of([&] {
              BpeTokenizer t(write(j));
            }).find("a merge \"q \u00ff\" of tokens not in model.vocab"),
            std::string::npos);
}

// Sentencepiece-style: the Metaspace pre-tokenizer's prepend schemes, split or not (and the older
// files' add_prefix_space for a scheme) give tokenizers' ids; Llama 2's byte fallback encodes
// any bytes, stray ones (not UTF-8) too, as their <0xAB> tokens, and decodes them back.
TEST_F(BpeTokenizerFile, SentencepieceStylesPrependSchemesAndByteFallback) {
  const nlohmann::json expected = read_json(kFixtures + "/expected.json");
  const auto& strings = expected.at("strings");
  nlohmann::json j = read_json(kFixtures + "/metaspace.json");
  for (const char* scheme : {"always", "first", "never"})
    for (const bool split : {true, false}) {
      const std::string variant = std::string(scheme) + (split ? " split" : " whole");
      SCOPED_TRACE(variant);
      j["pre_tokenizer"] = {{"type", "Metaspace"},
                            {"replacement", "\u2581"},
                            {"prepend_scheme", scheme},
                            {"split", split}};
      const BpeTokenizer tok(write(j));
      for (size_t i = 0; i < strings.size(); ++i)
        EXPECT_EQ(tok.encode(strings[i].get<std::string>()),
                  expected.at("variants").at(variant).at(i).get<std::vector<int32_t>>())
            << strings[i];
    }
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true}};
  const BpeTokenizer older(write(j));
  EXPECT_EQ(older.encode(strings[1].get<std::string>()),
            expected.at("variants").at("always split").at(1).get<std::vector<int32_t>>());
  EXPECT_FALSE(older.lossless());

  const BpeTokenizer llama2(kFixtures + "/llama2.json");
  EXPECT_FALSE(llama2.lossless());
  const std::string stray = "a\xff\xe6\x97 b";  // a byte that starts nothing, a cut-short 日
  const std::vector<int32_t> ids = llama2.encode(stray, /*add_special=*/false);
  const auto id = [&](const char* token) { return *llama2.token_id(token); };
  EXPECT_NE(std::find(ids.begin(), ids.end(), id("<0xFF>")), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), id("<0xE6>")), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), id("<0x97>")), ids.end());
  EXPECT_EQ(llama2.decode(ids), stray);
  EXPECT_EQ(llama2.decode(llama2.encode("日本語 and ★", false)), "日本語 and ★");
  EXPECT_EQ(*llama2.end_of_text(), id("</s>"));
}

std::vector<uint32_t> read_split(const std::vector<std::string>& shards) {
  std::vector<uint32_t> all;
  for (const std::string& s : shards) {
    const std::vector<uint32_t> t = read_shard32(s);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

// The tokens prepare_tokenized_dataset writes for `inputs` into `out` (removed after), train then
// validation.
std::vector<uint32_t> prepared_tokens(const std::vector<std::string>& inputs, const fs::path& out,
                                      const BpeTokenizer& tok, const PrepareOptions& options,
                                      int64_t eot, PrepareResult* result) {
  const PrepareResult r = prepare_tokenized_dataset(inputs, out.string(), tok, options, eot);
  if (result != nullptr) *result = r;
  std::vector<uint32_t> got = read_split(r.train_shards);
  const std::vector<uint32_t> val = read_split(r.val_shards);
  got.insert(got.end(), val.begin(), val.end());
  fs::remove_all(out);
  return got;
}

// `loom data prepare --tokenizer`: each file its tokens then the end-of-text token, the last
// val_fraction to validation, uint16 shards — uint32 once the vocabulary passes 65536 (an added
// token at id 70000 here); 37 files tokenized on 1, 3 or 8 threads give the same shards.
// (bpe_tokenizer.h: the same files as tools/tokenize_hf.py, checked on Tiny Shakespeare for the
// three styles.)
TEST_F(BpeTokenizerFile, PreparedShardsHoldEachFilesTokensThenTheEndOfText) {
  const std::string a = (dir_ / "a.txt").string(), b = (dir_ / "b.txt").string();
  std::vector<std::string> many;  // files tokenized in parallel, appended in their order
  for (int k = 0; k < 37; ++k) {
    many.push_back((dir_ / ("m" + std::to_string(k) + ".txt")).string());
    std::ofstream(many.back()) << "file " << k << ": "
                               << std::string(static_cast<size_t>(k * 7), 'x') << " caf\u00e9 "
                               << (k % 2 ? "\r\n" : "\n");
  }
  std::ofstream(a) << "First Citizen:\nBefore we proceed any further, hear me speak.\n";
  std::ofstream(b) << "All:\nSpeak, speak. 12345 café\n";
  nlohmann::json wide_json = read_json(kFixtures + "/llama3.json");
  wide_json["added_tokens"].push_back({{"id", 70000},
                                       {"content", "<|wide|>"},
                                       {"special", true},
                                       {"single_word", false},
                                       {"lstrip", false},
                                       {"rstrip", false},
                                       {"normalized", false}});
  const BpeTokenizer narrow(kFixtures + "/llama3.json"), wide(write(wide_json));
  for (const BpeTokenizer* tok : {&narrow, &wide}) {
    SCOPED_TRACE(tok->path());
    PrepareOptions options;
    options.val_fraction = 0.25;
    options.shard_tokens = 7;
    const int64_t eot = *tok->end_of_text();
    const PrepareResult r =
        prepare_tokenized_dataset({a, b}, (dir_ / "out").string(), *tok, options, eot);
    std::vector<uint32_t> want;
    for (const char* text : {"First Citizen:\nBefore we proceed any further, hear me speak.\n",
                             "All:\nSpeak, speak. 12345 café\n"}) {
      for (const int32_t id : tok->encode(text)) want.push_back(static_cast<uint32_t>(id));
      want.push_back(static_cast<uint32_t>(eot));
    }
    const auto n_val = static_cast<int64_t>(std::llround(0.25 * static_cast<double>(want.size())));
    EXPECT_EQ(r.val_tokens, n_val);
    EXPECT_EQ(r.train_tokens + r.val_tokens, static_cast<int64_t>(want.size()));
    std::vector<uint32_t> got = read_split(r.train_shards);
    const std::vector<uint32_t> val = read_split(r.val_shards);
    got.insert(got.end(), val.begin(), val.end());
    EXPECT_EQ(got, want);
    EXPECT_EQ(read_shard_header(r.train_shards[0]).token_bytes, tok == &wide ? 4 : 2);
    fs::remove_all(dir_ / "out");
  }
  // One thread or several, batches of any size: the same shards, and no scratch file left.
  std::vector<uint32_t> want;
  for (const std::string& file : many) {
    std::ifstream in(file, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const int32_t id : narrow.encode(text)) want.push_back(static_cast<uint32_t>(id));
    want.push_back(1);
  }
  for (const int threads : {1, 3, 8}) {
    SCOPED_TRACE(threads);
    PrepareOptions options;
    options.shard_tokens = 100;
    options.threads = threads;
    const PrepareResult r =
        prepare_tokenized_dataset(many, (dir_ / "par").string(), narrow, options, 1);
    std::vector<uint32_t> got = read_split(r.train_shards);
    const std::vector<uint32_t> val = read_split(r.val_shards);
    got.insert(got.end(), val.begin(), val.end());
    EXPECT_EQ(got, want);
    EXPECT_FALSE(fs::exists(dir_ / "par" / ".prepare_tokens.tmp"));
  }
  std::string e =
      error_of([&] { prepare_tokenized_dataset({a}, (dir_ / "out").string(), narrow, {}, 600); });
  EXPECT_NE(e.find("eot = 600 is not a token of"), std::string::npos) << e;
  many.insert(many.begin() + 20, (dir_ / "missing.txt").string());
  e = error_of([&] { prepare_tokenized_dataset(many, (dir_ / "par").string(), narrow, {}, 1); });
  EXPECT_NE(e.find("input file '" + (dir_ / "missing.txt").string() + "': cannot open"),
            std::string::npos)
      << e;
  PrepareOptions negative;
  negative.threads = -1;
  e = error_of(
      [&] { prepare_tokenized_dataset({a}, (dir_ / "out").string(), narrow, negative, 1); });
  EXPECT_NE(e.find("threads = -1: must be >= 0"), std::string::npos) << e;
}

// `loom data prepare CORPUS.jsonl[.gz|.zst] --tokenizer`: a document a JSON line, the text at
// --json-key; the same shards as the documents written as text files, compressed or not, with
// any thread count and batch size (batches that cut a file between lines included).
TEST_F(BpeTokenizerFile, JsonLinesCorporaAreADocumentALine) {
  const BpeTokenizer tok(kFixtures + "/llama3.json");
  const std::vector<std::string> texts{
      "First Citizen:\nBefore we proceed any further, hear me speak.\n",
      "All:\nSpeak, speak. 12345 caf\u00e9 \u2603",
      "",  // skipped: no BOS and end-of-text for nothing
      "  leading spaces, a tab\tand \"quotes\"",
      "Second Citizen:\r\nYou are all resolved rather to die than to famish?"};
  // The corpus as JSON Lines: other keys beside the text, blank lines, a \r\n line end.
  std::string jsonl;
  for (size_t i = 0; i < texts.size(); ++i) {
    nlohmann::json line = {{"id", i}, {"text", texts[i]}, {"meta", {{"url", "x"}}}};
    jsonl += line.dump() + (i == 1 ? "\r\n\n   \n" : "\n");
  }
  const auto file = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
    return (dir_ / name).string();
  };
  const std::string plain = file("c.jsonl", jsonl), gz = file("c.jsonl.gz", testing::gzip(jsonl)),
                    zst = file("c.json.zst", testing::zstd(jsonl));
  // The documents as text files (each one document), the empty one left out.
  std::vector<std::string> text_files;
  for (size_t i = 0; i < texts.size(); ++i)
    if (!texts[i].empty()) text_files.push_back(file("d" + std::to_string(i) + ".txt", texts[i]));
  const int64_t eot = *tok.end_of_text();
  const auto tokens_of = [&](const std::vector<std::string>& inputs, PrepareOptions options,
                             PrepareResult* result = nullptr) {
    options.val_fraction = 0.3;
    options.shard_tokens = 11;
    return prepared_tokens(inputs, dir_ / "out", tok, options, eot, result);
  };
  std::vector<uint32_t> want;
  for (const std::string& text : texts) {
    if (text.empty()) continue;
    for (const int32_t id : tok.encode(text)) want.push_back(static_cast<uint32_t>(id));
    want.push_back(static_cast<uint32_t>(eot));
  }
  EXPECT_EQ(tokens_of(text_files, {}), want);
  PrepareResult r;
  EXPECT_EQ(tokens_of({plain}, {}, &r), want);
  EXPECT_EQ(r.documents, 4);
  EXPECT_EQ(r.empty_documents, 1);
  for (const std::string& input : {gz, zst})
    for (const int threads : {1, 3})
      for (const int64_t batch_bytes : {int64_t{1}, int64_t{60}, int64_t{1} << 20}) {
        SCOPED_TRACE(input + " threads " + std::to_string(threads) + " batch " +
                     std::to_string(batch_bytes));
        PrepareOptions options;
        options.threads = threads;
        options.batch_bytes = batch_bytes;
        EXPECT_EQ(tokens_of({input}, options), want);
      }
  // Text files and JSON Lines mixed, in the order given.
  std::vector<uint32_t> mixed = want;
  mixed.insert(mixed.end(), want.begin(), want.end());
  PrepareOptions small;
  small.batch_bytes = 100;
  EXPECT_EQ(tokens_of({zst, text_files[0], text_files[1], text_files[2], text_files[3]}, small),
            mixed);
  // Progress after each batch: growing counts, the last one the whole corpus.
  std::vector<PrepareProgress> reports;
  PrepareOptions watched;
  watched.batch_bytes = 60;
  watched.progress = [&](const PrepareProgress& p) { reports.push_back(p); };
  EXPECT_EQ(tokens_of({zst}, watched), want);
  ASSERT_GE(reports.size(), 3u);  // 60-byte batches of ~100-byte lines: a line each
  for (size_t i = 1; i < reports.size(); ++i) {
    EXPECT_GT(reports[i].bytes, reports[i - 1].bytes);
    EXPECT_GE(reports[i].documents, reports[i - 1].documents);
    EXPECT_GE(reports[i].tokens, reports[i - 1].tokens);
    EXPECT_GE(reports[i].seconds, reports[i - 1].seconds);
  }
  size_t line_bytes = 0;  // the non-blank lines, as read (a \r kept)
  for (size_t from = 0; from < jsonl.size();) {
    const size_t end = jsonl.find('\n', from);
    const std::string line = jsonl.substr(from, end - from);
    if (line.find_first_not_of(" \t\r") != std::string::npos) line_bytes += line.size();
    from = end + 1;
  }
  EXPECT_EQ(reports.back().bytes, static_cast<int64_t>(line_bytes));
  EXPECT_EQ(reports.back().documents, 4);
  EXPECT_EQ(reports.back().tokens, static_cast<int64_t>(want.size()));
  // Another key.
  const std::string body = file("b.jsonl", "{\"body\": \"Speak, speak.\"}\n");
  PrepareOptions by_body;
  by_body.json_key = "body";
  std::vector<uint32_t> speak;
  for (const int32_t id : tok.encode("Speak, speak.")) speak.push_back(static_cast<uint32_t>(id));
  speak.push_back(static_cast<uint32_t>(eot));
  EXPECT_EQ(tokens_of({body}, by_body), speak);

  // A line without the text, not an object or not JSON: named by file and line, nothing written.
  for (const auto& [bytes, words] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {jsonl + "{\"txt\": \"a\"}\n", {"line 8", "no string \"text\""}},
           {jsonl + "{\"text\": 7}\n", {"line 8", "no string \"text\""}},
           {jsonl + "[\"text\"]\n", {"line 8", "no string \"text\""}},
           {"\n{\"text\": \"a\n", {"line 2", "not JSON"}},
           {"{\"text\": \"\xff\"}\n", {"line 1", "not JSON"}}}) {
    const std::string bad = file("bad.jsonl.gz", testing::gzip(bytes));
    for (const int threads : {1, 3}) {
      PrepareOptions options;
      options.threads = threads;
      options.batch_bytes = 50;
      const std::string e = error_of(
          [&] { prepare_tokenized_dataset({bad}, (dir_ / "bad").string(), tok, options, eot); });
      for (const std::string& word : words) EXPECT_NE(e.find(word), std::string::npos) << e;
      EXPECT_NE(e.find(bad), std::string::npos) << e;
      EXPECT_FALSE(fs::exists(dir_ / "bad" / "train_000000.bin"));
    }
  }
  // Only empty documents: no tokens, said so.
  const std::string empty = file("e.jsonl", "{\"text\": \"\"}\n");
  const std::string e =
      error_of([&] { prepare_tokenized_dataset({empty}, (dir_ / "e").string(), tok, {}, eot); });
  EXPECT_NE(e.find("give no tokens"), std::string::npos) << e;
  EXPECT_NE(e.find("1 empty documents"), std::string::npos) << e;
}

// `loom data prepare CORPUS.parquet --tokenizer`: a document a row, the text in column --json-key;
// a null or empty text skipped and counted; the same tokens from every writer's layout of the
// same texts (tests/data/parquet), with any thread count and batch size; a Parquet file and a
// JSON Lines one mixed in order; a missing column named before anything is written.
TEST_F(BpeTokenizerFile, ParquetCorporaAreADocumentARow) {
  const BpeTokenizer tok(kFixtures + "/gpt2.json");
  const int64_t eot = *tok.end_of_text();
  const std::string parquet = std::string(LOOM_SOURCE_DIR) + "/tests/data/parquet/";
  const nlohmann::json expected = read_json(parquet + "expected.json");
  std::vector<uint32_t> want, want_with_nulls;
  int64_t documents = 0, empty = 0;
  for (size_t i = 0; i < expected["texts"].size(); ++i) {
    const std::string text = expected["texts"][i].get<std::string>();
    const bool null = i % 11 == 3;  // as tools/make_parquet_fixtures.py writes "with_nulls"
    if (text.empty() || null) ++empty;
    if (text.empty()) continue;
    std::vector<uint32_t> tokens;
    for (const int32_t id : tok.encode(text)) tokens.push_back(static_cast<uint32_t>(id));
    tokens.push_back(static_cast<uint32_t>(eot));
    want.insert(want.end(), tokens.begin(), tokens.end());
    if (!null) {
      ++documents;
      want_with_nulls.insert(want_with_nulls.end(), tokens.begin(), tokens.end());
    }
  }
  const auto tokens_of = [&](const std::vector<std::string>& inputs, PrepareOptions options,
                             PrepareResult* result = nullptr) {
    options.val_fraction = 0.1;
    options.shard_tokens = 1000;
    return prepared_tokens(inputs, dir_ / "out", tok, options, eot, result);
  };
  for (const auto& [name, kind] : expected["files"].items()) {
    if (kind == "empty") continue;
    for (const int threads : {1, 3})
      for (const int64_t batch_bytes : {int64_t{1}, int64_t{5000}, int64_t{64} << 20}) {
        SCOPED_TRACE(name + " threads " + std::to_string(threads) + " batch " +
                     std::to_string(batch_bytes));
        PrepareOptions options;
        options.threads = threads;
        options.batch_bytes = batch_bytes;
        PrepareResult r;
        EXPECT_EQ(tokens_of({parquet + name}, options, &r),
                  kind == "texts" ? want : want_with_nulls);
        if (kind == "with_nulls") {
          EXPECT_EQ(r.documents, documents);
          EXPECT_EQ(r.empty_documents, empty);
        }
      }
  }
  // With JSON Lines, in the order given; the empty file adds nothing.
  std::string jsonl;
  for (const auto& text : expected["texts"]) jsonl += nlohmann::json{{"text", text}}.dump() + "\n";
  std::ofstream(dir_ / "c.jsonl") << jsonl;
  std::vector<uint32_t> mixed = want_with_nulls;
  mixed.insert(mixed.end(), want.begin(), want.end());
  EXPECT_EQ(tokens_of({parquet + "zstd_dict_v2.parquet", parquet + "empty.parquet",
                       (dir_ / "c.jsonl").string()},
                      {}),
            mixed);
  // Another column, a missing one, and the byte tokenizer: named, nothing written.
  PrepareOptions by_id;
  by_id.json_key = "body";
  std::string e = error_of([&] {
    prepare_tokenized_dataset({(dir_ / "c.jsonl").string(), parquet + "snappy_dict_v1.parquet"},
                              (dir_ / "bad").string(), tok, by_id, eot);
  });
  EXPECT_NE(e.find("snappy_dict_v1.parquet': no column 'body' (its columns: id, text, meta"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "train_000000.bin"));
  e = error_of(
      [&] { prepare_dataset({parquet + "snappy_dict_v1.parquet"}, (dir_ / "b").string()); });
  EXPECT_NE(e.find("Parquet documents need --tokenizer"), std::string::npos) << e;
}

// `loom data prepare --sft --tokenizer`: each prompt with the tokenizer's BOS, not counted; the
// completion without one and the end-of-text token, counted.
TEST_F(BpeTokenizerFile, SftExamplesInTheTokenizersVocabularyCountTheirCompletions) {
  const std::string jsonl = (dir_ / "ex.jsonl").string();
  std::ofstream(jsonl) << R"({"prompt": "Who speaks?", "completion": " First Citizen."})"
                       << "\n"
                       << R"({"prompt": "What then?", "completion": " Speak, speak."})"
                       << "\n";
  const BpeTokenizer tok(kFixtures + "/llama3.json");
  const int64_t eot = *tok.end_of_text();
  PrepareOptions options;
  options.val_fraction = 0;
  const PrepareResult r = prepare_sft_dataset({jsonl}, (dir_ / "out").string(), options, eot, &tok);
  std::vector<uint32_t> want;
  std::vector<uint8_t> want_counts;
  for (const auto& [prompt, completion] :
       {std::pair{"Who speaks?", " First Citizen."}, std::pair{"What then?", " Speak, speak."}}) {
    for (const int32_t id : tok.encode(prompt)) {
      want.push_back(static_cast<uint32_t>(id));
      want_counts.push_back(0);
    }
    for (const int32_t id : tok.encode(completion, false)) {
      want.push_back(static_cast<uint32_t>(id));
      want_counts.push_back(1);
    }
    want.push_back(static_cast<uint32_t>(eot));
    want_counts.push_back(1);
  }
  ASSERT_EQ(r.train_shards.size(), 1u);
  EXPECT_EQ(read_shard32(r.train_shards[0]), want);
  std::vector<uint8_t> counts(want.size());
  LossMaskFile(loss_mask_path(r.train_shards[0]))
      .read(0, static_cast<int64_t>(counts.size()), counts.data());
  EXPECT_EQ(counts, want_counts);
  EXPECT_EQ(want.front(), static_cast<uint32_t>(*tok.token_id("<|begin_of_text|>")));
  const std::string e =
      error_of([&] { prepare_sft_dataset({jsonl}, (dir_ / "out").string(), options, -1, &tok); });
  EXPECT_NE(e.find("the completions need their end-of-text"), std::string::npos) << e;
}

// Conversations (`--sft --chat-template`): TRL's {"messages": [...]} rendered in ChatML (SmolLM's
// tokenizer) or Llama 3's template after the BOS, each part tokenized on its own: the assistant
// turns' content and end marker count, headers, system and user turns do not; with
// {"prompt": [...], "completion": [...]} only the completion's. The markers are single tokens.
// `loom data prepare EXAMPLES.parquet --sft`: the Hub's layouts — "messages" as a list of {role,
// content} beside other columns (ultrachat_200k's), TRL's "prompt" and "completion" as lists of
// messages, or as strings — give the shards and loss masks of the same rows as JSON Lines, with
// any thread count and batch; a null or missing field is refused naming the file and row.
TEST_F(BpeTokenizerFile, ParquetExamplesAreTheirRowsAsJsonLines) {
  const BpeTokenizer tok(kFixtures + "/smollm.json");
  const std::string parquet = std::string(LOOM_SOURCE_DIR) + "/tests/data/parquet/";
  const nlohmann::json expected = read_json(parquet + "conversations.json");
  // Shards and masks, train then validation.
  const auto prepared = [&](const std::string& input, const PrepareOptions& options) {
    const PrepareResult r =
        prepare_sft_dataset({input}, (dir_ / "out").string(), options, *tok.end_of_text(), &tok);
    std::pair<std::vector<uint32_t>, std::vector<uint8_t>> got;
    for (const auto* split : {&r.train_shards, &r.val_shards})
      for (const std::string& shard : *split) {
        const std::vector<uint32_t> tokens = read_shard32(shard);
        std::vector<uint8_t> counts(tokens.size());
        LossMaskFile(loss_mask_path(shard))
            .read(0, static_cast<int64_t>(counts.size()), counts.data());
        got.first.insert(got.first.end(), tokens.begin(), tokens.end());
        got.second.insert(got.second.end(), counts.begin(), counts.end());
      }
    fs::remove_all(dir_ / "out");
    return got;
  };
  for (const char* name : {"sft_messages.parquet", "sft_prompt_completion.parquet",
                           "sft_prompt_completion_conversational.parquet"}) {
    SCOPED_TRACE(name);
    // The rows as JSON Lines, less the columns the examples do not read.
    std::string jsonl;
    for (nlohmann::json row : expected[name]) {
      row.erase("id");
      if (row.contains("messages")) row.erase("prompt");
      jsonl += row.dump() + "\n";
    }
    std::ofstream(dir_ / "rows.jsonl") << jsonl;
    PrepareOptions options;
    options.val_fraction = 0.2;
    options.chat_template = "chatml";
    const auto want = prepared((dir_ / "rows.jsonl").string(), options);
    ASSERT_GT(want.first.size(), 1000u);
    EXPECT_GT(std::count(want.second.begin(), want.second.end(), 1), 100);
    for (const int threads : {1, 2})
      for (const int64_t batch_bytes : {int64_t{1}, int64_t{1} << 20}) {
        options.threads = threads;
        options.batch_bytes = batch_bytes;
        EXPECT_EQ(prepared(parquet + name, options), want);
      }
  }
  // ShareGPT's "conversations" of {from, value}: the messages' shards and masks.
  PrepareOptions chat_options;
  chat_options.chat_template = "chatml";
  EXPECT_EQ(prepared(parquet + "sft_sharegpt.parquet", chat_options),
            prepared(parquet + "sft_messages.parquet", chat_options));
  // A null list of messages (the zstd file's row 4): named.
  PrepareOptions chatml;
  chatml.chat_template = "chatml";
  std::string e = error_of([&] {
    prepare_sft_dataset({parquet + "sft_messages_zstd_v2.parquet"}, (dir_ / "bad").string(), chatml,
                        *tok.end_of_text(), &tok);
  });
  EXPECT_NE(e.find("sft_messages_zstd_v2.parquet' row 4: \"messages\" is not a list"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "train_000000.bin"));
  // A file of other columns: named, with its columns.
  e = error_of([&] {
    prepare_sft_dataset({parquet + "snappy_dict_v1.parquet"}, (dir_ / "bad").string(), {},
                        *tok.end_of_text(), &tok);
  });
  EXPECT_NE(e.find("no column \"messages\""), std::string::npos) << e;
  EXPECT_NE(e.find("its columns: id, text, meta.url, meta.score"), std::string::npos) << e;
}

TEST_F(BpeTokenizerFile, ConversationsCountTheAssistantTurnsInTheirChatTemplate) {
  const std::string jsonl = (dir_ / "chat.jsonl").string();
  std::ofstream(jsonl)
      << R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who speaks?"}, {"role": "assistant", "content": "First Citizen."}, {"role": "user", "content": "Then?"}, {"role": "assistant", "content": "All."}]})"
      << "\n"
      << R"({"prompt": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}], "completion": [{"role": "assistant", "content": "You."}]})"
      << "\n";
  struct Case {
    const char* tokenizer;
    const char* chat_template;
    const char* end;  // the end-of-turn marker
  };
  for (const Case& c :
       {Case{"smollm", "chatml", "<|im_end|>"}, Case{"llama3", "llama3", "<|eot_id|>"}}) {
    SCOPED_TRACE(c.chat_template);
    const BpeTokenizer tok(kFixtures + "/" + c.tokenizer + ".json");
    PrepareOptions options;
    options.val_fraction = 0;
    options.chat_template = c.chat_template;
    const PrepareResult r =
        prepare_sft_dataset({jsonl}, (dir_ / "out").string(), options, *tok.end_of_text(), &tok);
    std::vector<uint32_t> want;
    std::vector<uint8_t> want_counts;
    const auto add = [&](const std::string& text, bool counts) {
      for (const int32_t id : tok.encode(text, false)) {
        want.push_back(static_cast<uint32_t>(id));
        want_counts.push_back(counts ? 1 : 0);
      }
    };
    const auto turn = [&](const std::string& role, const std::string& content, bool counts) {
      if (std::string(c.chat_template) == "chatml") {
        add("<|im_start|>" + role + "\n", false);
        add(content + "<|im_end|>", counts);
        add("\n", false);
      } else {
        add("<|start_header_id|>" + role + "<|end_header_id|>\n\n", false);
        add(content + "<|eot_id|>", counts);
      }
    };
    for (int example = 0; example < 2; ++example) {
      add("", false);
      for (const int32_t id : tok.encode("", true)) {  // the BOS, where the tokenizer adds one
        want.push_back(static_cast<uint32_t>(id));
        want_counts.push_back(0);
      }
      if (example == 0) {
        turn("system", "Be brief.", false);
        turn("user", "Who speaks?", false);
        turn("assistant", "First Citizen.", true);
        turn("user", "Then?", false);
        turn("assistant", "All.", true);
      } else {
        turn("user", "Who?", false);
        turn("assistant", "Me.", false);  // the prompt's: context
        turn("assistant", "You.", true);
      }
    }
    ASSERT_EQ(r.train_shards.size(), 1u);
    const std::vector<uint32_t> got = read_shard32(r.train_shards[0]);
    EXPECT_EQ(got, want);
    std::vector<uint8_t> counts(got.size());
    LossMaskFile(loss_mask_path(r.train_shards[0]))
        .read(0, static_cast<int64_t>(counts.size()), counts.data());
    EXPECT_EQ(counts, want_counts);
    // The end marker is one token, and it counts.
    const auto end_id = static_cast<uint32_t>(*tok.token_id(c.end));
    int64_t counted_ends = 0;
    for (size_t i = 0; i < got.size(); ++i) counted_ends += got[i] == end_id && counts[i] ? 1 : 0;
    EXPECT_EQ(counted_ends, 3);
    fs::remove_all(dir_ / "out");
    // A conversation a thread (batches of one line): the same tokens and counts.
    options.threads = 2;
    options.batch_bytes = 1;
    const PrepareResult dealt =
        prepare_sft_dataset({jsonl}, (dir_ / "out").string(), options, *tok.end_of_text(), &tok);
    EXPECT_EQ(read_shard32(dealt.train_shards[0]), want);
    LossMaskFile(loss_mask_path(dealt.train_shards[0]))
        .read(0, static_cast<int64_t>(counts.size()), counts.data());
    EXPECT_EQ(counts, want_counts);
    fs::remove_all(dir_ / "out");
  }

  const BpeTokenizer smollm(kFixtures + "/smollm.json");
  const auto error_with = [&](const std::string& line, const std::string& chat_template,
                              const BpeTokenizer* tok) {
    std::ofstream(jsonl) << line << "\n";
    PrepareOptions options;
    options.chat_template = chat_template;
    return error_of([&] {
      prepare_sft_dataset({jsonl}, (dir_ / "bad").string(), options, tok ? *tok->end_of_text() : -1,
                          tok);
    });
  };
  const std::string chat =
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})";
  EXPECT_NE(error_with(chat, "", &smollm).find("line 1: a conversation"), std::string::npos);
  EXPECT_NE(error_with(chat, "llama3", &smollm).find("needs the token <|start_header_id|>"),
            std::string::npos);
  EXPECT_NE(error_with(R"({"messages": [{"role": "user", "content": "a"}]})", "chatml", &smollm)
                .find("no assistant message with content to learn"),
            std::string::npos);
  EXPECT_NE(error_with(R"({"messages": [{"role": "tool", "content": "a"}]})", "chatml", nullptr)
                .find("message 0's role \"tool\" is not system, user or assistant"),
            std::string::npos);
  EXPECT_NE(error_with(R"({"messages": [{"role": "user"}]})", "chatml", nullptr)
                .find("message 0 is not {\"role\""),
            std::string::npos);
  // ShareGPT's turns: "human", "gpt" and "system" (or the roles' own names), nothing else.
  EXPECT_NE(error_with(R"({"conversations": [{"from": "tool", "value": "a"}]})", "chatml", nullptr)
                .find("turn 0's \"from\": \"tool\" is not human, gpt or system"),
            std::string::npos);
  EXPECT_NE(error_with(R"({"conversations": [{"from": "human"}]})", "chatml", nullptr)
                .find("turn 0 is not {\"from\""),
            std::string::npos);
  EXPECT_NE(error_with(R"({"conversations": [{"from": "human", "value": "a"}]})", "chatml", nullptr)
                .find("no assistant message with content to learn"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "bad"));
}

}  // namespace
}  // namespace loom
