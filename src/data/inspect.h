// `loom data inspect`: what a corpus holds before a run reads it — its shards, their tokens and
// token width, the sequences they give at a sequence length, and (with a vocabulary) every id
// checked, so a multi-day run does not find a bad shard hours in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct ShardSummary {
  std::string path;
  int64_t tokens = 0;
  int token_bytes = 2;         // 2: uint16 ("gpt-2"), 4: uint32 ("llama-3")
  int64_t windows = 0;         // sequences of seq_len it gives ((tokens - 1) / seq_len); 0 without
  int64_t max_id = -1;         // with a vocabulary: the largest id (-1: not scanned, or no tokens)
  int64_t ids_outside = 0;     // ids >= the vocabulary
  int64_t first_outside = -1;  // the first one's index in the shard
  // With an end-of-text id (data.eot_token): the documents the shard holds — each ending at an
  // end-of-text token, and the tokens after the last one, if any, as one more — and the longest
  // one's tokens. A document continuing into the next shard counts in both.
  int64_t documents = 0;
  int64_t longest_document = 0;
  // With a loss mask beside it (data/shard.h): the tokens it counts as targets; -1: no mask.
  int64_t mask_counted = -1;
};

struct CorpusSummary {
  std::string spec;
  std::vector<ShardSummary> shards;
  int64_t tokens() const;
  int64_t windows() const;
  int64_t ids_outside() const;
  int64_t documents() const;
  int64_t longest_document() const;
  int64_t masked_shards() const;  // shards with a loss mask
};

// The shards `spec` names (resolve_shards' forms), each header checked; with seq_len > 0 their
// windows; with vocab_size > 0 every token read and checked against it; with eot >= 0 its
// documents counted; each shard's loss mask, where it has one, read and its counted targets
// summed. Throws loom::Error as resolve_shards and read_shard_header do (naming the spec or the
// shard), and for a mask that does not fit its shard (naming both).
CorpusSummary inspect_corpus(const std::string& spec, int64_t seq_len, int64_t vocab_size,
                             int64_t eot = -1);

// The summary as text: a line for the corpus (with eot >= 0 its documents' count, mean and
// longest length; with loss masks the shards that have one and the share of their targets that
// count), a row per shard, and, with a vocabulary, the ids outside it (the first one's
// shard and position) or "none".
std::string format_corpus(const CorpusSummary& corpus, int64_t seq_len, int64_t vocab_size,
                          int64_t eot = -1);

}  // namespace loom
