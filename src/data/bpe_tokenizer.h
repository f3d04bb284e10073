// BpeTokenizer — a HuggingFace BPE tokenizer (tokenizer.json) read and run natively, so that
// `loom sample` reads and writes text in an imported model's vocabulary and `loom data prepare
// --tokenizer` makes its shards without Python. Two kinds, checked against HuggingFace's
// `tokenizers` on each style below (tests/data/tokenizers, tools/make_tokenizer_fixtures.py):
//   byte-level          GPT-2, Llama 3, SmolLM, Qwen 2 and most Hub models since: every byte is a
//                       character of the vocabulary (ByteLevel), so any bytes encode losslessly
//   sentencepiece-style Llama 2, TinyLlama, Mistral 7B, Vicuna: the text's characters are the
//                       symbols, "▁" marks spaces and a word's start, and a character without a
//                       token becomes its UTF-8 bytes' <0xAB> tokens (byte fallback)
//
// What a tokenizer.json may hold (anything else is refused, naming the file and the key):
//   normalizer     null, Prepend, Replace (of a string), NFC / NFD / NFKC / NFKD (on utf8proc;
//                  Qwen 2's: NFC), or a Sequence of those (Llama 2's: Prepend "▁", Replace " "
//                  by "▁"); run on each stretch between added tokens
//   pre_tokenizer  byte-level: ByteLevel (with or without GPT-2's regex), or a Sequence of Split
//                  (a regex, behavior "Isolated") and Digits, ending with ByteLevel;
//                  sentencepiece-style: null, Metaspace (prepend_scheme always / first / never,
//                  split or not), Split, Digits, or a Sequence of those
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), ignore_merges,
//                  byte_fallback, unk_token, fuse_unk; no dropout, no continuing-subword prefix
//                  or end-of-word suffix
//   post_processor null, ByteLevel, TemplateProcessing (its single-sequence template: a BOS),
//                  or a Sequence of those
//   decoder        byte-level: ByteLevel; sentencepiece-style: Replace (of a string),
//                  ByteFallback, Fuse, Strip, Metaspace, or a Sequence of those
//   added_tokens   matched literally in the text before anything else, as HuggingFace does
//                  (lstrip / rstrip / single_word are not applied)
//
// The regexes run on PCRE2 with Unicode properties. Text that is not UTF-8 is still encoded: a
// byte-level tokenizer's bytes no pattern matches become pieces of their own, and every byte has
// a token; a sentencepiece-style one gives each stray byte its <0xAB> token (HuggingFace takes
// only UTF-8 text). Decoding returns the tokens' bytes as they are, where HuggingFace shows
// bytes that are not UTF-8 as U+FFFD.
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

  // Whether decode(encode(text, false)) is `text` for any bytes: a byte-level tokenizer without
  // a normalizer (NFC composes "e" + U+0301 into "é", HuggingFace's too) nor an added token that
  // strips the whitespace beside it (lstrip / rstrip: the whitespace is gone). A
  // sentencepiece-style one may change leading spaces, "▁" and the spaces beside added tokens
  // (its normalizer and decoder do, in HuggingFace too), and without byte fallback gives
  // unk_token for what it has no token for.
  bool lossless() const;
  // The text `ids` add after `prefix` (a prompt's): decode(prefix + ids) less decode(prefix)'s
  // text. Not decode(ids): a sentencepiece-style decoder strips the leading space of the text it
  // is given (Llama 2's "▁O" after "ROMEO:" is " O"), and byte tokens may finish a character the
  // prefix began. Where the prefix's text is not a prefix of the whole one, decode(ids).
  std::string decode_after(const std::vector<int32_t>& prefix,
                           const std::vector<int32_t>& ids) const;
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
