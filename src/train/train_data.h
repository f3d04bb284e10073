// The training batches of a run, read a sequence at a time by a BlendedLoader (data/blend.h):
// data.blend's corpora, or data.train as a blend of one — in order (the sequences a DataLoader of
// the whole step would read, but for shard tails: a layout-free stream, see blend.h) or shuffled
// each epoch (data.shuffle). One interface for the trainer: reading, the position in
// checkpoints, resuming, start-up lines.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "data/blend.h"

namespace loom {

class TrainData {
 public:
  // `micro` sequences of `seq_len` a call for data-parallel replica `rank` of `world`; every id is
  // checked against model.vocab_size on the host. Throws loom::Error naming data.train (or the
  // data.blend source) for shards that cannot be found or read.
  TrainData(const Config& config, int64_t micro, int64_t seq_len, int rank, int world);

  void next_batch(int32_t* inputs, int32_t* targets);

  // The position into `state`: loader_sources, and for data.train in order also loader_shard /
  // _offset / _epoch (where checkpoints before loader_sources kept it).
  void save(TrainingState& state) const;
  // Continues from a checkpoint's position (one from before loader_sources: data.train's in
  // order). A checkpoint read otherwise than this run reads — with or without data.blend, another
  // number of sources, data.shuffle on or off — is an error naming the checkpoint and both
  // readings. With data.blend's weights changed (another mix for the run's next phase) the
  // sources go on from their positions and the blending rule counts afresh, so the sequences from
  // here on follow the new shares; the return value then says so ("" otherwise).
  std::string resume(const TrainingState& state, const std::string& checkpoint);

  // Each source's epochs read so far, fractional (data.train: one source).
  std::vector<double> epochs_read();

  // A line per source: (with data.blend) its share, its tokens, and the passes over it that
  // `run_tokens` training tokens make.
  std::string describe(int64_t run_tokens) const;

 private:
  bool in_order_single_corpus() const;  // data.train without data.shuffle

  DataConfig data_;
  int64_t train_seed_ = 0;            // train.seed: the shuffled orders' seed unless data.seed
  std::vector<BlendSource> sources_;  // data.blend's, or data.train alone
  std::unique_ptr<BlendedLoader> loader_;
  std::vector<int64_t> masked_shards_;  // data.loss_mask: per source, its shards with a mask
};

}  // namespace loom
