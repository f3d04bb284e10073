#include "train/train_data.h"

#include <cstdio>

#include "base/error.h"
#include "data/dataset.h"

namespace loom {

TrainData::TrainData(const Config& config, int64_t micro, int64_t seq_len, int rank, int world) {
  if (config.data.blend.empty()) {
    single_ = std::make_unique<DataLoader>(resolve_shards(config.data.train, "data.train"), micro,
                                           seq_len, rank, world);
    single_->set_vocab_size(config.model.vocab_size);
    return;
  }
  sources_ = parse_data_blend(config.data.blend);
  std::vector<std::vector<std::string>> shards;
  std::vector<double> weights;
  for (size_t d = 0; d < sources_.size(); ++d) {
    const std::string key = "data.blend source " + std::to_string(d + 1);
    shards.push_back(resolve_shards(sources_[d].spec, key));
    weights.push_back(sources_[d].weight);
  }
  blend_ = std::make_unique<BlendedLoader>(shards, weights, micro, seq_len, rank, world);
  blend_->set_vocab_size(config.model.vocab_size);
}

void TrainData::next_batch(int32_t* inputs, int32_t* targets) {
  if (blend_) {
    blend_->next_batch(inputs, targets);
  } else {
    single_->next_batch(inputs, targets);
  }
}

void TrainData::save(TrainingState& state) const {
  if (blend_) {
    state.loader_sources = blend_->state();
    return;
  }
  const LoaderState position = single_->state();
  state.loader_shard = position.shard;
  state.loader_offset = position.offset;
  state.loader_epoch = position.epoch;
}

void TrainData::resume(const TrainingState& state, const std::string& checkpoint) {
  const bool saved_blend = !state.loader_sources.empty();
  if (saved_blend && !blend_)
    fail("checkpoint ", checkpoint, " was written by a run reading data.blend (",
         state.loader_sources.size(), " sources); this run reads data.train: resume with the ",
         "config it was trained with (RUN_DIR/config.toml)");
  if (!saved_blend && blend_)
    fail("checkpoint ", checkpoint, " was written by a run reading data.train; this run reads ",
         "data.blend: resume with the config it was trained with (RUN_DIR/config.toml)");
  try {
    if (blend_) {
      blend_->set_state(state.loader_sources);
    } else {
      single_->set_state({state.loader_shard, state.loader_offset, state.loader_epoch});
    }
  } catch (const Error& e) {
    fail("checkpoint ", checkpoint, ": ", e.what());
  }
}

std::string TrainData::describe(int64_t run_tokens) const {
  if (!blend_) return "";
  std::string out;
  for (int64_t d = 0; d < blend_->num_sources(); ++d) {
    const double share = blend_->share(d);
    const double passes =
        share * static_cast<double>(run_tokens) / static_cast<double>(blend_->source_tokens(d));
    char line[160];
    std::snprintf(line, sizeof line, "data.blend source %lld: %5.1f%% of the sequences, ",
                  static_cast<long long>(d + 1), 100 * share);
    char figures[160];
    std::snprintf(figures, sizeof figures, " (%lld tokens; %.2f passes over this run)\n",
                  static_cast<long long>(blend_->source_tokens(d)), passes);
    out += line + sources_[static_cast<size_t>(d)].spec + figures;
  }
  return out;
}

}  // namespace loom
