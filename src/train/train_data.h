// The training batches of a run: data.train's shards through a DataLoader (data/loader.h), or
// data.blend's corpora through a BlendedLoader (data/blend.h), behind one interface for the
// trainer — reading, the position in checkpoints, resuming, and the start-up lines.
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
  // Continues from a checkpoint's position. A checkpoint of a blended run resumed without
  // data.blend, or the other way round, or with another number of sources, is an error naming the
  // checkpoint and the keys.
  void resume(const TrainingState& state, const std::string& checkpoint);

  // With data.blend, a line per source: its share, shards, tokens, and the passes over it that
  // `run_tokens` training tokens make ("" without data.blend).
  std::string describe(int64_t run_tokens) const;

 private:
  std::unique_ptr<DataLoader> single_;
  std::unique_ptr<BlendedLoader> blend_;
  std::vector<BlendSource> sources_;  // data.blend's, when blend_
};

}  // namespace loom
