// Whole-model checkpoints from tensor-parallel shards, and back (issue 5): the format stays the
// one-device format (every parameter whole, by name), so a run resumes under any layout.
#pragma once

#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "parallel/data_parallel.h"
#include "parallel/tensor_parallel_gpt2.h"

namespace loom {

// Collective over the world: each rank gathers its shard's state over dp, writes its pieces into
// a whole-model buffer (replicated parameters from tp rank 0 only), a sum-reduce over tp
// assembles the whole model on tp rank 0, and the rank at dp = tp = 0 writes it. Returns the
// path there, "" elsewhere.
std::string save_tensor_parallel_checkpoint(const std::string& dir, TpGpt2& model,
                                            DataParallel& engine, DeviceMesh& mesh,
                                            const Config& config, const TrainingState& st);

// Reads a whole-model checkpoint and gives `engine` this rank's pieces (padding rows zero).
TrainingState load_tensor_parallel_checkpoint(const std::string& checkpoint_dir, TpGpt2& model,
                                              DataParallel& engine, const Config& config);

}  // namespace loom
