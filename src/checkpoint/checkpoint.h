// Single-device training checkpoints.
//
//   RUN_DIR/checkpoints/step_N/
//     model.safetensors      parameters by name (f32), metadata: format, step
//     optimizer.safetensors  "<name>.exp_avg" and "<name>.exp_avg_sq" per parameter
//     state.json             step, optimizer steps, data-loader position, seed, loss scale,
//                            model shape, resolved config, and the length and XXH3-64 digest of
//                            each tensor file (docs/formats.md)
//
// Loading checks every tensor file against its recorded digest: a damaged, truncated or swapped
// file is an error naming the checkpoint and the file (and the checkpoint before it), never a
// run that resumes from garbage. Every file is fsynced before the directory is renamed.
//
// A checkpoint is written to step_N.tmp/ and renamed to step_N/ only when every file is complete,
// so a crash mid-save never leaves a directory that looks finished. Everything is keyed by
// parameter name, never by rank or layout. The sharded format, where every rank writes what it
// owns, is checkpoint/sharded_checkpoint.h; load_checkpoint reads either.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_digest.h"
#include "data/blend.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"

namespace loom {

struct TrainingState {
  int64_t step = 0;             // training steps completed
  int64_t optimizer_steps = 0;  // AdamW's bias-correction counter
  int64_t loader_shard = 0;     // data-loader position
  int64_t loader_offset = 0;
  int64_t loader_epoch = 0;
  uint64_t seed = 0;
  std::string config_toml;      // the resolved config of the run that wrote it
  // The loss scaler's state (optim/loss_scaler.h); absent in checkpoints written before loss
  // scaling existed, which then resume with the configured initial scale.
  std::optional<LossScalerState> loss_scaler;
  // A blended loader's position, per source of data.blend (data/blend.h); empty otherwise.
  std::vector<BlendSourceState> loader_sources;
  // A mixture's balancing biases (model.moe_bias_update_rate, nn/moe_mlp.h), n_layers × experts
  // block-major; empty without them. state.json's "moe_expert_bias".
  std::vector<float> expert_bias;
};

// Writes step_N under `checkpoints_dir` (created if missing) and returns its path.
std::string save_checkpoint(const std::string& checkpoints_dir, Gpt2& model, AdamW* optimizer,
                            const TrainingState& state);
// The same from flat buffers laid out as `layout` says.
std::string save_checkpoint(const std::string& checkpoints_dir, const ParameterStore& layout,
                            const Gpt2Config& model, const FlatModelState& state,
                            const TrainingState& training);

// Checks every tensor file of a checkpoint against the digests its state.json recorded, without
// loading it; returns what was checked, in state.json's order. Throws loom::Error naming the
// first file that does not match (or a checkpoint from before digests existed).
std::vector<FileDigest> verify_checkpoint(const std::string& checkpoint_dir);

// The complete checkpoints (step_N with a state.json) under `checkpoints_dir`, by step.
std::vector<std::string> list_checkpoints(const std::string& checkpoints_dir);

// After saving step `saved`: removes the complete checkpoints under `checkpoints_dir` up to that
// step but the newest `keep` of them (keep >= 1), and returns what it removed, oldest first.
// Left alone: checkpoints of later steps (a run resumed from an earlier checkpoint of its run
// directory; those are another timeline's, for the user to judge), and incomplete ones
// (step_N.tmp, a save cut short, which the next save of that step replaces).
std::vector<std::string> prune_checkpoints(const std::string& checkpoints_dir, int64_t keep,
                                           int64_t saved);

// The checkpoints a path names, by step: the path itself (a step_N), else the complete ones in
// it (a directory of checkpoints) or in its checkpoints/ (a run directory); empty when there are
// none. (`loom checkpoint verify|export`, `loom sample`, train.init_from.)
std::vector<std::string> checkpoints_at(const std::string& path);

// The complete checkpoint with the highest step under `checkpoints_dir`, or "" when none.
std::string find_latest_checkpoint(const std::string& checkpoints_dir);

// The model shape recorded in a checkpoint (for `loom sample`).
Gpt2Config read_checkpoint_model(const std::string& checkpoint_dir);

// Loads parameters (and optimizer moments when `optimizer` is not null) into already built
// objects. Every parameter must be present with the model's shape: a mismatch is an error that
// names the checkpoint, the parameter and both shapes. Returns the recorded training state.
// The model's mixtures get the checkpoint's balancing biases too (Gpt2::set_expert_biases).
TrainingState load_checkpoint(const std::string& checkpoint_dir, Gpt2& model, AdamW* optimizer);
// The same into flat buffers laid out as `layout` says (allocated by the caller; the moments
// are loaded when into.exp_avg is defined). The optimizer step count is in the result.
// With `all_tensors` false, the layout may hold a part of the checkpoint's parameters (a
// pipeline stage); otherwise the checkpoint must hold exactly the layout's parameters.
TrainingState load_checkpoint(const std::string& checkpoint_dir, const ParameterStore& layout,
                              FlatModelState& into, bool all_tensors = true);

}  // namespace loom
