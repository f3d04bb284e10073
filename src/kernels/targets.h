// The targets the cross-entropy kernels take: a vocabulary row, or kIgnoredTarget for a position
// that takes no part in the loss.
#pragma once

#include <cstdint>

namespace loom {

// A row whose target is kIgnoredTarget has loss 0 and a zero logit gradient; the caller divides
// by the rows that count (PyTorch's ignore_index, whose default is the same -100).
// data.eod_mask_loss sets it where a position's input is the end-of-text token.
inline constexpr int32_t kIgnoredTarget = -100;

// Whether the cross-entropy kernels take target t over a vocabulary of V rows.
inline constexpr bool is_valid_target(int64_t t, int64_t V) {
  return (t >= 0 && t < V) || t == kIgnoredTarget;
}

}  // namespace loom
