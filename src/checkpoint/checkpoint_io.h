// The checkpoint files' common ground, shared by the whole-model writer (checkpoint.cc) and the
// sharded one (sharded_checkpoint.cc): durable writes, digests, state.json. Internal to the
// checkpoint layer.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace loom::checkpoint_io {

constexpr int kFormatVersion = 1;

// Writes `text` and flushes it to the disk (fsync).
void write_text_file(const std::filesystem::path& path, const std::string& text);
// Makes a rename inside `dir` durable (best effort).
void sync_directory(const std::filesystem::path& dir);
nlohmann::json digest_json(const FileDigest& d);  // {"bytes": N, "xxh3_64": "16 hex digits"}

// state.json, checked for its format version; errors name the checkpoint.
nlohmann::json read_state_json(const std::string& dir);
// Reads `file` of a checkpoint, checked against its recorded digest where there is one.
SafetensorsFile load_checked(const std::string& dir, const std::string& file,
                             const nlohmann::json& state);

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
