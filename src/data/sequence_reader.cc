#include "data/sequence_reader.h"

#include <numeric>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "tensor/rng.h"

namespace loom {
namespace {

// A permutation of 0..n-1: Fisher-Yates over the stream (seed, name). Each swap draws 64 bits
// and takes them modulo i + 1: a bias below 2^-32 for any shard or shard count.
std::vector<int64_t> permutation(int64_t n, uint64_t seed, const std::string& name) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  RandomStream rng(seed, name);
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t high = rng.next_u32();
    const uint64_t bits = high << 32 | rng.next_u32();
    std::swap(order[static_cast<size_t>(i)],
              order[static_cast<size_t>(bits % static_cast<uint64_t>(i + 1))]);
  }
  return order;
}

}  // namespace

SequenceReader::SequenceReader(std::vector<std::string> shards, int64_t seq_len,
                               std::optional<uint64_t> shuffle_seed, std::string name)
    : shards_(std::move(shards), /*batch=*/1, seq_len),
      seq_len_(seq_len),
      shuffle_seed_(shuffle_seed),
      name_(std::move(name)) {}

int64_t SequenceReader::windows(int64_t shard) const {
  return (shards_.shard_tokens(shard) - 1) / seq_len_;
}

int64_t SequenceReader::shard_at(int64_t epoch, int64_t place) {
  if (!shuffled()) return place;
  if (order_epoch_ != epoch) {
    shard_order_ =
        permutation(num_shards(), *shuffle_seed_, name_ + "/shards/epoch " + std::to_string(epoch));
    order_epoch_ = epoch;
  }
  return shard_order_[static_cast<size_t>(place)];
}

int64_t SequenceReader::begin_at(int64_t epoch, int64_t shard, int64_t offset) {
  if (!shuffled()) return offset;
  if (windows_epoch_ != epoch || windows_shard_ != shard) {
    window_order_ = permutation(
        windows(shard), *shuffle_seed_,
        name_ + "/windows/epoch " + std::to_string(epoch) + "/shard " + std::to_string(shard));
    windows_epoch_ = epoch;
    windows_shard_ = shard;
  }
  return window_order_[static_cast<size_t>(offset / seq_len_)] * seq_len_;
}

void SequenceReader::next(int32_t* inputs, int32_t* targets) {
  const int64_t shard = shard_at(state_.epoch, state_.shard);
  shards_.read_at(shard, begin_at(state_.epoch, shard, state_.offset), inputs, targets);
  skip();
}

void SequenceReader::skip() {
  state_.offset += seq_len_;
  // A window still fits (in order, as a DataLoader of batch 1; shuffled, j < n).
  if (state_.offset + seq_len_ + 1 <= shards_.shard_tokens(shard_at(state_.epoch, state_.shard)))
    return;
  state_.offset = 0;
  if (++state_.shard == num_shards()) {
    state_.shard = 0;
    ++state_.epoch;
  }
}

double SequenceReader::epochs_read() {
  int64_t per_epoch = 0, before = 0;
  for (int64_t place = 0; place < num_shards(); ++place) {
    const int64_t n = windows(shard_at(state_.epoch, place));
    per_epoch += n;
    if (place < state_.shard) before += n;
  }
  const int64_t read = before + state_.offset / seq_len_;
  return static_cast<double>(state_.epoch) +
         static_cast<double>(read) / static_cast<double>(per_epoch);
}

void SequenceReader::set_state(const LoaderState& state) {
  const bool place_ok = state.shard >= 0 && state.shard < num_shards() && state.epoch >= 0;
  const int64_t shard = place_ok ? shard_at(state.epoch, state.shard) : -1;
  // In order any offset a window fits at (a DataLoader's); shuffled a window's start.
  const bool offset_ok =
      place_ok && state.offset >= 0 &&
      (shuffled() ? state.offset % seq_len_ == 0 && state.offset / seq_len_ < windows(shard)
                  : state.offset + seq_len_ + 1 <= shards_.shard_tokens(shard));
  if (!offset_ok) {
    const std::string where =
        place_ok ? detail::concat("shard '", shards_.shard_paths()[static_cast<size_t>(shard)],
                                  "' holds ", windows(shard), " sequences of ", seq_len_,
                                  " tokens (", shards_.shard_tokens(shard), " tokens)")
                 : detail::concat("there are ", num_shards(), " shards");
    fail("data loader: state {shard ", state.shard, ", offset ", state.offset, ", epoch ",
         state.epoch, "} is out of range", shuffled() ? " for a shuffled reader" : "", ": ", where,
         " (was the checkpoint made with other data?)");
  }
  state_ = state;
}

}  // namespace loom
