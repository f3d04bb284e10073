#include "data/blend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "base/check.h"
#include "base/error.h"

namespace loom {

BlendedLoader::BlendedLoader(const std::vector<std::vector<std::string>>& source_shards,
                             std::vector<double> weights, int64_t batch, int64_t seq_len, int rank,
                             int world, std::optional<uint64_t> shuffle_seed)
    : batch_(batch), seq_len_(seq_len), rank_(rank), world_(world) {
  if (source_shards.empty()) fail("blended loader: no sources");
  if (weights.size() != source_shards.size())
    fail("blended loader: ", weights.size(), " weights for ", source_shards.size(), " sources");
  if (batch_ < 1 || seq_len_ < 1 || world_ < 1)
    fail("blended loader: batch = ", batch_, ", seq_len = ", seq_len_, ", world = ", world_,
         ": all must be >= 1");
  if (rank_ < 0 || rank_ >= world_)
    fail("blended loader: rank ", rank_, " is outside [0, world = ", world_, ")");
  const bool by_tokens =
      std::all_of(weights.begin(), weights.end(), [](double w) { return w == 0; });
  for (size_t d = 0; d < weights.size(); ++d)
    if (!by_tokens && !(weights[d] > 0 && std::isfinite(weights[d])))
      fail("blended loader: source ", d + 1, "'s weight ", weights[d],
           " must be positive (or every weight 0: shares by token count)");
  // Each source reads one sequence at a time (a loader of batch 1's shard checks included).
  sources_.reserve(source_shards.size());
  for (size_t d = 0; d < source_shards.size(); ++d)
    sources_.emplace_back(source_shards[d], seq_len_, shuffle_seed,
                          "data.shuffle/source " + std::to_string(d + 1));
  if (by_tokens)
    for (size_t d = 0; d < sources_.size(); ++d)
      weights[d] = static_cast<double>(sources_[d].total_tokens());
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double w : weights) shares_.push_back(w / total);
  sequences_.assign(sources_.size(), 0);
}

int64_t BlendedLoader::next_source() const {
  // Megatron-LM's rule: the source furthest behind its share after this sequence.
  const int64_t g = std::accumulate(sequences_.begin(), sequences_.end(), int64_t{0});
  int64_t best = 0;
  double best_lag = -INFINITY;
  for (size_t d = 0; d < shares_.size(); ++d) {
    const double lag = shares_[d] * static_cast<double>(g + 1) - static_cast<double>(sequences_[d]);
    if (lag > best_lag) best = static_cast<int64_t>(d), best_lag = lag;
  }
  return best;
}

void BlendedLoader::next_batch(int32_t* inputs, int32_t* targets) {
  LOOM_CHECK(inputs != nullptr && targets != nullptr);
  const int64_t mine = static_cast<int64_t>(rank_) * batch_;  // this rank's first sequence
  for (int64_t i = 0; i < world_ * batch_; ++i) {
    const int64_t d = next_source();
    SequenceReader& source = sources_[static_cast<size_t>(d)];
    if (i >= mine && i < mine + batch_) {
      const int64_t row = (i - mine) * seq_len_;
      source.next(inputs + row, targets + row);
    } else {
      source.skip();
    }
    ++sequences_[static_cast<size_t>(d)];
  }
}

void BlendedLoader::set_vocab_size(int64_t vocab_size) {
  for (SequenceReader& source : sources_) source.set_vocab_size(vocab_size);
}

std::vector<BlendSourceState> BlendedLoader::state() const {
  std::vector<BlendSourceState> out;
  for (size_t d = 0; d < sources_.size(); ++d) out.push_back({sources_[d].state(), sequences_[d]});
  return out;
}

void BlendedLoader::set_state(const std::vector<BlendSourceState>& state) {
  if (state.size() != sources_.size())
    fail("blended loader: the state has ", state.size(), " sources, the loader ", sources_.size(),
         " (was the checkpoint made with another data.blend?)");
  for (size_t d = 0; d < state.size(); ++d)
    if (state[d].sequences < 0)
      fail("blended loader: source ", d + 1, "'s sequence count ", state[d].sequences,
           " is negative");
  // All or nothing: a refused source puts the ones before it back.
  const std::vector<BlendSourceState> before = this->state();
  size_t d = 0;
  try {
    for (; d < state.size(); ++d) sources_[d].set_state(state[d].position);
  } catch (const Error& e) {
    for (size_t back = 0; back < d; ++back) sources_[back].set_state(before[back].position);
    fail("blended loader: source ", d + 1, ": ", e.what());
  }
  for (d = 0; d < state.size(); ++d) sequences_[d] = state[d].sequences;
}

}  // namespace loom
