#include "train/train_data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "base/error.h"
#include "data/dataset.h"
#include "data/shard.h"

namespace loom {

namespace {

// How a run reads its training data, for resume's messages; a shuffled reading with the seed of
// its orders.
std::string reading(const DataConfig& data, int64_t train_seed) {
  std::string how =
      data.blend.empty()
          ? std::string("data.train")
          : detail::concat("data.blend (", parse_data_blend(data.blend).size(), " sources)");
  if (!data.shuffle) return how + ", in order";
  return detail::concat(how, ", shuffled (data.shuffle = true) by seed ",
                        data.order_seed(train_seed),
                        data.seed >= 0 ? " (data.seed)" : " (train.seed)");
}

// A blend's shares as written: normalised weights, or empty for shares by token count.
std::vector<double> written_shares(const std::vector<BlendSource>& sources) {
  double total = 0;
  for (const BlendSource& s : sources) total += s.weight;
  std::vector<double> shares;
  if (total > 0)
    for (const BlendSource& s : sources) shares.push_back(s.weight / total);
  return shares;
}

bool same_shares(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-12 * std::max(a[i], b[i])) return false;
  return true;
}

std::string weights_text(const std::vector<BlendSource>& sources) {
  std::string text;
  for (const BlendSource& s : sources) text += detail::concat(text.empty() ? "" : " ", s.weight);
  return text;
}

}  // namespace

TrainData::TrainData(const Config& config, int64_t micro, int64_t seq_len, int rank, int world)
    : data_(config.data), train_seed_(config.train.seed) {
  // A sequence at a time, whatever the reading: a blend's sources, or data.train as a blend of
  // one. (A loader reading whole steps would skip a shard's tail whose length depends on the
  // layout's ranks × micro-batch, and layouts would part at every shard's end.)
  sources_ = config.data.blend.empty() ? std::vector<BlendSource>{{1, config.data.train}}
                                       : parse_data_blend(config.data.blend);
  std::vector<std::vector<std::string>> shards;
  std::vector<double> weights;
  for (size_t d = 0; d < sources_.size(); ++d) {
    const std::string key = config.data.blend.empty()
                                ? std::string("data.train")
                                : "data.blend source " + std::to_string(d + 1);
    shards.push_back(resolve_shards(sources_[d].spec, key));
    weights.push_back(sources_[d].weight);
  }
  std::optional<uint64_t> shuffle_seed;
  if (config.data.shuffle)
    shuffle_seed = static_cast<uint64_t>(config.data.order_seed(config.train.seed));
  loader_ =
      std::make_unique<BlendedLoader>(shards, weights, micro, seq_len, rank, world, shuffle_seed);
  loader_->set_vocab_size(config.model.vocab_size);
  if (config.data.loss_mask) {
    masked_shards_ = loader_->use_loss_masks();
    int64_t masked = 0;
    for (int64_t n : masked_shards_) masked += n;
    if (masked == 0)
      fail("data.loss_mask = true, but no shard of ",
           config.data.blend.empty() ? "data.train" : "data.blend",
           " has a loss mask beside it (for '", shards[0][0], "' that is '",
           loss_mask_path(shards[0][0]), "'; docs/formats.md)");
  }
}

void TrainData::next_batch(int32_t* inputs, int32_t* targets) {
  loader_->next_batch(inputs, targets);
}

bool TrainData::in_order_single_corpus() const {
  return data_.blend.empty() && !data_.shuffle;
}

void TrainData::save(TrainingState& state) const {
  state.loader_sources = loader_->state();
  // data.train in order: its position also where checkpoints before loader.sources kept it.
  if (in_order_single_corpus()) {
    const LoaderState& position = state.loader_sources[0].position;
    state.loader_shard = position.shard;
    state.loader_offset = position.offset;
    state.loader_epoch = position.epoch;
  }
}

std::string TrainData::resume(const TrainingState& state, const std::string& checkpoint) {
  // The position means something only to the reading it came from: a blend's, a shuffled
  // order's, or data.train's in order. The checkpoint's config says which. Without a config it
  // can parse, a checkpoint with no position per source is from before them: data.train in
  // order; one with them is checked by their count (set_state).
  std::optional<DataConfig> saved;
  int64_t saved_train_seed = 0;
  try {
    if (!state.config_toml.empty()) {
      const Config config = parse_config(state.config_toml, checkpoint);
      saved = config.data;
      saved_train_seed = config.train.seed;
    }
  } catch (const Error&) {
  }
  // A shuffled position is a place in the orders its seed drew: another seed's would read some
  // sequences of the epoch twice and others never.
  const bool same_reading =
      saved ? saved->blend.empty() == data_.blend.empty() && saved->shuffle == data_.shuffle &&
                  (saved->blend.empty() ||
                   parse_data_blend(saved->blend).size() == sources_.size()) &&
                  (!data_.shuffle ||
                   saved->order_seed(saved_train_seed) == data_.order_seed(train_seed_))
            : !state.loader_sources.empty() || in_order_single_corpus();
  if (!same_reading)
    fail("checkpoint ", checkpoint, " was written by a run reading ",
         saved ? reading(*saved, saved_train_seed) : std::string("data.train, in order"),
         "; this run reads ", reading(data_, train_seed_),
         ": resume with the config it was trained with (RUN_DIR/config.toml)",
         data_.shuffle && saved && saved->shuffle
             ? detail::concat(", or set data.seed = ", saved->order_seed(saved_train_seed),
                              " to keep its data order")
             : std::string());
  // Checkpoints from before loader.sources: data.train's position in order, and a single
  // corpus's count of sequences does not matter (every sequence is its).
  std::vector<BlendSourceState> position = state.loader_sources;
  if (position.empty())
    position.push_back({{state.loader_shard, state.loader_offset, state.loader_epoch}, 0});
  // New weights (a data mix changed for the run's next phase, as an annealing phase's): the
  // blending rule starts counting again, so the sequences from here on are mixed at the new
  // shares — not at whatever would bring the whole run's counts to them — and each source goes
  // on from its position.
  std::string note;
  if (saved && !saved->blend.empty()) {
    const std::vector<BlendSource> before = parse_data_blend(saved->blend);
    if (!same_shares(written_shares(before), written_shares(sources_))) {
      for (BlendSourceState& source : position) source.sequences = 0;
      note = detail::concat("data.blend's weights changed since the checkpoint (",
                            weights_text(before), " -> ", weights_text(sources_),
                            "): the sequences from here on are mixed at the new shares");
    }
  }
  try {
    loader_->set_state(position);
  } catch (const Error& e) {
    fail("checkpoint ", checkpoint, ": ", e.what());
  }
  return note;
}

std::vector<double> TrainData::epochs_read() {
  std::vector<double> epochs;
  for (int64_t d = 0; d < loader_->num_sources(); ++d) epochs.push_back(loader_->epochs_read(d));
  return epochs;
}

std::string TrainData::describe(int64_t run_tokens) const {
  std::string out;
  for (int64_t d = 0; d < loader_->num_sources(); ++d) {
    const double share = loader_->share(d);
    const double passes =
        share * static_cast<double>(run_tokens) / static_cast<double>(loader_->source_tokens(d));
    char figures[200];
    std::snprintf(figures, sizeof figures, " (%lld tokens; %.2f passes over this run%s)\n",
                  static_cast<long long>(loader_->source_tokens(d)), passes,
                  data_.shuffle ? ", each pass in its own order" : "");
    if (data_.blend.empty()) {
      out += "data.train: " + sources_[0].spec + figures;
      continue;
    }
    char share_text[96];
    std::snprintf(share_text, sizeof share_text,
                  "data.blend source %lld: %5.1f%% of the sequences, ",
                  static_cast<long long>(d + 1), 100 * share);
    out += share_text + sources_[static_cast<size_t>(d)].spec + figures;
  }
  for (size_t d = 0; d < masked_shards_.size(); ++d)
    out += detail::concat("data.loss_mask: ", masked_shards_[d], " of ",
                          loader_->source_shards(static_cast<int64_t>(d)), " shards of ",
                          data_.blend.empty() ? std::string("data.train")
                                              : detail::concat("data.blend source ", d + 1),
                          " have loss masks (the loss is the mean over the targets they keep)\n");
  if (data_.eod_mask_loss)
    out += "data.eod_mask_loss: no loss where the input is token " +
           std::to_string(data_.eot_token) + "; the mean over the targets left\n";
  if (data_.document_mask)
    out +=
        "data.document_mask: each token attends within its document, documents ending at "
        "token " +
        std::to_string(data_.eot_token) + "\n";
  return out;
}

}  // namespace loom
