// The pipeline-parallel parts of the training loop that touch data and files: evaluation
// through the stages and whole-model checkpoints assembled from them.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "parallel/pipeline_parallel.h"

namespace loom {

// Mean validation loss over `batches` micro-batches read from the start of the split, on every
// rank of the pipeline.
double evaluate_pipeline(PipelineParallel& pipe, const std::vector<std::string>& shards,
                         int64_t batch, int64_t seq_len, int64_t batches, Device device);

// A whole-model checkpoint from pipeline chunks: each chunk's state is gathered over dp, the
// pipeline ranks of dp replica 0 send theirs to pipeline rank 0, which writes the same format
// as one device (so a run resumes under any layout). Collective over the world; returns the
// checkpoint's path on the rank that wrote it, "" elsewhere.
std::string save_pipeline_checkpoint(const std::string& dir, PipelineParallel& pipe,
                                     DeviceMesh& mesh, const Config& config,
                                     const TrainingState& st);

}  // namespace loom
