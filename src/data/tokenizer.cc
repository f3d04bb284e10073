#include "data/tokenizer.h"

#include "base/error.h"

namespace loom {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= kVocabSize)
      fail("ByteTokenizer: token ", t, " at position ", i, " is outside the byte vocabulary [0, ",
           kVocabSize, ")");
    text[i] = static_cast<char>(static_cast<unsigned char>(t));
  }
  return text;
}

std::string ByteTokenizer::decode(int32_t token) const {
  if (token < 0 || token >= kVocabSize)
    fail("ByteTokenizer: token ", token, " is outside the byte vocabulary [0, ", kVocabSize, ")");
  return std::string(1, static_cast<char>(static_cast<unsigned char>(token)));
}

}  // namespace loom
