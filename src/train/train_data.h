// The training batches of a run: data.train's shards in order through a DataLoader
// (data/loader.h), or a sequence at a time through a BlendedLoader (data/blend.h) — data.blend's
// corpora, or data.train alone when data.shuffle asks for another order each epoch — behind one
// interface for the trainer: reading, the position in checkpoints, resuming, start-up lines.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "data/blend.h"
#include "data/loader.h"

namespace loom {

class TrainData {
 public:
  // `micro` sequences of `seq_len` a call for data-parallel replica `rank` of `world`; every id is
  // checked against model.vocab_size on the host. Throws loom::Error naming data.train (or the
  // data.blend source) for shards that cannot be found or read.
  TrainData(const Config& config, int64_t micro, int64_t seq_len, int rank, int world);

  void next_batch(int32_t* inputs, int32_t* targets);

  // The position into `state` (loader_shard / _offset / _epoch, or loader_sources).
  void save(TrainingState& state) const;
  // Continues from a checkpoint's position. A checkpoint read otherwise than this run reads —
  // with or without data.blend, another number of sources, data.shuffle on or off — is an error
  // naming the checkpoint and both readings.
  void resume(const TrainingState& state, const std::string& checkpoint);

  // With data.blend, a line per source: its share, shards, tokens, and the passes over it that
  // `run_tokens` training tokens make ("" without data.blend).
  std::string describe(int64_t run_tokens) const;

 private:
  std::unique_ptr<DataLoader> single_;
  std::unique_ptr<BlendedLoader> blend_;
  DataConfig data_;
  std::vector<BlendSource> sources_;  // blend_'s: data.blend's, or data.train alone
};

}  // namespace loom
