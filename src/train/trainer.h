// The single-device training loop: data -> forward -> backward (accumulated over micro-batches)
// -> global-norm clip -> AdamW with warm-up + cosine LR -> metrics, evaluation, checkpoints.
//
// Determinism: the run is a pure function of the config. Initial weights come from the
// counter-based RNG, the loader position is saved in checkpoints and every kernel is
// deterministic, so a resumed run continues bit for bit as if never stopped.
#pragma once

#include <cstdint>
#include <string>

#include "config/config.h"

namespace loom {

struct TrainOptions {
  std::string run_dir;      // metrics.jsonl, config.toml and checkpoints/ go here
  std::string resume;       // "" (fresh), "auto" (latest checkpoint, if any) or a step_N dir
  int64_t stop_after = 0;   // > 0: end cleanly after this step with a checkpoint
  bool progress = true;     // print the progress line
};

struct TrainSummary {
  int64_t start_step = 0;   // steps already done when this run began (resume)
  int64_t last_step = 0;    // steps done when it ended
  double last_loss = 0;
  double first_loss = 0;    // loss of the first step this run took
  double last_val_loss = -1;
  double tokens_per_s = 0;  // mean over the steps this run took
  int64_t peak_bytes = 0;   // allocator peak on the training device
  std::string last_checkpoint;
};

TrainSummary run_training(const Config& config, const TrainOptions& options);

// The model shape a config describes.
struct Gpt2Config;
Gpt2Config model_config_of(const Config& config);

}  // namespace loom
