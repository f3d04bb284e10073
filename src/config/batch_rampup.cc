// train.batch_rampup: Megatron-LM's --rampup-batch-size, the global batch grown in steps from a
// smaller one over the run's first samples.
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "config/config.h"

namespace loom {

std::optional<BatchRampup> parse_batch_rampup(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  if (words.empty()) return std::nullopt;
  if (words.size() != 3)
    fail("train.batch_rampup = \"", text,
         "\": give three numbers, \"START INCREMENT SAMPLES\" (Megatron-LM's --rampup-batch-size)");
  int64_t v[3];
  for (int i = 0; i < 3; ++i) {
    size_t used = 0;
    try {
      v[i] = std::stoll(words[static_cast<size_t>(i)], &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != words[static_cast<size_t>(i)].size() || v[i] <= 0)
      fail("train.batch_rampup: '", words[static_cast<size_t>(i)],
           "' is not a positive whole number (",
           i == 0   ? "START, the first batch"
           : i == 1 ? "INCREMENT, the batch's growth"
                    : "SAMPLES, the ramp's length in sequences",
           ")");
  }
  return BatchRampup{v[0], v[1], v[2]};
}

int64_t TrainConfig::batch_size_at(int64_t consumed) const {
  const std::optional<BatchRampup> ramp = parse_batch_rampup(batch_rampup);
  if (!ramp || consumed >= ramp->samples) return batch_size;
  // Megatron-LM's rule: (batch_size - start) / increment equal increments over the ramp's
  // samples, each taking effect once its share of them has been consumed.
  const int64_t increments = (batch_size - ramp->start) / ramp->increment;
  if (increments <= 0) return batch_size;
  const double per_increment = static_cast<double>(ramp->samples) / static_cast<double>(increments);
  const auto done = static_cast<int64_t>(static_cast<double>(consumed) / per_increment);
  return std::min(batch_size, ramp->start + done * ramp->increment);
}

int64_t TrainConfig::samples_before(int64_t step) const {
  if (batch_rampup.empty()) return step * batch_size;
  int64_t consumed = 0;
  for (int64_t s = 0; s < step; ++s) {
    const int64_t b = batch_size_at(consumed);
    if (b == batch_size) return consumed + (step - s) * batch_size;  // the ramp is over
    consumed += b;
  }
  return consumed;
}

}  // namespace loom
