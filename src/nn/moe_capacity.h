// Expert capacity: how many of a sequence's tokens each expert of a mixture takes (GShard,
// Switch Transformer; Megatron-LM's --moe-expert-capacity-factor). A mixture that routes freely
// ("dropless", nn/moe_mlp.h) lets one expert receive every token of a batch; a capacity bounds
// each expert's rows — its GEMMs, its share of an expert-parallel all-to-all — and the pairs
// (token, chosen expert) beyond it are dropped: that expert's output is left out of the token's
// sum (the other chosen experts' weights stay as they were, as Megatron-LM's), and the residual
// carries the token on.
//
// The unit is the sequence, as the balance loss's (GShard's "groups"): each expert takes at most
//   capacity = ceil(factor · T · top_k / experts)
// of a T-token sequence's choices. Megatron-LM counts a rank's micro-batch instead, which makes
// what is dropped depend on the data-parallel degree, the micro-batch size and the expert-
// parallel group; per sequence it is the same under every layout, so every layout still trains
// as one device.
//
// Which pairs go when an expert is over capacity: "probs" (Megatron-LM's default) keeps the
// pairs of highest routing weight, "position" the sequence's earliest tokens (causal: a token's
// fate never depends on later ones). Weights are compared to 1/1024 — finer, and the last bits
// a layout's GEMMs round otherwise would decide between identical tokens — and ties go to the
// earlier token, so dropping is deterministic and the same under every layout.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom {

enum class TokenDropPolicy { kProbs, kPosition };

// "probs" | "position"; throws naming `key` otherwise.
TokenDropPolicy parse_token_drop_policy(const std::string& name, const std::string& key);
const char* token_drop_policy_name(TokenDropPolicy policy);

struct MoeCapacity {
  double factor = 0;  // 0: dropless
  TokenDropPolicy policy = TokenDropPolicy::kProbs;
  bool dropless() const { return factor <= 0; }
  // The most choices of one sequence of `length` tokens an expert takes.
  int64_t per_sequence(int64_t length, int64_t top_k, int64_t experts) const;
};

// For the choices of consecutive sequences of `length` tokens each — choice[t·top_k + j], token t's
// j-th expert, with its routing weight score[t·top_k + j] (read under kProbs only) — keep[i] = 1
// where expert choice[i] takes the pair, 0 where it is dropped. Returns the pairs dropped.
int64_t keep_within_capacity(std::span<const int32_t> choice, std::span<const float> score,
                             int64_t length, int64_t top_k, int64_t experts,
                             const MoeCapacity& capacity, std::span<uint8_t> keep);

}  // namespace loom
