// parse_data_blend: data.blend's text, Megatron-LM's --data-path list, into its sources; and
// parse_val_sets: data.val_sets' NAME=SPEC words.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <vector>

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

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
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

std::vector<ValSet> parse_val_sets(const std::string& text) {
  const std::vector<std::string> words = words_of(text);
  if (words.empty()) fail("data.val_sets is empty: give \"NAME=SPEC NAME=SPEC ...\"");
  std::vector<ValSet> sets;
  for (const std::string& word : words) {
    const size_t eq = word.find('=');
    if (eq == std::string::npos)
      fail("data.val_sets: '", word, "' is not NAME=SPEC (\"web=data/web/val_*.bin\")");
    ValSet set{word.substr(0, eq), word.substr(eq + 1)};
    const bool name_ok =
        !set.name.empty() && std::all_of(set.name.begin(), set.name.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
        });
    if (!name_ok)
      fail("data.val_sets: '", word, "': the name before '=' must be letters, digits, '_' or '-'");
    if (set.spec.empty()) fail("data.val_sets: '", word, "' names no shards after '='");
    for (const ValSet& earlier : sets)
      if (earlier.name == set.name) fail("data.val_sets: the name '", set.name, "' is given twice");
    sets.push_back(std::move(set));
  }
  return sets;
}

}  // namespace loom
