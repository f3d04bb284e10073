// parse_data_blend: data.blend's text, Megatron-LM's --data-path list, into its sources.
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "base/error.h"
#include "config/config.h"

namespace loom {
namespace {

// The whole word as a number, or nothing ("0.7" yes; "0.7x", "web/*.bin", "" no).
bool parse_number(const std::string& word, double& value) {
  if (word.empty()) return false;
  char* end = nullptr;
  value = std::strtod(word.c_str(), &end);
  return end == word.c_str() + word.size();
}

}  // namespace

std::vector<BlendSource> parse_data_blend(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  if (words.empty())
    fail("data.blend is empty: give \"W1 SPEC1 W2 SPEC2 ...\" or \"SPEC1 SPEC2 ...\"");
  std::vector<BlendSource> sources;
  double first = 0;
  if (!parse_number(words[0], first)) {
    // Specs only: shares by token count.
    for (const std::string& word : words) sources.push_back({0, word});
    return sources;
  }
  if (words.size() % 2 != 0)
    fail("data.blend = \"", text, "\": ", words.size(),
         " words, but weights and specs come in pairs (\"0.7 web/train_*.bin 0.3 "
         "code/train_*.bin\")");
  for (size_t i = 0; i < words.size(); i += 2) {
    double weight = 0;
    const size_t source = i / 2 + 1;
    if (!parse_number(words[i], weight))
      fail("data.blend: source ", source, "'s weight '", words[i],
           "' is not a number (weights and specs alternate, a weight first)");
    if (!(weight > 0) || !std::isfinite(weight))
      fail("data.blend: source ", source, "'s weight ", words[i], " must be a positive number");
    double unexpected = 0;
    if (parse_number(words[i + 1], unexpected))
      fail("data.blend: source ", source, " has the weight ", words[i],
           " and then another number, '", words[i + 1], "', where its shard spec should be");
    sources.push_back({weight, words[i + 1]});
  }
  return sources;
}

}  // namespace loom
