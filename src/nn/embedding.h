// GPT-2's input embedding: token embedding (V × C) plus learned position embedding (maxT × C);
// Llama's (max_seq = 0): the token embedding only, positions entering by rotation in attention.
#pragma once

#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

class Embedding {
 public:
  Embedding(ParameterStore& store, int64_t vocab, int64_t max_seq, int64_t channels,
            float init_std);
  // tokens: (B, T) i32 -> (B, T, C). Tokens outside [0, vocab) are an error naming them.
  Tensor forward(Context& ctx, const Tensor& tokens);
  // forward of tokens at positions first .. first+T−1 (incremental decoding); caches nothing.
  Tensor forward_at(Context& ctx, const Tensor& tokens, int64_t first);
  // Accumulates into wte/wpe gradients. `tokens` as given to forward.
  void backward(Context& ctx, const Tensor& dy);
  void clear_cache() { tokens_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) { out.push_back(&tokens_); }

  Parameter* wte() const { return wte_; }
  Parameter* wpe() const { return wpe_; }  // null without positions

 private:
  // tokens (B, T) → wte rows + `positions` (T, C) rows; undefined positions: none.
  Tensor lookup(Context& ctx, const Tensor& tokens, const Tensor& positions);
  int64_t vocab_, max_seq_, channels_;
  Parameter* wte_;
  Parameter* wpe_ = nullptr;
  Tensor tokens_;
};

}  // namespace loom
