#include "train/pipeline_io.h"

#include "data/loader.h"

namespace loom {

double evaluate_pipeline(PipelineParallel& pipe, const std::vector<std::string>& shards,
                         int64_t batch, int64_t seq_len, int64_t batches, Device device) {
  DataLoader loader(shards, batch, seq_len);
  Tensor inputs = Tensor::empty({batch, seq_len}, DType::kI32, device);
  Tensor targets = Tensor::empty({batch, seq_len}, DType::kI32, device);
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    loader.next_batch(inputs.data<int32_t>(), targets.data<int32_t>());
    total += pipe.evaluate(inputs, targets);
  }
  return total / static_cast<double>(batches);
}

}  // namespace loom
