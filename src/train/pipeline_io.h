// Evaluation through the pipeline stages (checkpoints of any layout: train/sharded_io.h).
#pragma once

#include <string>
#include <vector>

#include "parallel/pipeline_parallel.h"

namespace loom {

// Mean validation loss over `batches` micro-batches read from the start of the split, on every
// rank of the pipeline.
double evaluate_pipeline(PipelineParallel& pipe, const std::vector<std::string>& shards,
                         int64_t batch, int64_t seq_len, int64_t batches, Device device);

}  // namespace loom
