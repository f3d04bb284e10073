#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <utility>

#include "base/error.h"
#include "base/json_number.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// GPT-2's pre-tokenizer regex (HuggingFace's ByteLevel with use_regex): contractions, letters,
// digits, other symbols, each with an optional leading space; runs of whitespace.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others for
// U+0100 onwards, so every byte is one printable character of a vocabulary entry.
struct ByteChars {
  std::array<std::string, 256> of_byte;
  std::unordered_map<std::string, uint8_t> byte_of;
  ByteChars() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      of_byte[static_cast<size_t>(b)] = utf8_of(printable ? static_cast<uint32_t>(b) : next++);
      byte_of[of_byte[static_cast<size_t>(b)]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteChars& byte_chars() {
  static const ByteChars table;
  return table;
}

// The length of the UTF-8 character starting at s[i] (1 for a byte that starts none).
size_t char_length(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80           ? 1
                   : (c >> 5) == 0x6  ? 2
                   : (c >> 4) == 0xe  ? 3
                   : (c >> 3) == 0x1e ? 4
                                      : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 1;
  return n;
}

// A compiled regex (UTF, Unicode properties; text that is not UTF-8 is matched, never refused).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      fail(where, ": the regex '", pattern, "' does not compile at offset ", offset, ": ",
           reinterpret_cast<const char*>(message.data()));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // faster where the JIT exists; else interpreted
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // HuggingFace's Split with behavior "Isolated": the matches and the text between them, each a
  // piece, in order (empty matches split nothing).
  void split(std::string_view text, std::vector<std::string>& out) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t at = 0, piece_start = 0;
    while (at < text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                                 0, data, nullptr);
      if (rc < 0) break;  // no further match (or a matching limit): the rest is one piece
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
      const size_t begin = ov[0], end = ov[1];
      if (end == begin) {  // an empty match: try again after the next character
        at = begin + char_length(text, begin);
        continue;
      }
      if (begin > piece_start) out.emplace_back(text.substr(piece_start, begin - piece_start));
      out.emplace_back(text.substr(begin, end - begin));
      piece_start = at = end;
    }
    if (piece_start < text.size()) out.emplace_back(text.substr(piece_start));
    pcre2_match_data_free(data);
  }

 private:
  pcre2_code* code_ = nullptr;
};

// One pre-tokenizer step (tokenizer.json's pre_tokenizer, or one of its Sequence).
struct PreTokenizer {
  enum Kind { kSplit, kByteLevel } kind = kSplit;  // Digits is a Split on \p{N}
  std::shared_ptr<Regex> regex;                    // kSplit, and kByteLevel with use_regex
  bool add_prefix_space = false;
};

}  // namespace

struct BpeTokenizer::Impl {
  std::string path;
  std::vector<PreTokenizer> pre;
  std::unordered_map<std::string, int32_t> vocab;
  // Each merge "a b" by its rank (a byte-level token never holds a space: byte 0x20 is "Ġ").
  std::unordered_map<std::string, int32_t> merge_rank;
  bool ignore_merges = false;
  std::vector<std::pair<std::string, int32_t>> added;  // longest first
  std::vector<std::string> token_of;                   // by id ("" where no token)
  std::vector<bool> is_added;
  std::vector<int32_t> prefix, suffix;  // the post-processor's tokens
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;  // piece -> ids

  [[noreturn]] void refuse(const std::string& what) const {
    fail("tokenizer ", path, ": ", what, " (Loom runs byte-level BPE tokenizers: ",
         "data/bpe_tokenizer.h; tools/tokenize_hf.py runs any)");
  }

  void read_pre_tokenizer(const json& p) {
    const std::string type = p.at("type").get<std::string>();
    PreTokenizer step;
    if (type == "Sequence") {
      for (const json& s : p.at("pretokenizers")) read_pre_tokenizer(s);
      return;
    }
    if (type == "Split") {
      if (p.value("behavior", std::string()) != "Isolated" || p.value("invert", false))
        refuse("a Split pre-tokenizer other than behavior \"Isolated\", invert false");
      const json& pattern = p.at("pattern");
      if (!pattern.contains("Regex")) refuse("a Split on a string, not a regex");
      step.regex = std::make_shared<Regex>(pattern.at("Regex").get<std::string>(),
                                           "tokenizer " + path + ": pre_tokenizer Split");
    } else if (type == "Digits") {  // Split on numbers (Rust's char::is_numeric: \p{N})
      step.regex = std::make_shared<Regex>(
          p.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+", "tokenizer " + path);
    } else if (type == "ByteLevel") {
      step.kind = PreTokenizer::kByteLevel;
      step.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true))
        step.regex = std::make_shared<Regex>(kGpt2Pattern, "tokenizer " + path);
    } else {
      refuse("pre_tokenizer \"" + type + "\"");
    }
    pre.push_back(std::move(step));
  }

  void read_post_processor(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const json& s : p.at("processors")) read_post_processor(s);
    } else if (type == "TemplateProcessing") {
      bool before = true;
      for (const json& item : p.at("single")) {
        if (item.contains("Sequence")) {
          before = false;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        for (const json& id : p.at("special_tokens").at(name).at("ids"))
          (before ? prefix : suffix).push_back(json_integer<int32_t>(id));
      }
    } else if (type != "ByteLevel") {
      refuse("post_processor \"" + type + "\"");
    }
  }

  void read(const json& j) {
    if (!j.is_object()) refuse("not a JSON object");
    if (!j.value("normalizer", json()).is_null()) refuse("a normalizer");
    const json& model = j.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      refuse("model type \"" + model.value("type", std::string()) + "\"");
    const auto set = [&](const char* key) {  // a key that is neither absent, null nor ""
      const json& v = model.value(key, json());
      return !v.is_null() && !(v.is_string() && v.get<std::string>().empty());
    };
    if (model.value("byte_fallback", false) || set("dropout") || set("continuing_subword_prefix") ||
        set("end_of_word_suffix"))
      refuse("BPE with byte fallback, dropout, a subword prefix or a word suffix");
    ignore_merges = model.value("ignore_merges", false);
    if (!model.at("vocab").is_object() || !model.at("merges").is_array())
      refuse("model.vocab is not an object of tokens, or model.merges not an array");
    for (const auto& [token, id] : model.at("vocab").items())
      vocab[token] = json_integer<int32_t>(id);
    int32_t rank = 0;
    for (const json& m : model.at("merges")) {
      std::string key;
      if (m.is_string()) {
        key = m.get<std::string>();
        if (std::count(key.begin(), key.end(), ' ') != 1)
          refuse("a merge \"" + key + "\" not of two tokens");
      } else {
        key = m.at(0).get<std::string>() + " " + m.at(1).get<std::string>();
      }
      merge_rank.emplace(std::move(key), rank++);
    }
    for (const json& t : j.value("added_tokens", json::array()))
      added.emplace_back(t.at("content").get<std::string>(), json_integer<int32_t>(t.at("id")));
    std::erase_if(added, [](const auto& a) { return a.first.empty(); });
    std::stable_sort(added.begin(), added.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    const json& pre_tokenizer = j.value("pre_tokenizer", json());
    if (pre_tokenizer.is_null()) refuse("no pre_tokenizer (a byte-level BPE has ByteLevel)");
    read_pre_tokenizer(pre_tokenizer);
    if (pre.empty() || pre.back().kind != PreTokenizer::kByteLevel ||
        std::count_if(pre.begin(), pre.end(), [](const PreTokenizer& p) {
          return p.kind == PreTokenizer::kByteLevel;
        }) != 1)
      refuse("a pre_tokenizer that does not end with its one ByteLevel (not byte-level BPE)");
    read_post_processor(j.value("post_processor", json()));
    const json& decoder = j.value("decoder", json());
    if (decoder.is_null() || decoder.value("type", std::string()) != "ByteLevel")
      refuse("a decoder other than ByteLevel");

    int64_t size = 0;
    for (const auto& [token, id] : vocab) {
      if (id < 0) refuse("a negative id " + std::to_string(id));
      size = std::max<int64_t>(size, int64_t{id} + 1);
    }
    for (const auto& [token, id] : added) {
      if (id < 0) refuse("a negative id " + std::to_string(id));
      size = std::max<int64_t>(size, int64_t{id} + 1);
    }
    for (const auto* ids : {&prefix, &suffix})
      for (const int32_t id : *ids) {
        if (id < 0) refuse("a negative id " + std::to_string(id) + " in the post_processor");
        size = std::max<int64_t>(size, int64_t{id} + 1);
      }
    // Ids are dense in every tokenizer there is; a sparse one is held to 2^21 ids (the table of
    // tokens by id is built for all of them).
    if (size >
        std::max<int64_t>(int64_t{1} << 21, 16 * static_cast<int64_t>(vocab.size() + added.size())))
      refuse("ids up to " + std::to_string(size - 1) + " for " +
             std::to_string(vocab.size() + added.size()) + " tokens");
    token_of.assign(static_cast<size_t>(size), std::string());
    is_added.assign(static_cast<size_t>(size), false);
    for (const auto& [token, id] : vocab) token_of[static_cast<size_t>(id)] = token;
    for (const auto& [token, id] : added) {
      token_of[static_cast<size_t>(id)] = token;
      is_added[static_cast<size_t>(id)] = true;
    }
  }

  // The pre-tokenizers' pieces of a text without added tokens, each as the byte characters
  // the vocabulary is written in.
  std::vector<std::string> pieces(std::string_view text) const {
    std::vector<std::string> current{std::string(text)}, next;
    for (const PreTokenizer& step : pre) {
      next.clear();
      for (const std::string& piece : current) {
        // ByteLevel's add_prefix_space: a space before every piece that lacks one, as
        // HuggingFace's ByteLevel does to each split it is given.
        const std::string subject = step.kind == PreTokenizer::kByteLevel &&
                                            step.add_prefix_space && !piece.starts_with(' ')
                                        ? " " + piece
                                        : piece;
        if (step.regex) {
          step.regex->split(subject, next);
        } else {
          next.push_back(subject);
        }
      }
      std::swap(current, next);
    }
    for (std::string& piece : current) {  // the last step, ByteLevel: bytes to characters
      std::string chars;
      for (const char c : piece) chars += byte_chars().of_byte[static_cast<uint8_t>(c)];
      piece = std::move(chars);
    }
    return current;
  }

  // BPE on one piece: its characters merged pair by pair, the lowest-ranked pair first.
  void bpe(const std::string& piece, std::vector<int32_t>& out) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex);
      const auto hit = cache.find(piece);
      if (hit != cache.end()) {
        out.insert(out.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    std::vector<int32_t> ids;
    const auto whole = vocab.find(piece);
    if (ignore_merges && whole != vocab.end()) {
      ids.push_back(whole->second);
    } else {
      // The piece's characters in a linked list; the candidate merges of neighbours in a heap
      // by (rank, position): the lowest rank first, the leftmost among equals — HuggingFace's
      // order — in O(n log n), so a long run of one character (a line of "=", a blob of base64)
      // is not quadratic. A candidate whose symbols have changed since is skipped.
      struct Symbol {
        std::string text;
        int prev, next;
      };
      std::vector<Symbol> symbols;
      for (size_t i = 0; i < piece.size();) {
        const size_t n = char_length(piece, i);
        const int k = static_cast<int>(symbols.size());
        symbols.push_back({piece.substr(i, n), k - 1, -1});
        if (k > 0) symbols[static_cast<size_t>(k - 1)].next = k;
        i += n;
      }
      using Candidate = std::pair<int32_t, int>;  // (rank, left symbol)
      std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
      const auto rank_of = [&](int left) {
        const Symbol& a = symbols[static_cast<size_t>(left)];
        if (a.next < 0) return -1;
        const auto m = merge_rank.find(a.text + " " + symbols[static_cast<size_t>(a.next)].text);
        return m == merge_rank.end() ? -1 : m->second;
      };
      const auto consider = [&](int left) {
        if (left < 0) return;
        if (const int32_t r = rank_of(left); r >= 0) heap.emplace(r, left);
      };
      for (int k = 0; k + 1 < static_cast<int>(symbols.size()); ++k) consider(k);
      while (!heap.empty()) {
        const auto [rank, left] = heap.top();
        heap.pop();
        Symbol& a = symbols[static_cast<size_t>(left)];
        if (a.text.empty() || rank_of(left) != rank) continue;  // merged away, or changed
        Symbol& b = symbols[static_cast<size_t>(a.next)];
        a.text += b.text;
        b.text.clear();
        a.next = b.next;
        if (a.next >= 0) symbols[static_cast<size_t>(a.next)].prev = left;
        consider(a.prev);
        consider(left);
      }
      for (const Symbol& symbol : symbols) {
        if (symbol.text.empty()) continue;
        const std::string& s = symbol.text;
        const auto id = vocab.find(s);
        if (id == vocab.end())
          fail("tokenizer ", path, ": no token for '", s, "' (its vocabulary lacks a byte)");
        ids.push_back(id->second);
      }
    }
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() > 100000) cache.clear();  // bounded: a corpus has a long tail of pieces
    cache.emplace(piece, std::move(ids));
  }
};

BpeTokenizer::BpeTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path;
  std::ifstream in(impl_->path);
  if (!in)
    fail("tokenizer ", impl_->path, ": cannot read (a tokenizer.json, or a directory with one)");
  try {
    impl_->read(json::parse(in));
  } catch (const json::exception& e) {
    fail("tokenizer ", impl_->path, ": not a tokenizer.json Loom reads: ", e.what());
  }
}

BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& t = *impl_;
  std::vector<int32_t> out;
  if (add_special) out = t.prefix;
  // Added tokens first: the earliest occurrence of any (the longest where several start there).
  // Each token's next occurrence is kept and searched for again only once passed, so a text
  // holding many added tokens is scanned once per token, not once per occurrence.
  constexpr size_t kUnsearched = std::string_view::npos - 1;
  std::vector<size_t> next(t.added.size(), kUnsearched);
  size_t at = 0;
  while (at < text.size()) {
    size_t found = std::string_view::npos;
    int32_t found_id = -1;
    size_t found_length = 0;
    for (size_t k = 0; k < t.added.size(); ++k) {
      if (next[k] == kUnsearched || (next[k] != std::string_view::npos && next[k] < at))
        next[k] = text.find(t.added[k].first, at);
      if (next[k] < found) {
        found = next[k];
        found_id = t.added[k].second;
        found_length = t.added[k].first.size();
      }
    }
    const std::string_view plain = text.substr(at, std::min(found, text.size()) - at);
    if (!plain.empty())
      for (const std::string& piece : t.pieces(plain)) t.bpe(piece, out);
    if (found == std::string_view::npos) break;
    out.push_back(found_id);
    at = found + found_length;
  }
  if (add_special) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& t = *impl_;
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || static_cast<size_t>(id) >= t.token_of.size() ||
        (t.token_of[static_cast<size_t>(id)].empty() && !t.is_added[static_cast<size_t>(id)]))
      fail("tokenizer ", t.path, ": token ", id, " at position ", k, " is not in its vocabulary");
    const std::string& token = t.token_of[static_cast<size_t>(id)];
    if (t.is_added[static_cast<size_t>(id)]) {
      out += token;
      continue;
    }
    for (size_t i = 0; i < token.size();) {  // byte characters back to bytes
      const size_t n = char_length(token, i);
      const auto byte = byte_chars().byte_of.find(token.substr(i, n));
      if (byte != byte_chars().byte_of.end()) {
        out += static_cast<char>(byte->second);
      } else {
        out.append(token, i, n);  // not a byte character: HuggingFace keeps it as it is
      }
      i += n;
    }
  }
  return out;
}

int64_t BpeTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->token_of.size());
}

std::optional<int32_t> BpeTokenizer::token_id(std::string_view token) const {
  for (const auto& [content, id] : impl_->added)
    if (content == token) return id;
  const auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> BpeTokenizer::end_of_text() const {
  for (const char* name : {"<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>"})
    if (const std::optional<int32_t> id = token_id(name)) return id;
  return std::nullopt;
}

const std::string& BpeTokenizer::path() const {
  return impl_->path;
}

}  // namespace loom
