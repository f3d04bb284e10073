#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <unordered_map>
#include <utility>

#include "base/error.h"
#include "base/json_number.h"
#include "base/utf8.h"

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
  const size_t n = utf8_sequence_length(static_cast<unsigned char>(s[i]));
  if (n == 0 || i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 1;
  return n;
}

// The code point of the UTF-8 character at s[i] (its length in *length), or -1 where the bytes
// there are not one (text that is not UTF-8 is tokenized, never refused).
int32_t code_point_at(std::string_view s, size_t i, size_t* length) {
  utf8proc_int32_t c = -1;
  const utf8proc_ssize_t n =
      utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                       static_cast<utf8proc_ssize_t>(s.size() - i), &c);
  *length = n > 0 ? static_cast<size_t>(n) : 1;
  return n > 0 ? c : -1;
}

// The code point of the character that ends at s[end] (exclusive), its start in *start; -1 where
// none or not UTF-8.
int32_t code_point_before(std::string_view s, size_t end, size_t* start) {
  size_t b = end;
  while (b > 0 && end - b < 4) {
    --b;
    if ((static_cast<unsigned char>(s[b]) & 0xc0) != 0x80) break;
  }
  *start = end > 0 ? b : 0;
  if (end == 0) return -1;
  size_t length = 0;
  const int32_t c = code_point_at(s.substr(0, end), b, &length);
  if (c < 0 || b + length != end) {
    *start = end - 1;
    return -1;
  }
  return c;
}

// Unicode's White_Space, as the regex \s of HuggingFace's added tokens' lstrip / rstrip.
bool is_white_space(int32_t c) {
  if (c < 0) return false;
  if ((c >= 0x09 && c <= 0x0d) || c == 0x85) return true;
  const utf8proc_category_t k = utf8proc_category(c);
  return k == UTF8PROC_CATEGORY_ZS || k == UTF8PROC_CATEGORY_ZL || k == UTF8PROC_CATEGORY_ZP;
}

// A word character, as the regex \w of HuggingFace's single_word check (Unicode's: letters,
// marks, decimal and letter numbers, connector punctuation, the joiners).
bool is_word_char(int32_t c) {
  if (c < 0) return false;
  if (c == 0x200c || c == 0x200d) return true;
  switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
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
    // Only the whole match is read: one pair of offsets, a block per thread made once (split
    // runs once per piece of the step before, so many times a text).
    struct MatchData {
      pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
      ~MatchData() { pcre2_match_data_free(data); }
    };
    thread_local const MatchData match;
    pcre2_match_data* data = match.data;
    size_t at = 0, piece_start = 0;
    while (at < text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                                 0, data, nullptr);
      if (rc < 0) break;  // no further match (or a matching limit): the rest is one piece
      // (rc 0: the pattern's groups did not fit the one pair; the whole match is in it)
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
  }

 private:
  pcre2_code* code_ = nullptr;
};

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size()) {
    out.append(s, at, hit - at);
    out += to;
  }
  if (at == 0) return;
  out.append(s, at, std::string::npos);
  s = std::move(out);
}

// One normalizer step: Prepend and Replace (sentencepiece-style tokenizers: Llama 2's prepends
// "▁" and replaces each space by it), or a Unicode normalization form on utf8proc (Qwen 2's NFC).
struct Normalizer {
  enum Kind { kPrepend, kReplace, kUnicode } kind = kPrepend;
  std::string text;  // kPrepend: what goes first; kReplace: what is replaced
  std::string with;  // kReplace
  int unicode_form = 0;  // kUnicode: utf8proc's options for NFC, NFD, NFKC or NFKD
};

// `text` in a Unicode normalization form (utf8proc_option_t flags). Bytes that are not UTF-8
// stay as they are; the UTF-8 between them is normalized (HuggingFace takes only UTF-8).
std::string unicode_normalized(std::string_view text, int form) {
  std::string out;
  while (!text.empty()) {
    const size_t bad = std::min(invalid_utf8_at(text), text.size());
    if (bad > 0) {
      utf8proc_uint8_t* mapped = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(
          reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
          static_cast<utf8proc_ssize_t>(bad), &mapped, static_cast<utf8proc_option_t>(form));
      if (n < 0) fail("Unicode normalization: ", utf8proc_errmsg(n));  // out of memory, say
      out.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
      std::free(mapped);
    }
    if (bad == text.size()) break;
    out += text[bad];
    text.remove_prefix(bad + 1);
  }
  return out;
}

// Metaspace's prepend_scheme: "▁" before every piece, before the text's first only, or never.
enum class Prepend { kAlways, kFirst, kNever };

// One pre-tokenizer step (tokenizer.json's pre_tokenizer, or one of its Sequence).
struct PreTokenizer {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind = kSplit;  // Digits is a Split on \p{N}
  std::shared_ptr<Regex> regex;  // kSplit, and kByteLevel with use_regex
  bool add_prefix_space = false;
  std::string replacement;  // kMetaspace: spaces become it ("▁"); it starts each split piece
  Prepend prepend = Prepend::kAlways;
  bool split = true;
};

// One decoder step of a sentencepiece-style tokenizer (a byte-level one has ByteLevel alone).
struct Decoder {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind = kReplace;
  std::string from, to;         // kReplace; kMetaspace: from is the replacement, to " "
  std::string content;          // kStrip: the character stripped
  int64_t start = 0, stop = 0;  // kStrip: at most this many from each end of each token
  bool strip_first = false;     // kMetaspace: the first token's replacements are dropped
};

// "<0xAB>" -> 0xAB: a byte-fallback token (Rust's u8::from_str_radix, which takes "+A" too).
std::optional<uint8_t> byte_token(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return std::nullopt;
  const auto digit = [](char c) -> int {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  const int hi = token[3] == '+' ? 0 : digit(token[3]), lo = digit(token[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

std::string byte_token_of(uint8_t b) {
  char s[8];
  std::snprintf(s, sizeof s, "<0x%02X>", b);
  return s;
}

}  // namespace

// A thread's cache of pieces' ids for one tokenizer at a time (the one whose `owner` number it
// holds: numbers are never reused, as addresses would be); another tokenizer on the same thread
// starts it afresh.
struct PieceCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>> ids;
};
thread_local PieceCache piece_cache;

uint64_t next_cache_owner() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

struct BpeTokenizer::Impl {
  std::string path;
  bool byte_level = true;  // else sentencepiece-style: text as characters, bytes as a fallback
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre;
  std::vector<Decoder> decoders;  // sentencepiece-style only
  std::unordered_map<std::string, int32_t> vocab;
  // Each merge by the ids of its pair, id_a << 32 | id_b: its rank and the merged token's id.
  struct Merge {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges;
  static uint64_t pair_key(int32_t a, int32_t b) {
    return static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b);
  }
  std::array<int32_t, 256> byte_token_id{};  // each byte's <0xAB> token, -1 if none
  bool ignore_merges = false;
  bool byte_fallback = false;      // a character without a token: its bytes' <0xAB> tokens
  int32_t unk_id = -1;             // else (or without byte fallback) unk_token; -1: none
  bool fuse_unk = false;           // unknown characters in a row: one unknown token
  // Added tokens, longest first, with HuggingFace's flags: lstrip / rstrip take the whitespace
  // beside a match into the token; single_word drops a match with a word character beside it;
  // a "normalized" one is matched in a second pass, in the stretches the others left.
  struct Added {
    std::string content;
    int32_t id;
    bool single_word, lstrip, rstrip, normalized;
  };
  std::vector<Added> added;
  std::vector<size_t> added_raw, added_normalized;  // indices into added, by pass
  std::vector<std::string> token_of;                // by id ("" where no token)
  std::vector<bool> is_added;
  std::vector<int32_t> prefix, suffix;  // the post-processor's tokens
  // Pieces' ids are cached per thread (PieceCache): threads tokenizing documents at once
  // (prepare_tokenized_dataset) share nothing, so a lookup takes no lock — a shared cache's
  // mutexes were an eighth of the time at two threads on many small documents.
  const uint64_t cache_owner = next_cache_owner();

  [[noreturn]] void refuse(const std::string& what) const {
    fail("tokenizer ", path, ": ", what, " (Loom runs byte-level and sentencepiece-style BPE ",
         "tokenizers: data/bpe_tokenizer.h; tools/tokenize_hf.py runs any)");
  }

  // A string of one character (a Metaspace replacement, a Strip's content: Rust chars).
  std::string one_char(const json& j, const char* what) const {
    const std::string s = j.get<std::string>();
    if (s.empty() || char_length(s, 0) != s.size() || invalid_utf8_at(s) != std::string::npos)
      refuse(std::string(what) + " \"" + s + "\" that is not one character");
    return s;
  }

  // A Replace's pattern: a string (a regex is refused).
  std::string pattern_string(const json& p, const char* what) const {
    if (!p.at("pattern").contains("String"))
      refuse(std::string(what) + " Replace on a regex, not a string");
    const std::string s = p.at("pattern").at("String").get<std::string>();
    if (s.empty()) refuse(std::string(what) + " Replace of an empty string");
    return s;
  }

  Prepend prepend_scheme(const json& p) const {
    if (!p.contains("prepend_scheme"))  // files before tokenizers 0.15: add_prefix_space
      return p.value("add_prefix_space", true) ? Prepend::kAlways : Prepend::kNever;
    const std::string s = p.at("prepend_scheme").get<std::string>();
    if (s == "always") return Prepend::kAlways;
    if (s == "first") return Prepend::kFirst;
    if (s != "never") refuse("a Metaspace prepend_scheme \"" + s + "\"");
    return Prepend::kNever;
  }

  void read_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = n.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const json& s : n.at("normalizers")) read_normalizer(s);
    } else if (type == "Prepend") {
      normalizers.push_back({Normalizer::kPrepend, n.at("prepend").get<std::string>(), ""});
    } else if (type == "Replace") {
      normalizers.push_back({Normalizer::kReplace, pattern_string(n, "a normalizer"),
                             n.at("content").get<std::string>()});
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      const int form = UTF8PROC_STABLE |
                       (type[type.size() - 1] == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
                       (type.size() == 4 ? UTF8PROC_COMPAT : 0);
      normalizers.push_back({Normalizer::kUnicode, "", "", form});
    } else {
      refuse("normalizer \"" + type + "\"");
    }
  }

  void read_decoder(const json& d) {
    const std::string type = d.at("type").get<std::string>();
    Decoder step;
    if (type == "Sequence") {
      for (const json& s : d.at("decoders")) read_decoder(s);
      return;
    }
    if (type == "Replace") {
      step.from = pattern_string(d, "a decoder");
      step.to = d.at("content").get<std::string>();
    } else if (type == "ByteFallback") {
      step.kind = Decoder::kByteFallback;
    } else if (type == "Fuse") {
      step.kind = Decoder::kFuse;
    } else if (type == "Strip") {
      step.kind = Decoder::kStrip;
      step.content = one_char(d.at("content"), "a Strip decoder's content");
      step.start = json_integer<int64_t>(d.at("start"));
      step.stop = json_integer<int64_t>(d.at("stop"));
      if (step.start < 0 || step.stop < 0) refuse("a Strip decoder of a negative count");
    } else if (type == "Metaspace") {
      step.kind = Decoder::kMetaspace;
      step.from = one_char(d.value("replacement", json("\u2581")), "a Metaspace replacement");
      step.to = " ";
      step.strip_first = prepend_scheme(d) != Prepend::kNever;
    } else {
      refuse("decoder \"" + type + "\" in a tokenizer that is not byte-level");
    }
    decoders.push_back(std::move(step));
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
    } else if (type == "Metaspace") {
      step.kind = PreTokenizer::kMetaspace;
      step.replacement =
          one_char(p.value("replacement", json("\u2581")), "a Metaspace replacement");
      step.prepend = prepend_scheme(p);
      step.split = p.value("split", true);
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
    read_normalizer(j.value("normalizer", json()));
    const json& model = j.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      refuse("model type \"" + model.value("type", std::string()) + "\"");
    const auto set = [&](const char* key) {  // a key that is neither absent, null nor ""
      const json& v = model.value(key, json());
      return !v.is_null() && !(v.is_string() && v.get<std::string>().empty());
    };
    if (set("dropout") || set("continuing_subword_prefix") || set("end_of_word_suffix"))
      refuse("BPE with dropout, a subword prefix or a word suffix");
    ignore_merges = model.value("ignore_merges", false);
    byte_fallback = model.value("byte_fallback", false);
    fuse_unk = model.value("fuse_unk", false);
    const json unk_token = model.value("unk_token", json());
    if (!model.at("vocab").is_object() || !model.at("merges").is_array())
      refuse("model.vocab is not an object of tokens, or model.merges not an array");
    for (const auto& [token, id] : model.at("vocab").items())
      vocab[token] = json_integer<int32_t>(id);
    int32_t rank = 0;
    for (const json& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string both = m.get<std::string>();
        const size_t space = both.find(' ');
        if (space == std::string::npos || both.find(' ', space + 1) != std::string::npos)
          refuse("a merge \"" + both + "\" not of two tokens");
        a = both.substr(0, space);
        b = both.substr(space + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
      if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end())
        refuse("a merge \"" + a + " " + b + "\" of tokens not in model.vocab");
      // A pair merged twice takes its later rank, as HuggingFace's map of merges does.
      merges.insert_or_assign(pair_key(ia->second, ib->second), Merge{rank++, iab->second});
    }
    for (int b = 0; b < 256; ++b) {
      const auto it = vocab.find(byte_token_of(static_cast<uint8_t>(b)));
      byte_token_id[static_cast<size_t>(b)] = it == vocab.end() ? -1 : it->second;
    }
    for (const json& t : j.value("added_tokens", json::array())) {
      const auto flag = [&](const char* key) { return t.contains(key) && t.at(key).get<bool>(); };
      added.push_back({t.at("content").get<std::string>(), json_integer<int32_t>(t.at("id")),
                       flag("single_word"), flag("lstrip"), flag("rstrip"), flag("normalized")});
    }
    std::erase_if(added, [](const Added& a) { return a.content.empty(); });
    std::stable_sort(added.begin(), added.end(), [](const Added& a, const Added& b) {
      return a.content.size() > b.content.size();
    });
    for (size_t k = 0; k < added.size(); ++k)
      (added[k].normalized ? added_normalized : added_raw).push_back(k);
    if (const json& p = j.value("pre_tokenizer", json()); !p.is_null()) read_pre_tokenizer(p);
    const auto steps = [&](PreTokenizer::Kind kind) {
      return std::count_if(pre.begin(), pre.end(),
                           [&](const PreTokenizer& p) { return p.kind == kind; });
    };
    // Byte-level (GPT-2's kind): ByteLevel, last, turns every byte into a character of the
    // vocabulary. Sentencepiece-style (Llama 2's): no ByteLevel; the text's characters are the
    // symbols, a character without a token falls back to its bytes' <0xAB> tokens (or unk_token).
    byte_level = steps(PreTokenizer::kByteLevel) > 0;
    read_post_processor(j.value("post_processor", json()));
    const json& decoder = j.value("decoder", json());
    if (byte_level) {
      if (pre.back().kind != PreTokenizer::kByteLevel || steps(PreTokenizer::kByteLevel) != 1 ||
          steps(PreTokenizer::kMetaspace) > 0)
        refuse("a pre_tokenizer whose one ByteLevel is not its last step");
      if (decoder.is_null() || decoder.value("type", std::string()) != "ByteLevel")
        refuse("a byte-level tokenizer whose decoder is not ByteLevel");
    } else {
      if (decoder.is_null())
        refuse(
            "no decoder (a byte-level BPE has ByteLevel; a sentencepiece-style one Replace or "
            "Metaspace, ByteFallback, Fuse, Strip)");
      read_decoder(decoder);
    }
    if (!unk_token.is_null()) {
      const auto it = vocab.find(unk_token.get<std::string>());
      if (it == vocab.end())
        refuse("unk_token \"" + unk_token.get<std::string>() + "\", not in model.vocab");
      unk_id = it->second;
    }

    // HuggingFace matches a "normalized" added token in the normalized text (after a Prepend's
    // "▁", say), which Loom does not model; without a normalizer the text is its normalized self.
    if (!normalizers.empty())
      for (const Added& a : added)
        if (a.normalized)
          refuse("the added token \"" + a.content +
                 "\" is matched after the normalizer (\"normalized\": true)");
    int64_t size = 0;
    for (const auto& [token, id] : vocab) {
      if (id < 0) refuse("a negative id " + std::to_string(id));
      size = std::max<int64_t>(size, int64_t{id} + 1);
    }
    for (const Added& a : added) {
      if (a.id < 0) refuse("a negative id " + std::to_string(a.id));
      size = std::max<int64_t>(size, int64_t{a.id} + 1);
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
    for (const Added& a : added) {
      token_of[static_cast<size_t>(a.id)] = a.content;
      is_added[static_cast<size_t>(a.id)] = true;
    }
  }

  // The pre-tokenizers' pieces of a text without added tokens (normalized first, as HuggingFace
  // normalizes each stretch between added tokens), each in the characters the vocabulary is
  // written in. `at_start`: the stretch begins the whole text (Metaspace's "first").
  std::vector<std::string> pieces(std::string_view text, bool at_start) const {
    std::string normalized(text);
    for (const Normalizer& n : normalizers) {
      if (n.kind == Normalizer::kPrepend) {
        if (!normalized.empty()) normalized.insert(0, n.text);
      } else if (n.kind == Normalizer::kReplace) {
        replace_all(normalized, n.text, n.with);
      } else {
        normalized = unicode_normalized(normalized, n.unicode_form);
      }
    }
    std::vector<std::string> current{std::move(normalized)}, next;
    for (const PreTokenizer& step : pre) {
      next.clear();
      if (step.kind == PreTokenizer::kMetaspace) {
        for (size_t k = 0; k < current.size(); ++k) {
          std::string piece = current[k];
          replace_all(piece, " ", step.replacement);
          const bool prepend = step.prepend == Prepend::kAlways ||
                               (step.prepend == Prepend::kFirst && at_start && k == 0);
          if (prepend && !piece.starts_with(step.replacement)) piece.insert(0, step.replacement);
          if (!step.split) {
            next.push_back(std::move(piece));
            continue;
          }
          // Split before each replacement, which starts the piece after it ("MergedWithNext").
          size_t begin = 0;
          for (size_t at = piece.find(step.replacement); at != std::string::npos;
               at = piece.find(step.replacement, at + step.replacement.size())) {
            if (at > begin) next.push_back(piece.substr(begin, at - begin));
            begin = at;
          }
          if (begin < piece.size()) next.push_back(piece.substr(begin));
        }
        std::swap(current, next);
        continue;
      }
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
    if (!byte_level) return current;
    for (std::string& piece : current) {  // the last step, ByteLevel: bytes to characters
      std::string chars;
      for (const char c : piece) chars += byte_chars().of_byte[static_cast<uint8_t>(c)];
      piece = std::move(chars);
    }
    return current;
  }

  // BPE on one piece: its characters merged pair by pair, the lowest-ranked pair first.
  void bpe(const std::string& piece, std::vector<int32_t>& out) const {
    PieceCache& cache = piece_cache;
    if (cache.owner != cache_owner) {
      cache.ids.clear();
      cache.owner = cache_owner;
    }
    if (const auto hit = cache.ids.find(piece); hit != cache.ids.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return;
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
        int32_t id;
        int prev, next;
        bool alive;
      };
      std::vector<Symbol> symbols;
      const auto add = [&](int32_t id) {
        const int k = static_cast<int>(symbols.size());
        symbols.push_back({id, k - 1, -1, true});
        if (k > 0) symbols[static_cast<size_t>(k - 1)].next = k;
      };
      // A character without a token: its bytes' tokens, else unk_token (one for a run of them
      // with fuse_unk). As HuggingFace's BPE, an unknown token waits until the next character
      // with a token of its own, so bytes of a fallback in between come before it.
      bool unk_pending = false;
      for (size_t i = 0; i < piece.size();) {
        const size_t n = char_length(piece, i);
        const std::string_view c = std::string_view(piece).substr(i, n);
        i += n;
        const auto token = vocab.find(std::string(c));
        const auto byte_known = [&](char b) { return byte_token_id[static_cast<uint8_t>(b)] >= 0; };
        if (token != vocab.end()) {
          if (unk_pending) add(unk_id);
          unk_pending = false;
          add(token->second);
        } else if (byte_fallback && std::all_of(c.begin(), c.end(), byte_known)) {
          for (const char b : c) add(byte_token_id[static_cast<uint8_t>(b)]);
        } else if (unk_id >= 0) {
          if (unk_pending && !fuse_unk) add(unk_id);
          unk_pending = true;
        } else {
          fail("tokenizer ", path, ": no token for '", c, "' (",
               byte_level ? "its vocabulary lacks a byte" : "no byte fallback or unk_token for it",
               ")");
        }
      }
      if (unk_pending) add(unk_id);
      using Candidate = std::pair<int32_t, int>;  // (rank, left symbol)
      std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
      const auto merge_of = [&](int left) -> const Merge* {
        const Symbol& a = symbols[static_cast<size_t>(left)];
        if (a.next < 0) return nullptr;
        const auto m = merges.find(pair_key(a.id, symbols[static_cast<size_t>(a.next)].id));
        return m == merges.end() ? nullptr : &m->second;
      };
      const auto consider = [&](int left) {
        if (left < 0) return;
        if (const Merge* m = merge_of(left)) heap.emplace(m->rank, left);
      };
      for (int k = 0; k + 1 < static_cast<int>(symbols.size()); ++k) consider(k);
      while (!heap.empty()) {
        const auto [rank, left] = heap.top();
        heap.pop();
        Symbol& a = symbols[static_cast<size_t>(left)];
        if (!a.alive) continue;  // merged away
        const Merge* m = merge_of(left);
        if (m == nullptr || m->rank != rank) continue;  // its right neighbour changed since
        Symbol& b = symbols[static_cast<size_t>(a.next)];
        a.id = m->id;
        b.alive = false;
        a.next = b.next;
        if (a.next >= 0) symbols[static_cast<size_t>(a.next)].prev = left;
        consider(a.prev);
        consider(left);
      }
      for (const Symbol& symbol : symbols)
        if (symbol.alive) ids.push_back(symbol.id);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    // Bounded: a corpus has a long tail of pieces. A piece past 4 KiB (a sentencepiece-style
    // tokenizer's whole stretch of text) is not kept: it will not come again.
    if (piece.size() > 4096) return;
    if (cache.ids.size() > 100000) cache.ids.clear();
    cache.ids.emplace(piece, std::move(ids));
  }

  // A sentencepiece-style tokenizer's decoder: its steps, in order, on the tokens' strings (added
  // tokens too), as HuggingFace's decode_chain runs them; then the strings joined.
  std::string decode_chain(const std::vector<int32_t>& ids) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (const int32_t id : ids) tokens.push_back(token_of[static_cast<size_t>(id)]);
    for (const Decoder& step : decoders) {
      switch (step.kind) {
        case Decoder::kReplace:
          for (std::string& s : tokens) replace_all(s, step.from, step.to);
          break;
        case Decoder::kByteFallback: {
          // Each run of <0xAB> tokens: its bytes, as they are (HuggingFace shows a run that is
          // not UTF-8 as U+FFFD, one a byte; Loom returns bytes, as for a byte-level tokenizer).
          std::vector<std::string> out;
          std::string bytes;
          for (std::string& s : tokens) {
            if (const std::optional<uint8_t> b = byte_token(s)) {
              bytes += static_cast<char>(*b);
              continue;
            }
            if (!bytes.empty()) out.push_back(std::exchange(bytes, std::string()));
            out.push_back(std::move(s));
          }
          if (!bytes.empty()) out.push_back(std::move(bytes));
          tokens = std::move(out);
          break;
        }
        case Decoder::kFuse: {
          std::string all;
          for (const std::string& s : tokens) all += s;
          tokens.assign(1, std::move(all));
          break;
        }
        case Decoder::kStrip:
          for (std::string& s : tokens) {
            size_t begin = 0, end = s.size();
            for (int64_t k = 0;
                 k < step.start && s.compare(begin, step.content.size(), step.content) == 0; ++k)
              begin += step.content.size();
            for (int64_t k = 0;
                 k < step.stop && end >= begin + step.content.size() &&
                 s.compare(end - step.content.size(), step.content.size(), step.content) == 0;
                 ++k)
              end -= step.content.size();
            s = s.substr(begin, end - begin);
          }
          break;
        case Decoder::kMetaspace:  // as HuggingFace: every replacement of the first token dropped
          for (size_t k = 0; k < tokens.size(); ++k)
            replace_all(tokens[k], step.from, k == 0 && step.strip_first ? "" : step.to);
          break;
      }
    }
    std::string text;
    for (const std::string& s : tokens) text += s;
    return text;
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

namespace {

// HuggingFace's AddedVocabulary::find_matches on `sentence` with the added tokens `pass` (indices
// into `added`, longest first): at the leftmost occurrence of any, the longest; a single_word one
// with a word character beside it is passed over (its text stays plain); lstrip / rstrip take
// the whitespace beside it, not past the previous token. Calls plain(offset, length) for each
// stretch between tokens (none empty) and token(id) for each token, in order. A token's next
// occurrence is kept and searched for again only once passed, so a text holding many added
// tokens is scanned once per token, not once per occurrence.
template <typename Added, typename Plain, typename Token>
void split_at_added(std::string_view sentence, const std::vector<Added>& added,
                    const std::vector<size_t>& pass, Plain&& plain, Token&& token) {
  constexpr size_t kNone = std::string_view::npos, kUnsearched = kNone - 1;
  std::vector<size_t> next(pass.size(), kUnsearched);
  size_t stretch = 0, from = 0;  // plain text from `stretch`; the search goes on from `from`
  for (;;) {
    size_t found = kNone;
    const Added* match = nullptr;
    for (size_t k = 0; k < pass.size(); ++k) {
      if (next[k] == kUnsearched || (next[k] != kNone && next[k] < from))
        next[k] = sentence.find(added[pass[k]].content, from);
      if (next[k] < found) {
        found = next[k];
        match = &added[pass[k]];
      }
    }
    if (match == nullptr) break;
    size_t start = found, stop = found + match->content.size(), at = 0;
    from = stop;
    if (match->single_word &&
        (is_word_char(code_point_before(sentence, start, &at)) ||
         (stop < sentence.size() && is_word_char(code_point_at(sentence, stop, &at)))))
      continue;
    if (match->lstrip)
      while (start > stretch) {
        size_t before = 0;
        if (!is_white_space(code_point_before(sentence, start, &before))) break;
        start = std::max(before, stretch);
      }
    if (match->rstrip) {
      size_t length = 0;
      while (stop < sentence.size() && is_white_space(code_point_at(sentence, stop, &length)))
        stop += length;
      from = stop;
    }
    if (stretch < start) plain(stretch, start - stretch);
    token(match->id);
    stretch = stop;
  }
  if (stretch < sentence.size()) plain(stretch, sentence.size() - stretch);
}

}  // namespace

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& t = *impl_;
  std::vector<int32_t> out;
  if (add_special) out = t.prefix;
  // Added tokens first, as HuggingFace matches them: the others in the text, then the
  // "normalized" ones in the stretches left (a normalizer's tokenizer has none: refused at load).
  const auto tokenize = [&](size_t offset, size_t length) {
    for (const std::string& piece : t.pieces(text.substr(offset, length), offset == 0))
      t.bpe(piece, out);
  };
  const auto token = [&](int32_t id) { out.push_back(id); };
  split_at_added(
      text, t.added, t.added_raw,
      [&](size_t offset, size_t length) {
        if (t.added_normalized.empty()) return tokenize(offset, length);
        split_at_added(
            text.substr(offset, length), t.added, t.added_normalized,
            [&](size_t inner, size_t inner_length) { tokenize(offset + inner, inner_length); },
            token);
      },
      token);
  if (add_special) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& t = *impl_;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || static_cast<size_t>(id) >= t.token_of.size() ||
        (t.token_of[static_cast<size_t>(id)].empty() && !t.is_added[static_cast<size_t>(id)]))
      fail("tokenizer ", t.path, ": token ", id, " at position ", k, " is not in its vocabulary");
  }
  if (!t.byte_level) return t.decode_chain(ids);
  std::string out;
  for (const int32_t id : ids) {
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

std::string BpeTokenizer::decode_after(const std::vector<int32_t>& prefix,
                                       const std::vector<int32_t>& ids) const {
  std::vector<int32_t> all = prefix;
  all.insert(all.end(), ids.begin(), ids.end());
  const std::string whole = decode(all), before = decode(prefix);
  if (whole.starts_with(before)) return whole.substr(before.size());
  return decode(ids);
}

bool BpeTokenizer::lossless() const {
  return impl_->byte_level && impl_->normalizers.empty() &&
         std::none_of(impl_->added.begin(), impl_->added.end(),
                      [](const Impl::Added& a) { return a.lstrip || a.rstrip; });
}

int64_t BpeTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->token_of.size());
}

std::optional<int32_t> BpeTokenizer::token_id(std::string_view token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
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
