// Whole-model checkpoints from a layout's parts, and back: whatever the layout (pipeline stages,
// tensor-parallel shards, both, each under data parallelism / ZeRO), the checkpoint is the
// one-device format (every parameter whole, by name), so a run resumes under any layout.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "parallel/data_parallel.h"

namespace loom {

class Gpt2Stage;

// Collective over the world. `parts[k]` is a model part this rank holds (its pipeline chunks,
// or its whole model — possibly a tensor-parallel shard) and `engines[k]` the engine owning its
// state. Each part's state is gathered over dp; at dp coordinate 0 every rank writes its pieces
// into a whole-model buffer (replicated parameters from tp rank 0 only, the tied wte from the
// first stage only), a sum-reduce over pp, then over tp, assembles the model on the rank at
// (dp, pp, tp) = (0, 0, 0), which writes it. Returns the path there, "" elsewhere.
// Memory: three whole-model f32 buffers on each rank of dp replica 0 while saving.
std::string save_sharded_checkpoint(const std::string& dir, const std::vector<Gpt2Stage*>& parts,
                                    const std::vector<DataParallel*>& engines, DeviceMesh& mesh,
                                    const Config& config, const TrainingState& st);

// Reads a whole-model checkpoint and gives each engine its part's pieces (padding zero).
TrainingState load_sharded_checkpoint(const std::string& checkpoint_dir,
                                      const std::vector<Gpt2Stage*>& parts,
                                      const std::vector<DataParallel*>& engines,
                                      const Config& config);

}  // namespace loom
