// ByteTokenizer — the byte-level tokenizer: token i is byte i, vocabulary 256.
//
// Lossless for any input (UTF-8 or not): decode(encode(s)) == s. It needs no vocabulary file, so
// the quick start and the tests run with nothing downloaded. Text tokenised by a BPE tokenizer
// elsewhere (llm.c's GPT-2 shards) is read as shards directly; this class is not involved.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  // One token per byte, in order: the byte's unsigned value (0..255).
  std::vector<int32_t> encode(std::string_view text) const;

  // Inverse of encode. A token outside [0, 256) throws loom::Error naming it and its position.
  std::string decode(const std::vector<int32_t>& tokens) const;
  std::string decode(int32_t token) const;
};

}  // namespace loom
