#include "data/inspect.h"

#include <algorithm>
#include <cstdio>

#include "data/dataset.h"
#include "data/shard.h"

namespace loom {
namespace {

// Scans every token of `shard`: against `vocab_size` when it is positive, for end-of-text
// tokens when eot >= 0.
template <typename Token>
void scan_ids(const Token* tokens, int64_t vocab_size, int64_t eot, ShardSummary& shard) {
  int64_t max_id = -1, since_eot = 0;
  for (int64_t i = 0; i < shard.tokens; ++i) {
    const auto id = static_cast<int64_t>(tokens[i]);
    max_id = std::max(max_id, id);
    if (vocab_size > 0 && id >= vocab_size) {
      if (shard.ids_outside == 0) shard.first_outside = i;
      ++shard.ids_outside;
    }
    ++since_eot;
    if (id == eot) {
      ++shard.documents;
      shard.longest_document = std::max(shard.longest_document, since_eot);
      since_eot = 0;
    }
  }
  if (eot >= 0 && since_eot > 0) {  // the tokens after the last end-of-text: one more document
    ++shard.documents;
    shard.longest_document = std::max(shard.longest_document, since_eot);
  }
  if (vocab_size > 0) shard.max_id = max_id;
}

}  // namespace

namespace {
// A count of `shards` summed over them.
int64_t sum_of(const std::vector<ShardSummary>& shards, int64_t ShardSummary::*count) {
  int64_t n = 0;
  for (const ShardSummary& s : shards) n += s.*count;
  return n;
}
}  // namespace

int64_t CorpusSummary::tokens() const {
  return sum_of(shards, &ShardSummary::tokens);
}
int64_t CorpusSummary::windows() const {
  return sum_of(shards, &ShardSummary::windows);
}
int64_t CorpusSummary::ids_outside() const {
  return sum_of(shards, &ShardSummary::ids_outside);
}
int64_t CorpusSummary::masked_shards() const {
  return std::count_if(shards.begin(), shards.end(),
                       [](const ShardSummary& s) { return s.mask_counted >= 0; });
}

int64_t CorpusSummary::documents() const {
  return sum_of(shards, &ShardSummary::documents);
}

int64_t CorpusSummary::longest_document() const {
  int64_t n = 0;
  for (const ShardSummary& s : shards) n = std::max(n, s.longest_document);
  return n;
}

CorpusSummary inspect_corpus(const std::string& spec, int64_t seq_len, int64_t vocab_size,
                             int64_t eot) {
  CorpusSummary corpus{spec, {}};
  for (const std::string& path : resolve_shards(spec, "data inspect")) {
    ShardSummary shard;
    shard.path = path;
    if (vocab_size > 0 || eot >= 0) {
      const MappedShard mapped(path);
      const MappedShard::Reading reading(mapped);
      shard.tokens = mapped.info().num_tokens;
      shard.token_bytes = mapped.info().token_bytes;
      if (shard.token_bytes == 2)
        scan_ids(mapped.tokens16(), vocab_size, eot, shard);
      else
        scan_ids(mapped.tokens32(), vocab_size, eot, shard);
    } else {
      const ShardInfo info = read_shard_header(path);
      shard.tokens = info.num_tokens;
      shard.token_bytes = info.token_bytes;
    }
    if (seq_len > 0 && shard.tokens > 0) shard.windows = (shard.tokens - 1) / seq_len;
    if (has_loss_mask(path, shard.tokens)) {
      const LossMaskFile mask(loss_mask_path(path));
      std::vector<uint8_t> entries(static_cast<size_t>(std::min<int64_t>(shard.tokens, 1 << 20)));
      shard.mask_counted = 0;
      for (int64_t at = 0; at < shard.tokens; at += static_cast<int64_t>(entries.size())) {
        const int64_t n = std::min<int64_t>(shard.tokens - at, entries.size());
        mask.read(at, n, entries.data());
        shard.mask_counted += std::count(entries.begin(), entries.begin() + n, uint8_t{1});
      }
    }
    corpus.shards.push_back(shard);
  }
  return corpus;
}

std::string format_corpus(const CorpusSummary& corpus, int64_t seq_len, int64_t vocab_size,
                          int64_t eot) {
  char line[512];
  std::string out;
  std::snprintf(line, sizeof line, "%s: %zu shard%s, %lld tokens", corpus.spec.c_str(),
                corpus.shards.size(), corpus.shards.size() == 1 ? "" : "s",
                static_cast<long long>(corpus.tokens()));
  out += line;
  if (seq_len > 0) {
    std::snprintf(line, sizeof line, ", %lld sequences of %lld",
                  static_cast<long long>(corpus.windows()), static_cast<long long>(seq_len));
    out += line;
  }
  if (eot >= 0 && corpus.documents() > 0) {
    std::snprintf(line, sizeof line,
                  ", %lld documents ending at token %lld (mean %.1f tokens, "
                  "longest %lld)",
                  static_cast<long long>(corpus.documents()), static_cast<long long>(eot),
                  static_cast<double>(corpus.tokens()) / static_cast<double>(corpus.documents()),
                  static_cast<long long>(corpus.longest_document()));
    out += line;
  }
  if (const int64_t masked = corpus.masked_shards(); masked > 0) {
    int64_t counted = 0, tokens = 0;
    for (const ShardSummary& s : corpus.shards)
      if (s.mask_counted >= 0) counted += s.mask_counted, tokens += s.tokens;
    std::snprintf(
        line, sizeof line,
        ", loss masks beside %lld of the shards: %lld of their %lld tokens count as "
        "targets (%.1f%%)",
        static_cast<long long>(masked), static_cast<long long>(counted),
        static_cast<long long>(tokens),
        100.0 * static_cast<double>(counted) / static_cast<double>(std::max<int64_t>(tokens, 1)));
    out += line;
  }
  out += "\n";
  size_t width = 5;
  for (const ShardSummary& s : corpus.shards) width = std::max(width, s.path.size());
  std::snprintf(line, sizeof line, "  %-*s %12s %6s%s%s\n", static_cast<int>(width), "shard",
                "tokens", "width", seq_len > 0 ? "    sequences" : "",
                vocab_size > 0 ? "   max id" : "");
  out += line;
  for (const ShardSummary& s : corpus.shards) {
    std::snprintf(line, sizeof line, "  %-*s %12lld %6s", static_cast<int>(width), s.path.c_str(),
                  static_cast<long long>(s.tokens), s.token_bytes == 2 ? "uint16" : "uint32");
    out += line;
    if (seq_len > 0) {
      std::snprintf(line, sizeof line, " %12lld", static_cast<long long>(s.windows));
      out += line;
    }
    if (vocab_size > 0) {
      std::snprintf(line, sizeof line, " %9lld", static_cast<long long>(s.max_id));
      out += line;
    }
    out += "\n";
  }
  if (vocab_size > 0) {
    if (corpus.ids_outside() == 0) {
      std::snprintf(line, sizeof line, "  ids >= %lld: none\n", static_cast<long long>(vocab_size));
      out += line;
    } else {
      for (const ShardSummary& s : corpus.shards) {
        if (s.ids_outside == 0) continue;
        std::snprintf(line, sizeof line, "  ids >= %lld: %lld in %s, the first at token %lld\n",
                      static_cast<long long>(vocab_size), static_cast<long long>(s.ids_outside),
                      s.path.c_str(), static_cast<long long>(s.first_outside));
        out += line;
      }
    }
  }
  return out;
}

}  // namespace loom
