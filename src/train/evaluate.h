// The validation loss of a training run: the mean loss over `batches` validation micro-batches
// of `batch` sequences, read from the start of the split every time so evaluations are
// comparable across steps, resumed runs and layouts (with the same micro-batch size).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "device/device.h"
#include "tensor/tensor.h"

namespace loom {

// `loss` runs one micro-batch forward (a model, or a whole pipeline) and returns its mean loss,
// keeping nothing for backward. With `split` (a data-parallel group), rank r runs the
// micro-batches i with i mod size = r and the sums are all-reduced (f64), so a dp-way run spends
// 1/dp of one device's evaluation time (every rank returns the same value); without, this rank
// runs them all. Tokens are read on the host and handed to `loss` on `device` (a GPU gets a copy,
// queued behind its work: no wait per batch). With `vocab_size` > 0 the loader checks every
// token id against it, naming the shard (DataLoader::set_vocab_size), so `loss` may tell the
// kernels to skip their own checks (Exec::ids_checked), each a wait on a GPU.
// With `queued_sum`, `loss` may instead queue its micro-batch's mean where it is computed (a
// model's head into a StepLosses, nn/step_losses.h) and return 0: queued_sum() gives the sum of
// those means after the last micro-batch — on a GPU one wait for the evaluation, not one a batch.
// With `masked_eot` >= 0 (data.eod_mask_loss) the targets after that token are kIgnoredTarget
// (data/documents.h: the heads' means count them 0) and the result is the mean over the targets
// left, counted on every rank, which reads every batch. With `loss_masks` (data.loss_mask) the
// shards' loss masks leave targets out likewise (DataLoader::use_loss_masks).
double evaluate(const std::function<double(const Tensor& inputs, const Tensor& targets)>& loss,
                const std::vector<std::string>& shards, int64_t batch, int64_t seq_len,
                int64_t batches, Device device, Communicator* split, int64_t vocab_size = 0,
                const std::function<double()>& queued_sum = nullptr, int32_t masked_eot = -1,
                bool loss_masks = false);

}  // namespace loom
