// DataLoader — deterministic, resumable reading of token shards into (inputs, targets) batches.
//
// Shapes: B = batch (sequences per micro-batch), T = seq_len, W = world (data-parallel ranks).
//
// The reading order is llm.c's (train_gpt2.c, DataLoader): all ranks share one position in the
// token stream, and each step
//   1. reads the W*B*T + 1 tokens at the position of the current shard; rank r takes the r-th of
//      the W chunks of B*T tokens plus the one token after it (for the last target);
//   2. in its chunk, sequence i is tokens[i*T, i*T + T) -> inputs (B, T), and the same window
//      shifted by one, tokens[i*T + 1, i*T + T + 1) -> targets (B, T);
//   3. advances the position by W*B*T. If the rest of the shard cannot hold another W*B*T + 1
//      tokens, it moves to the start of the next shard (the tail of the shard is skipped); after
//      the last shard it wraps to the first and the epoch count increases.
// Rank r's sequence i is therefore sequence r*B + i of a single loader with batch W*B: the union
// over ranks is exactly what one rank would read, for every step, at shard ends and wrap-around.
//
// Training reads a sequence at a time instead (data/blend.h, data/sequence_reader.h: a shard's
// tail skipped per sequence, not per step, so layouts with another W*B read the same sequences);
// this loader reads the validation batches and is the sequence reader's access to the shards.
//
// The position (LoaderState) is part of the training state; it is in global tokens, so it does
// not depend on the rank and a run can resume with another world size or batch. Only the current
// shard is mapped (on first use, again on a shard change; data/shard.h, MappedShard), and only
// the windows read are read from its file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/shard.h"

namespace loom {

struct LoaderState {
  int64_t shard = 0;   // index into the shard list
  int64_t offset = 0;  // token offset in that shard where the next step starts (shared by ranks)
  int64_t epoch = 0;   // completed passes over all shards
  bool operator==(const LoaderState&) const = default;
};

class DataLoader {
 public:
  // Reads every shard's header now (format errors surface here, not mid-run). Throws loom::Error
  // for an empty shard list, a non-positive batch/seq_len/world, a rank outside [0, world), or a
  // shard with fewer than world*batch*seq_len + 1 tokens (naming the shard and the sizes).
  DataLoader(std::vector<std::string> shard_paths, int64_t batch, int64_t seq_len, int rank = 0,
             int world = 1);

  // Fills inputs (B, T) and targets (B, T), row-major, then advances the position. With a
  // vocabulary size set, first checks every id it returns against it: one outside [0, V) throws
  // loom::Error naming the shard, the token's index in it and the vocabulary — before the batch
  // reaches a device (whose kernels may then skip their own check: kernels/exec.h).
  void next_batch(int32_t* inputs, int32_t* targets);
  // Fills inputs and targets (batch × seq_len each) from the batch × seq_len + 1 tokens at token
  // `begin` of shard `shard` (which must hold them), checked as next_batch checks; the position
  // is left alone. For readers that choose their own order (data/sequence_reader.h).
  void read_at(int64_t shard, int64_t begin, int32_t* inputs, int32_t* targets);
  // The model's vocabulary, for next_batch's check (0: unchecked, the default).
  void set_vocab_size(int64_t vocab_size) { vocab_size_ = vocab_size; }
  // Loss masks (data.loss_mask; data/shard.h): from now on each shard with a mask file beside it
  // (loss_mask_path) has its targets masked by it — one whose entry is 0 is kIgnoredTarget
  // (kernels/targets.h) — and the others are read as before. Checks every mask now (header, a
  // count equal to its shard's, naming both files); returns how many shards have one.
  int64_t use_loss_masks();

  // The position of the next step. Always valid: a full step fits at state().offset.
  LoaderState state() const { return state_; }
  // Continue from `state` (e.g. from a checkpoint); throws loom::Error if it is out of range for
  // these shards and this step size.
  void set_state(const LoaderState& state);
  void reset() { state_ = LoaderState{}; }

  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t tokens_per_step() const { return world_ * batch_ * seq_len_; }  // over all ranks
  int64_t num_shards() const { return static_cast<int64_t>(paths_.size()); }
  const std::vector<std::string>& shard_paths() const { return paths_; }
  int64_t total_tokens() const { return total_tokens_; }  // over all shards
  int64_t shard_tokens(int64_t shard) const { return shard_tokens_[static_cast<size_t>(shard)]; }

 private:
  int64_t step_span() const { return tokens_per_step() + 1; }  // tokens one step reads
  void load(int64_t shard);
  void advance();  // step 3

  std::vector<std::string> paths_;
  std::vector<int64_t> shard_tokens_;  // per shard, from the headers
  int64_t total_tokens_ = 0;
  int64_t batch_, seq_len_;
  int rank_, world_;
  int64_t vocab_size_ = 0;
  LoaderState state_;
  int64_t loaded_shard_ = -1;  // which shard mapped_ maps
  // The current shard, mapped: only the windows read are read from the file.
  std::unique_ptr<MappedShard> mapped_;
  std::vector<int> shard_token_bytes_;  // per shard, from the headers
  std::vector<bool> masked_;            // per shard: has a loss mask (use_loss_masks)
  std::unique_ptr<LossMaskFile> mask_;  // the current shard's, where it has one
  std::vector<uint8_t> mask_entries_;   // a read's entries
};

}  // namespace loom
