#include "train/evaluate.h"

#include "data/loader.h"

namespace loom {

double evaluate(Context& ctx,
                const std::function<double(Context&, const Tensor&, const Tensor&)>& forward,
                const std::function<void()>& clear, const std::vector<std::string>& shards,
                int64_t batch, int64_t seq_len, int64_t batches, Communicator* split) {
  DataLoader loader(shards, batch, seq_len);
  Tensor inputs = Tensor::empty({batch, seq_len}, DType::kI32);
  Tensor targets = Tensor::empty({batch, seq_len}, DType::kI32);
  const int parts = split != nullptr ? split->size() : 1;
  const int part = split != nullptr ? split->rank() : 0;
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    loader.next_batch(inputs.data<int32_t>(), targets.data<int32_t>());
    if (i % parts != part) continue;
    total += forward(ctx, inputs, targets);
    clear();
  }
  if (parts > 1) {
    Tensor sum = Tensor::empty({1}, DType::kF64);
    sum.data<double>()[0] = total;
    split->all_reduce(sum, ReduceOp::kSum);
    total = sum.data<double>()[0];
  }
  return total / static_cast<double>(batches);
}

}  // namespace loom
