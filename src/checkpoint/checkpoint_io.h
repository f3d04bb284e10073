// The checkpoint files' common ground, shared by the whole-model writer (checkpoint.cc) and the
// sharded one (sharded_checkpoint.cc) and their reader (checkpoint_reader.cc): durable writes,
// digests, state.json, where a sharded checkpoint's elements are. Internal to the checkpoint layer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded_checkpoint.h"

namespace loom::checkpoint_io {

constexpr int kFormatVersion = 1;

// Writes `text` and flushes it to the disk (fsync).
void write_text_file(const std::filesystem::path& path, const std::string& text);
// Makes a rename inside `dir` durable (best effort).
void sync_directory(const std::filesystem::path& dir);
nlohmann::json digest_json(const FileDigest& d);  // {"bytes": N, "xxh3_64": "16 hex digits"}

// state.json, checked for its format version; errors name the checkpoint.
nlohmann::json read_state_json(const std::string& dir);
// Checks `file` of a checkpoint against its recorded digest, where there is one, reading it
// through without keeping it; returns the digest checked (nullopt: none recorded).
std::optional<FileDigest> verify_file(const std::string& dir, const std::string& file,
                                      const nlohmann::json& state);
// Reads `file` of a checkpoint, checked against its recorded digest where there is one.
SafetensorsFile load_checked(const std::string& dir, const std::string& file,
                             const nlohmann::json& state);

// Every slice of the parameters of a sharded checkpoint, cut into
// runs of one row of the whole matrix: where each element of each row is.
struct ShardRuns {
  struct Run {
    int64_t col_begin, col_end;  // columns of the whole matrix
    size_t file;                 // in `files`
    int64_t at;                  // in the file's arrays, of col_begin
  };
  std::vector<std::string> files;
  std::map<std::string, std::map<int64_t, std::vector<Run>>> rows;  // name -> row -> runs

  // Cuts slice `s` of `files[file]` into its rows' runs; fails naming the checkpoint, the file
  // and the slice when it is inconsistent.
  void add(const std::string& dir, size_t file, const ShardSlice& s);

  // Calls copy(file, at, n, to) for every run of columns [c0, c0 + cols) of row `row` of
  // parameter `name`: n elements at `at` of the file's arrays go to column c0 + to. Fails naming
  // the row when some of its elements are in no run.
  template <typename Copy>
  void copy_row(const std::string& dir, const std::string& name, int64_t row, int64_t c0,
                int64_t cols, const Copy& copy) const {
    int64_t covered = 0;
    static const std::vector<Run> none;
    const std::vector<Run>* row_runs = &none;
    if (const auto n = rows.find(name); n != rows.end())
      if (const auto r = n->second.find(row); r != n->second.end()) row_runs = &r->second;
    for (const Run& run : *row_runs) {
      const int64_t lo = std::max(c0, run.col_begin), hi = std::min(c0 + cols, run.col_end);
      if (lo >= hi) continue;
      const int64_t src = run.at + lo - run.col_begin;
      if (src < 0)
        fail("checkpoint ", dir, ": ", files[run.file], "'s slice of '", name,
             "' lies outside its arrays");
      copy(run.file, src, hi - lo, lo - c0);
      covered += hi - lo;
    }
    if (covered != cols)
      fail("checkpoint ", dir, ": its shards hold ", covered, " of the ", cols, " elements of row ",
           row, " (columns ", c0, "-", c0 + cols - 1, ") of '", name, "'");
  }
};

// Every slice a sharded checkpoint's state.json lists, with the index of the file holding it.
struct ShardSlices {
  std::vector<std::string> files;
  std::vector<std::pair<size_t, ShardSlice>> slices;
};
ShardSlices shard_slices(const std::string& dir, const nlohmann::json& state);

// The runs of the parameters in `wanted` of sharded checkpoint `dir` (`state`: its state.json);
// fails naming the checkpoint and the slice when a slice is inconsistent.
ShardRuns shard_runs(const std::string& dir, const nlohmann::json& state,
                     const std::set<std::string>& wanted);

// state.json's fields but `files` (and a sharded checkpoint's index): the training state, the
// model shape and the whole parameters' shapes (`params` holds whole parameters, or shards whose
// full_shape is recorded).
nlohmann::json state_json(const TrainingState& state, const ParameterStore& params,
                          const Gpt2Config& model, bool has_optimizer);
TrainingState training_state_of(const std::string& checkpoint_dir, const nlohmann::json& state);

// Empties and creates step_N.tmp under `checkpoints_dir` (created if missing); returns its path.
std::filesystem::path make_tmp_dir(const std::string& checkpoints_dir, int64_t step);
// Renames a complete step_N.tmp to step_N (replacing an older one of that step) and syncs the
// directory holding it.
void publish(const std::filesystem::path& tmp_dir, const std::filesystem::path& final_dir);

}  // namespace loom::checkpoint_io
