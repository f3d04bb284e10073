// BlendedLoader — several training corpora mixed by weight (data.blend, Megatron-LM's
// --data-path), deterministic and resumable under any layout.
//
// Shapes as DataLoader's: B = batch (sequences per micro-batch), T = seq_len, W = world.
//
// The training sequences form one global stream. Sequence g (counted from the run's start, over
// all ranks) comes from the source d that maximises  share_d * (g + 1) - n_d,  n_d being the
// sequences source d has given so far (ties: the first such source). This is Megatron-LM's
// blending rule (build_blending_indices): it uses no random numbers and keeps every source's
// count within one sequence of its share at every g. Within a source, sequences are read by a
// SequenceReader (data/sequence_reader.h): in order, as a DataLoader of batch 1 — T tokens and
// the one after them, consecutive windows T apart, a shard's tail shorter than T + 1 skipped,
// after its last shard the source wraps to its first (that source's epoch: a small source repeats
// while a large one goes on) — or shuffled within each epoch. One source of weight 1 is the
// single corpus read a sequence at a time (data.shuffle without data.blend).
//
// Each next_batch takes the next W*B sequences of the stream, rank r the r-th B of them: the union
// over ranks is what one rank with batch W*B reads. Every rank follows every sequence (it advances
// the counts and the sources' positions, reading only its own), so the state is the same on every
// rank and depends on neither the world size nor the batch: a run resumes under another layout on
// the same stream of sequences.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"
#include "data/sequence_reader.h"

namespace loom {

// A blended loader's position in one source.
struct BlendSourceState {
  LoaderState position;   // in the source's shards (SequenceReader::state)
  int64_t sequences = 0;  // the sequences it has given so far
  bool operator==(const BlendSourceState&) const = default;
};

class BlendedLoader {
 public:
  // source_shards[d]: source d's shards in reading order; weights[d] > 0 its weight (normalised
  // here), or 0 for every source to weigh each by its tokens. With `shuffle_seed` every source is
  // shuffled (source d's stream named "data.shuffle/source d"). Throws loom::Error for no
  // sources, weights that do not match the sources or mix 0 with positive values, and whatever a
  // DataLoader of batch 1 throws for a source's shards (a shard shorter than T + 1 tokens).
  BlendedLoader(const std::vector<std::vector<std::string>>& source_shards,
                std::vector<double> weights, int64_t batch, int64_t seq_len, int rank = 0,
                int world = 1, std::optional<uint64_t> shuffle_seed = std::nullopt);

  // Fills inputs (B, T) and targets (B, T), row-major, with this rank's sequences of the next
  // W*B, then advances past all W*B. With a vocabulary set, every id is checked (DataLoader's
  // check, naming the shard).
  void next_batch(int32_t* inputs, int32_t* targets);
  void set_vocab_size(int64_t vocab_size);
  // Every source's targets masked by its shards' loss masks (DataLoader::use_loss_masks): how
  // many shards have one, per source.
  std::vector<int64_t> use_loss_masks() {
    std::vector<int64_t> counts;
    for (SequenceReader& s : sources_) counts.push_back(s.use_loss_masks());
    return counts;
  }
  int64_t source_shards(int64_t source) const {
    return sources_[static_cast<size_t>(source)].num_shards();
  }

  // Per source, in the order given.
  std::vector<BlendSourceState> state() const;
  // Continue from `state` (e.g. from a checkpoint); throws loom::Error if it has another number
  // of sources or a position out of range for a source's shards.
  void set_state(const std::vector<BlendSourceState>& state);

  int64_t num_sources() const { return static_cast<int64_t>(sources_.size()); }
  double share(int64_t source) const { return shares_[static_cast<size_t>(source)]; }
  // Source `source`'s epochs read so far (SequenceReader::epochs_read).
  double epochs_read(int64_t source) { return sources_[static_cast<size_t>(source)].epochs_read(); }
  int64_t source_tokens(int64_t source) const {
    return sources_[static_cast<size_t>(source)].total_tokens();
  }
  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t tokens_per_step() const { return world_ * batch_ * seq_len_; }  // over all ranks

 private:
  int64_t next_source() const;  // the source of the next sequence of the stream

  std::vector<SequenceReader> sources_;
  std::vector<double> shares_;       // normalised weights
  std::vector<int64_t> sequences_;   // n_d
  int64_t batch_, seq_len_;
  int rank_, world_;
};

}  // namespace loom
