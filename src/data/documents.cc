#include "data/documents.h"

#include "kernels/targets.h"

namespace loom {

void document_starts(int32_t* starts, const int32_t* tokens, int64_t B, int64_t T, int32_t eot) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      starts[b * T + t] = start;
      if (tokens[b * T + t] == eot) start = static_cast<int32_t>(t + 1);
    }
  }
}

int64_t mask_targets_after_eot(int32_t* targets, const int32_t* inputs, int64_t n, int32_t eot) {
  for (int64_t i = 0; i < n; ++i)
    if (inputs[i] == eot) targets[i] = kIgnoredTarget;
  return counted_targets(targets, n);
}

int64_t counted_targets(const int32_t* targets, int64_t n) {
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) counted += targets[i] != kIgnoredTarget ? 1 : 0;
  return counted;
}

}  // namespace loom
