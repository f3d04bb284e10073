// Fuzzes the HuggingFace byte-level BPE tokenizer (data/bpe_tokenizer.h) on both of its inputs:
// byte 0 even — the rest is a tokenizer.json (`loom sample --tokenizer`, `loom data prepare
// --tokenizer` read the user's), and a fixed text is encoded and decoded with it; byte 0 odd — the
// rest is text, encoded and decoded by the three fixture tokenizers (tests/data/tokenizers: GPT-2,
// Llama 3 and SmolLM styles). Properties: a refusal is a loom::Error; every id encode gives is
// inside vocab_size(); and a byte-level tokenizer is lossless — decode(encode(text)) is the text,
// whatever its bytes (not UTF-8 included).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.h"
#include "fuzz_common.h"

namespace {

void check_round_trip(const loom::BpeTokenizer& tok, std::string_view text) {
  const std::vector<int32_t> ids = tok.encode(text, /*add_special=*/false);
  for (const int32_t id : ids)
    loom::fuzz::require(id >= 0 && id < tok.vocab_size(), "encode's ids are in the vocabulary");
  loom::fuzz::require(tok.decode(ids) == text, "decode(encode(text)) == text");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  static const std::vector<std::unique_ptr<BpeTokenizer>> fixtures = [] {
    std::vector<std::unique_ptr<BpeTokenizer>> t;
    for (const char* name : {"gpt2", "llama3", "smollm"})
      t.push_back(std::make_unique<BpeTokenizer>(std::string(LOOM_SOURCE_DIR) +
                                                 "/tests/data/tokenizers/" + name + ".json"));
    return t;
  }();
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    for (const auto& tok : fixtures) check_round_trip(*tok, rest);
    return 0;
  }
  const auto path = fuzz::scratch_dir() / "tokenizer.json";
  fuzz::write_file(path, rest);
  std::unique_ptr<BpeTokenizer> tok;
  if (!fuzz::accepts([&] { tok = std::make_unique<BpeTokenizer>(path.string()); })) return 0;
  // A tokenizer whose vocabulary lacks a byte refuses text with it, by name; else it round-trips.
  fuzz::accepts([&] { check_round_trip(*tok, "First Citizen: 12345 café 🙂 \xff\n\n  x"); });
  return 0;
}
