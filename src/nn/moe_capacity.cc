#include "nn/moe_capacity.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "base/error.h"

namespace loom {
namespace {

// Weights are ranked to 1/1024: identical tokens (a repeated token early in a sequence reads the
// same context) have identical weights on one device, but a layout's GEMMs may round them a unit
// in the last place apart — which would decide which of them is dropped. On the grid they tie,
// and the tie goes to the earlier token everywhere.
int64_t weight_rank(float weight) {
  return std::llround(static_cast<double>(weight) * 1024.0);
}

}  // namespace

TokenDropPolicy parse_token_drop_policy(const std::string& name, const std::string& key) {
  if (name == "probs") return TokenDropPolicy::kProbs;
  if (name == "position") return TokenDropPolicy::kPosition;
  fail(key, " = \"", name, "\": expected \"probs\" or \"position\"");
}

const char* token_drop_policy_name(TokenDropPolicy policy) {
  return policy == TokenDropPolicy::kProbs ? "probs" : "position";
}

int64_t MoeCapacity::per_sequence(int64_t length, int64_t top_k, int64_t experts) const {
  LOOM_CHECK(experts > 0);
  return static_cast<int64_t>(std::ceil(factor * static_cast<double>(length * top_k) /
                                        static_cast<double>(experts)));
}

int64_t keep_within_capacity(std::span<const int32_t> choice, std::span<const float> score,
                             int64_t length, int64_t top_k, int64_t experts,
                             const MoeCapacity& capacity, std::span<uint8_t> keep) {
  LOOM_CHECK(keep.size() == choice.size() && length > 0 && top_k > 0);
  const bool by_score = capacity.policy == TokenDropPolicy::kProbs;
  LOOM_CHECK(!by_score || score.size() == choice.size());
  std::fill(keep.begin(), keep.end(), uint8_t{1});
  if (capacity.dropless()) return 0;
  const int64_t cap = capacity.per_sequence(length, top_k, experts);
  const int64_t per_sequence = length * top_k;
  LOOM_CHECK(static_cast<int64_t>(choice.size()) % per_sequence == 0);
  // Each sequence's pairs bucketed by expert, in token order (a token's experts are distinct,
  // so an expert's pairs are distinct tokens).
  std::vector<int64_t> first(static_cast<size_t>(experts + 1));
  std::vector<int64_t> next(static_cast<size_t>(experts));
  std::vector<int32_t> pairs(static_cast<size_t>(per_sequence));
  int64_t dropped = 0;
  for (int64_t start = 0; start < static_cast<int64_t>(choice.size()); start += per_sequence) {
    std::fill(first.begin(), first.end(), 0);
    for (int64_t i = 0; i < per_sequence; ++i) {
      const int32_t e = choice[static_cast<size_t>(start + i)];
      LOOM_CHECK(e >= 0 && e < experts);
      ++first[static_cast<size_t>(e) + 1];
    }
    for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
    std::copy(first.begin(), first.end() - 1, next.begin());
    for (int64_t i = 0; i < per_sequence; ++i)
      pairs[static_cast<size_t>(next[choice[static_cast<size_t>(start + i)]]++)] =
          static_cast<int32_t>(start + i);
    for (int64_t e = 0; e < experts; ++e) {
      const auto begin = pairs.begin() + first[e], end = pairs.begin() + first[e + 1];
      if (end - begin <= cap) continue;
      if (by_score)  // highest weight first, the earlier token on a tie
        std::stable_sort(begin, end, [&](int32_t a, int32_t b) {
          return weight_rank(score[static_cast<size_t>(a)]) >
                 weight_rank(score[static_cast<size_t>(b)]);
        });
      for (auto it = begin + cap; it != end; ++it) keep[static_cast<size_t>(*it)] = 0;
      dropped += (end - begin) - cap;
    }
  }
  return dropped;
}

}  // namespace loom
