// Fuzzes the HuggingFace BPE tokenizer (data/bpe_tokenizer.h) on both of its inputs: byte 0 even
// — the rest is a tokenizer.json (`loom sample --tokenizer`, `loom data prepare --tokenizer` read
// the user's), and a fixed text is encoded and decoded with it; byte 0 odd — the rest is text,
// encoded and decoded by the six fixture tokenizers (tests/data/tokenizers: GPT-2, Llama 3 and
// SmolLM styles, byte-level; Llama 2 and Metaspace styles, sentencepiece; Qwen 2's, byte-level
// after NFC) and GPT-2's with expected.json's "added_flags" tokens (lstrip, rstrip, single_word,
// normalized). Properties: a refusal
// is a loom::Error; every id encode gives is inside vocab_size() and decodes; a byte-level
// tokenizer is lossless — decode(encode(text)) is the text, whatever its bytes (not UTF-8
// included); so is the Llama 2 style with its byte fallback, for text without "▁" or an added
// token's text (which its normalizer and decoder change, HuggingFace's too).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.h"
#include "fuzz_common.h"

namespace {

void check_encode(const loom::BpeTokenizer& tok, std::string_view text, bool round_trips) {
  const std::vector<int32_t> ids = tok.encode(text, /*add_special=*/false);
  for (const int32_t id : ids)
    loom::fuzz::require(id >= 0 && id < tok.vocab_size(), "encode's ids are in the vocabulary");
  const std::string decoded = tok.decode(ids);
  if (round_trips) loom::fuzz::require(decoded == text, "decode(encode(text)) == text");
}

// What the Llama 2 style gives back as it was.
bool sentencepiece_keeps(std::string_view text) {
  for (const char* s : {"\u2581", "<s>", "</s>", "<unk>"})
    if (text.find(s) != std::string_view::npos) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  static const std::vector<std::unique_ptr<BpeTokenizer>> fixtures = [] {
    std::vector<std::unique_ptr<BpeTokenizer>> t;
    const std::string dir = std::string(LOOM_SOURCE_DIR) + "/tests/data/tokenizers/";
    for (const char* name : {"gpt2", "llama3", "smollm", "llama2", "metaspace", "qwen2"})
      t.push_back(std::make_unique<BpeTokenizer>(dir + name + ".json"));
    // GPT-2's with added tokens of every flag, as BpeTokenizerFile.AddedTokensFlags... reads it.
    nlohmann::json gpt2 = nlohmann::json::parse(fuzz::read_file(dir + "gpt2.json"));
    const nlohmann::json expected = nlohmann::json::parse(fuzz::read_file(dir + "expected.json"));
    for (const nlohmann::json& entry : expected.at("added_flags").at("gpt2").at("added_tokens"))
      gpt2["added_tokens"].push_back(entry);
    const auto flagged = fuzz::scratch_dir() / "gpt2_added_flags.json";
    fuzz::write_file(flagged, gpt2.dump());
    t.push_back(std::make_unique<BpeTokenizer>(flagged.string()));
    return t;
  }();
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    // Texts past 4 KiB find nothing shorter ones do not (long runs and words are unit tests'),
    // and the corpus' tokenizer.json seeds would otherwise make them 37 KiB: 6 tokenizers each.
    const std::string_view text = rest.substr(0, 4096);
    for (const auto& tok : fixtures) {
      const bool llama2 = tok->path().ends_with("/llama2.json");
      check_encode(*tok, text, tok->lossless() || (llama2 && sentencepiece_keeps(text)));
    }
    return 0;
  }
  const auto path = fuzz::scratch_dir() / "tokenizer.json";
  fuzz::write_file(path, rest);
  std::unique_ptr<BpeTokenizer> tok;
  if (!fuzz::accepts([&] { tok = std::make_unique<BpeTokenizer>(path.string()); })) return 0;
  // A tokenizer whose vocabulary lacks a character refuses text with it, by name; else a
  // byte-level one round-trips.
  fuzz::accepts(
      [&] { check_encode(*tok, "First Citizen: 12345 café 🙂 \xff\n\n  x", tok->lossless()); });
  return 0;
}
