// Sharded checkpoints: every rank writes the state it owns, no rank ever holds the whole model,
// and any layout reads any other's (docs/formats.md, "Sharded checkpoints").
//
//   RUN_DIR/checkpoints/step_N/
//     shard_R.safetensors  per writing rank R: 1-D f32 tensors "values", "exp_avg", "exp_avg_sq"
//                          of equal length, the rank's pieces of every parameter, concatenated
//     state.json           as a whole-model checkpoint's (step, loader, model shape, files and
//                          their digests), plus "format": "sharded" and "shards": for every file,
//                          its slices [name, row, col, rows, cols, begin, count, at]
//
// A slice says: elements [begin, begin + count) (row-major) of the block of parameter `name`
// whose origin is (row, col) and size rows × cols — the parameter seen as a 2-D matrix (a 1-D
// parameter has one column) — are at [at, at + count) of the file's arrays. A tensor-parallel
// shard's block is its piece of the matrix; a ZeRO chunk is a flat run of the part's buffer,
// which may start and end mid-row; both are slices, and every element of every parameter is in
// exactly one of them.
//
// Reading is by name and coordinates, so it does not depend on the writer's layout: a rank builds
// its own part (whole parameters, or tensor-parallel shards with their pieces) from the slices
// that cover it, and reads only the files holding those, each checked against its digest.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "nn/parameter.h"

namespace loom {

struct ShardSlice {
  std::string name;
  int64_t row = 0, col = 0;      // the block's origin in the parameter (as a 2-D matrix)
  int64_t rows = 0, cols = 0;    // the block's size
  int64_t begin = 0, count = 0;  // its elements [begin, begin + count), row-major
  int64_t at = 0;                // where they start in the file's arrays
  bool operator==(const ShardSlice&) const = default;
};

// The slices of the store's flat ranges [first, second) — concatenated in order, the arrays a
// rank writes — for its parameters whose names are not in `skip` (a copy another rank writes).
std::vector<ShardSlice> slices_of(const ParameterStore& store,
                                  const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                  const std::set<std::string>& skip = {});

// Where step_N of a checkpoints directory is written before it is complete: step_N.tmp.
std::string checkpoint_tmp_dir(const std::string& checkpoints_dir, int64_t step);

// Empties and creates step_N.tmp for a sharded checkpoint and returns its path. One rank calls
// it; the others write their shards after it (a barrier between).
std::string begin_sharded_checkpoint(const std::string& checkpoints_dir, int64_t step);

// One rank's shard: shard_<rank>.safetensors (the three arrays, host f32 of one length; the
// moments may be undefined when the checkpoint holds no optimizer state) and its index
// shard_<rank>.json, both flushed to the disk. An empty shard writes the index only.
void write_shard(const std::string& tmp_dir, int rank, const std::vector<ShardSlice>& slices,
                 const FlatModelState& arrays);

// After every rank 0..ranks-1 wrote its shard (a barrier between): merges their indexes into
// state.json, checks that the slices cover every element of every parameter of `whole` exactly
// once, renames step_N.tmp to step_N and returns its path.
std::string finish_sharded_checkpoint(const std::string& tmp_dir, int ranks,
                                      const ParameterStore& whole, const Gpt2Config& model,
                                      const TrainingState& state, bool has_optimizer);

bool is_sharded_checkpoint(const std::string& checkpoint_dir);

// Fills `into` (laid out as `store`, allocated by the caller; padding left as it is) with the
// store's parameters — whole, or shards with their pieces — from a sharded checkpoint; the
// moments too when into.exp_avg is defined. Reads only the files holding them, each checked
// against its digest. A parameter the checkpoint lacks, or of another shape, or an element no
// slice covers, is an error naming the checkpoint and the parameter.
TrainingState load_sharded_checkpoint_into(const std::string& checkpoint_dir,
                                           const ParameterStore& store, FlatModelState& into);
// The same for several stores at once (a rank's pipeline chunks), each file read once.
struct ShardTarget {
  const ParameterStore* store;
  FlatModelState* into;
};
TrainingState load_sharded_checkpoint_into(const std::string& checkpoint_dir,
                                           const std::vector<ShardTarget>& targets);

}  // namespace loom
