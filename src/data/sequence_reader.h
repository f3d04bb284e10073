// SequenceReader — one corpus (a list of token shards) read one training sequence at a time, in
// order or shuffled, deterministic and resumable. The sources of a BlendedLoader (data/blend.h).
//
// A shard of N tokens holds n = (N - 1) / T windows of a sequence: window k is tokens
// [k*T, k*T + T + 1) — T inputs and, shifted by one, T targets — so consecutive windows share one
// token, as llm.c's loader reads, and a tail shorter than a window is never read. In order, the
// reader takes shard 0's windows 0, 1, ..., n - 1, then shard 1's, ..., and after the last shard
// starts again (the next epoch): exactly a DataLoader of batch 1.
//
// Shuffled (llm.c's and Megatron-LM's practice for several epochs over one corpus), each epoch
// visits the shards in a permutation of their order and each shard's windows in a permutation of
// theirs — Fisher-Yates over counter-based random numbers (tensor/rng.h) keyed by the seed, the
// stream's name, the epoch and the shard — so an epoch still reads every window once, a resumed
// run continues the same order, and the order depends on nothing but (seed, name, shards, T).
//
// The position (LoaderState) is {shard: the place in this epoch's shard order, offset: j*T for the
// j-th window of that shard in this epoch's order, epoch}; in order, the shard index and the
// window's token offset themselves.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"

namespace loom {

class SequenceReader {
 public:
  // `shuffle_seed`: none = in order. `name` tells streams of one seed apart (a blend's sources).
  // Throws loom::Error as a DataLoader of batch 1 does (no shards, a shard shorter than T + 1).
  SequenceReader(std::vector<std::string> shards, int64_t seq_len,
                 std::optional<uint64_t> shuffle_seed = std::nullopt, std::string name = "");

  // Fills inputs (T) and targets (T) with the next sequence and moves past it.
  void next(int32_t* inputs, int32_t* targets);
  // Moves past the next sequence without reading it (one another rank reads).
  void skip();
  // The vocabulary every id read is checked against (DataLoader::set_vocab_size).
  void set_vocab_size(int64_t vocab_size) { shards_.set_vocab_size(vocab_size); }
  // Targets masked by the shards' loss masks (DataLoader::use_loss_masks): how many have one.
  int64_t use_loss_masks() { return shards_.use_loss_masks(); }

  LoaderState state() const { return state_; }
  // Throws loom::Error naming the state, the shard and its windows when it is out of range.
  void set_state(const LoaderState& state);

  // Epochs read so far, fractional: the completed ones plus the share of this epoch's sequences
  // read (0.5: half of every shard's windows). (Not const: the epoch's shard order is cached.)
  double epochs_read();

  bool shuffled() const { return shuffle_seed_.has_value(); }
  int64_t total_tokens() const { return shards_.total_tokens(); }
  int64_t num_shards() const { return shards_.num_shards(); }

 private:
  int64_t windows(int64_t shard) const;            // n of a shard (by its index in the shard list)
  int64_t shard_at(int64_t epoch, int64_t place);  // the shard at `place` of `epoch`'s order
  // Where in `shard` the sequence at position `offset` of `epoch` begins (in order: `offset`).
  int64_t begin_at(int64_t epoch, int64_t shard, int64_t offset);

  DataLoader shards_;  // batch 1: the shards' headers, the loaded shard and the id check
  int64_t seq_len_;
  std::optional<uint64_t> shuffle_seed_;
  std::string name_;
  LoaderState state_;
  // The current epoch's shard order and the current shard's window order (shuffled only; made
  // when first needed).
  int64_t order_epoch_ = -1;
  std::vector<int64_t> shard_order_;
  int64_t windows_epoch_ = -1, windows_shard_ = -1;
  std::vector<int64_t> window_order_;
};

}  // namespace loom
