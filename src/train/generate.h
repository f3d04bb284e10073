// Autoregressive sampling from a trained model: temperature, top-k and top-p (nucleus), one token
// at a time, until a number of tokens or a stop token.
#pragma once

#include <cstdint>
#include <vector>

#include "models/gpt2.h"
#include "tensor/rng.h"

namespace loom {

struct SampleOptions {
  int64_t tokens = 100;       // tokens to generate
  double temperature = 1.0;   // 0 = greedy (argmax)
  int64_t top_k = 0;          // 0 = whole vocabulary
  // Nucleus sampling (Holtzman et al.; HF's top_p): of the top-k, the fewest most likely tokens
  // whose probabilities reach top_p of their sum; 1 = all of them. In (0, 1].
  double top_p = 1.0;
  // Generation ends after this token (a fine-tuned model's end-of-text; it is kept in the
  // output), or after `tokens`; -1: none.
  int64_t stop_token = -1;
  // Draw only ids below this (a tokenizer's vocabulary in a model padded past it — GPT-2's
  // 50257 in 50304 —: the padding rows are never drawn, as llm.c samples); 0: every id.
  int64_t vocab = 0;
  // Decode through a key/value cache (Gpt2::decode): each new token costs one token's forward
  // while the context fits max_seq_len; past it the window slides and the context is run again
  // each step, as without the cache. false: run the whole context every step (for comparisons).
  bool kv_cache = true;
};

// Returns prompt + generated tokens. The context is the last max_seq_len tokens.
std::vector<int32_t> generate(Context& ctx, Gpt2& model, std::vector<int32_t> prompt,
                              const SampleOptions& options, RandomStream& rng);

}  // namespace loom
