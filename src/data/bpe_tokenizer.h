// BpeTokenizer — a HuggingFace byte-level BPE tokenizer (tokenizer.json) read and run natively:
// the tokenizer of GPT-2, Llama 3, SmolLM, Qwen and most Hub models since, so that `loom sample`
// reads and writes text in an imported model's vocabulary and `loom data prepare --tokenizer`
// makes its shards without Python. Checked against HuggingFace's `tokenizers` on the three
// pre-tokenizer styles those models use (tests/data/tokenizers, tools/make_tokenizer_fixtures.py).
//
// What a tokenizer.json may hold (anything else is refused, naming the file and the key):
//   normalizer     null
//   pre_tokenizer  ByteLevel (with or without GPT-2's regex), or a Sequence of Split (a regex,
//                  behavior "Isolated") and Digits, ending with ByteLevel
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), ignore_merges; no dropout,
//                  no continuing-subword prefix or end-of-word suffix, no byte fallback
//   post_processor null, ByteLevel, TemplateProcessing (its single-sequence template: a BOS),
//                  or a Sequence of those
//   decoder        ByteLevel
//   added_tokens   matched literally in the text before anything else, as HuggingFace does
// Sentencepiece-style BPE (Llama 2, TinyLlama: "▁" and byte fallback) is not byte-level: it is
// refused by name (tools/tokenize_hf.py tokenizes for those).
//
// The regexes run on PCRE2 with Unicode properties. Text that is not UTF-8 is still encoded
// losslessly: the bytes no pattern matches become pieces of their own, and every byte has a
// token in a byte-level vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class BpeTokenizer {
 public:
  // Reads `path`: a tokenizer.json, or a directory holding one (a Hub model's). Throws
  // loom::Error naming the file and what it cannot run.
  explicit BpeTokenizer(const std::string& path);
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;

  // The ids of `text`; with add_special, the post-processor's tokens around them (a BOS).
  std::vector<int32_t> encode(std::string_view text, bool add_special = true) const;
  // The text of `ids`; added tokens (special or not) as their text. An id outside the
  // vocabulary throws loom::Error naming it.
  std::string decode(const std::vector<int32_t>& ids) const;

  // 1 + the largest id of the vocabulary and the added tokens: what model.vocab_size must reach.
  int64_t vocab_size() const;
  // The id of a token (a vocabulary entry or an added token), if it has one.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The end-of-text token Loom appends to documents and completions: the first of
  // <|end_of_text|>, <|endoftext|>, </s>, <|im_end|>, <eos> the tokenizer has (as
  // tools/tokenize_hf.py chooses it).
  std::optional<int32_t> end_of_text() const;
  const std::string& path() const;  // the tokenizer.json read

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
