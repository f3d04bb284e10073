#include "train/evaluate.h"

#include "data/documents.h"
#include "data/loader.h"

namespace loom {

double evaluate(const std::function<double(const Tensor& inputs, const Tensor& targets)>& loss,
                const std::vector<std::string>& shards, int64_t batch, int64_t seq_len,
                int64_t batches, Device device, Communicator* split, int64_t vocab_size,
                const std::function<double()>& queued_sum, int32_t masked_eot, bool loss_masks) {
  DataLoader loader(shards, batch, seq_len);
  loader.set_vocab_size(vocab_size);
  if (loss_masks) loader.use_loss_masks();
  const bool targets_masked = masked_eot >= 0 || loss_masks;
  // Tokens are read on the host; a GPU gets a copy.
  const Device host = device.is_cpu() ? device : Device::cpu();
  Tensor host_inputs = Tensor::empty({batch, seq_len}, DType::kI32, host);
  Tensor host_targets = Tensor::empty({batch, seq_len}, DType::kI32, host);
  Tensor inputs = device.is_cpu() ? host_inputs : Tensor::empty({batch, seq_len}, DType::kI32, device);
  Tensor targets = device.is_cpu() ? host_targets : Tensor::empty({batch, seq_len}, DType::kI32, device);
  const int parts = split != nullptr ? split->size() : 1;
  const int part = split != nullptr ? split->rank() : 0;
  double total = 0;
  int64_t counted = 0;  // the targets that count
  for (int64_t i = 0; i < batches; ++i) {
    loader.next_batch(host_inputs.data<int32_t>(), host_targets.data<int32_t>());
    counted += masked_eot >= 0 ? mask_targets_after_eot(host_targets.data<int32_t>(),
                                                        host_inputs.data<int32_t>(),
                                                        batch * seq_len, masked_eot)
                               : counted_targets(host_targets.data<int32_t>(), batch * seq_len);
    if (i % parts != part) continue;
    if (!device.is_cpu()) {
      inputs.copy_from_host_queued(host_inputs);  // staged: the host buffers are free at once
      targets.copy_from_host_queued(host_targets);
    }
    total += loss(inputs, targets);
  }
  if (queued_sum) total += queued_sum();
  if (parts > 1) {
    total = all_reduce_value(*split, total, ReduceOp::kSum);
  }
  // Each batch's mean is over all its positions; the mean over the targets that count scales
  // their mean by positions / counted (none counted: no loss).
  const double mean = total / static_cast<double>(batches);
  if (!targets_masked) return mean;
  const double positions = static_cast<double>(batches * batch * seq_len);
  return counted == 0 ? 0.0 : mean * (positions / static_cast<double>(counted));
}

}  // namespace loom
