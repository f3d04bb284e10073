#include "data/loader.h"

#include <limits>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "data/shard.h"
#include "kernels/targets.h"

namespace loom {

DataLoader::DataLoader(std::vector<std::string> shard_paths, int64_t batch, int64_t seq_len,
                       int rank, int world)
    : paths_(std::move(shard_paths)), batch_(batch), seq_len_(seq_len), rank_(rank), world_(world) {
  if (paths_.empty()) fail("data loader: no shards to read");
  if (batch_ < 1 || seq_len_ < 1 || world_ < 1)
    fail("data loader: batch = ", batch_, ", seq_len = ", seq_len_, ", world = ", world_,
         ": all must be >= 1");
  if (rank_ < 0 || rank_ >= world_)
    fail("data loader: rank ", rank_, " is outside [0, world = ", world_, ")");
  // Guard the step arithmetic: W*B*T + 1 must fit comfortably in int64 (it is at most a shard).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (batch_ > kMax || seq_len_ > kMax || batch_ * seq_len_ > kMax / world_)
    fail("data loader: world × batch × seq_len = ", world_, " × ", batch_, " × ", seq_len_,
         " tokens per step exceeds the largest possible shard (", kMax, " tokens)");

  shard_tokens_.reserve(paths_.size());
  for (const std::string& path : paths_) {
    const ShardInfo info = read_shard_header(path);
    if (info.num_tokens < step_span())
      fail("data loader: token shard '", path, "' has ", info.num_tokens,
           " tokens, fewer than one step reads: world × batch × seq_len + 1 = ", world_, " × ",
           batch_, " × ", seq_len_, " + 1 = ", step_span(),
           " (use bigger shards or a smaller batch/seq_len)");
    shard_tokens_.push_back(info.num_tokens);
    shard_token_bytes_.push_back(info.token_bytes);
    total_tokens_ += info.num_tokens;
  }
}

void DataLoader::load(int64_t shard) {
  if (loaded_shard_ == shard) return;
  loaded_shard_ = -1;  // stays invalid if the mapping fails
  mapped_.reset();     // one shard mapped at most
  mask_.reset();
  mapped_ = std::make_unique<MappedShard>(paths_[shard]);
  const ShardInfo& info = mapped_->info();
  if (info.num_tokens != shard_tokens_[shard] || info.token_bytes != shard_token_bytes_[shard])
    fail("data loader: token shard '", paths_[shard], "' changed on disk: it had ",
         shard_tokens_[shard], " tokens of ", shard_token_bytes_[shard],
         " bytes when the loader opened it, now ", info.num_tokens, " of ", info.token_bytes);
  if (!masked_.empty() && masked_[static_cast<size_t>(shard)]) {
    mask_ = std::make_unique<LossMaskFile>(loss_mask_path(paths_[shard]));
    if (mask_->tokens() != shard_tokens_[shard])
      fail("data loader: loss mask '", loss_mask_path(paths_[shard]), "' changed on disk: it has ",
           mask_->tokens(), " entries, its shard ", shard_tokens_[shard], " tokens");
  }
  loaded_shard_ = shard;
}

void DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
  LOOM_CHECK(state_.offset + step_span() <= shard_tokens_[state_.shard]);
  // 1-2. This rank's chunk: B*T tokens (plus one for the last target) at offset + rank*B*T.
  read_at(state_.shard, state_.offset + rank_ * batch_ * seq_len_, inputs, targets);
  advance();
}

void DataLoader::read_at(int64_t shard, int64_t begin, int32_t* inputs, int32_t* targets) {
  LOOM_CHECK(inputs != nullptr && targets != nullptr);
  const int64_t chunk = batch_ * seq_len_;
  LOOM_CHECK(shard >= 0 && shard < num_shards() && begin >= 0 &&
             begin + chunk + 1 <= shard_tokens_[shard]);
  load(shard);
  const MappedShard::Reading reading(*mapped_);  // a shard shrunk under us is named, not a crash
  const auto copy = [&](const auto* src) {
    // A uint32 shard's id must be an int32 (the model's ids); checked as read, not at mapping.
    if constexpr (sizeof(*src) == 4)
      for (int64_t i = 0; i <= chunk; ++i)
        if (src[i] > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
          fail("data loader: token shard '", paths_[static_cast<size_t>(shard)], "': token ",
               begin + i, " is ", src[i], ", beyond any vocabulary (int32 ids)");
    if (vocab_size_ > 0)
      for (int64_t i = 0; i <= chunk; ++i)
        if (static_cast<int64_t>(src[i]) >= vocab_size_)
          fail(paths_[static_cast<size_t>(shard)], ": token id ", static_cast<int64_t>(src[i]),
               " at token ", begin + i, " is outside the model's vocabulary [0, ", vocab_size_,
               ") (model.vocab_size)");
    for (int64_t i = 0; i < chunk; ++i) {
      inputs[i] = static_cast<int32_t>(src[i]);
      targets[i] = static_cast<int32_t>(src[i + 1]);
    }
  };
  if (shard_token_bytes_[shard] == 2)
    copy(mapped_->tokens16() + begin);
  else
    copy(mapped_->tokens32() + begin);
  if (mask_ != nullptr) {  // the targets are tokens begin + 1 .. begin + chunk
    mask_entries_.resize(static_cast<size_t>(chunk));
    mask_->read(begin + 1, chunk, mask_entries_.data());
    for (int64_t i = 0; i < chunk; ++i)
      if (mask_entries_[static_cast<size_t>(i)] == 0) targets[i] = kIgnoredTarget;
  }
}

int64_t DataLoader::use_loss_masks() {
  masked_.assign(paths_.size(), false);
  int64_t count = 0;
  for (size_t s = 0; s < paths_.size(); ++s) {
    masked_[s] = has_loss_mask(paths_[s], shard_tokens_[s]);
    count += masked_[s] ? 1 : 0;
  }
  loaded_shard_ = -1;  // the current shard's mask opened at the next read
  return count;
}

// 3. Advances the shared position; skips to the next shard (wrapping) if a step no longer fits.
void DataLoader::advance() {
  state_.offset += tokens_per_step();
  if (state_.offset + step_span() > shard_tokens_[state_.shard]) {
    state_.offset = 0;
    if (++state_.shard == num_shards()) {
      state_.shard = 0;
      ++state_.epoch;
    }
  }
}

void DataLoader::set_state(const LoaderState& state) {
  const bool shard_ok = state.shard >= 0 && state.shard < num_shards();
  if (!shard_ok || state.offset < 0 || state.epoch < 0 ||
      state.offset + step_span() > shard_tokens_[state.shard]) {
    const std::string where =
        shard_ok ? detail::concat("shard ", state.shard, " ('", paths_[state.shard], "') has ",
                                  shard_tokens_[state.shard], " tokens")
                 : detail::concat("there are ", num_shards(), " shards");
    fail("data loader: state {shard ", state.shard, ", offset ", state.offset, ", epoch ",
         state.epoch, "} is out of range: ", where, " and a step reads ", step_span(),
         " tokens from the offset (was the checkpoint made with other data?)");
  }
  state_ = state;
}

}  // namespace loom
