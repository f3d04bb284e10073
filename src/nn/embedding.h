// GPT-2's input embedding: token embedding (V × C) plus learned position embedding (maxT × C);
// Llama's (max_seq = 0): the token embedding only, positions entering by rotation in attention.
#pragma once

#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

// The rows of a position table the micro-batch's (B, Tl) tokens read when positions restart at
// each document (ctx.reset_position_ids, with ctx.documents): (B, Tl) int32 on ctx.device, the
// token at position g of its sequence reading row g − its document's start (ops::document_
// positions), at this rank's positions g under context parallelism (ctx.sequence). Undefined
// where positions are not reset: position t reads row t. The whole sequence must fit the table's
// `table_rows` (the error names both).
Tensor document_position_ids(Context& ctx, int64_t B, int64_t Tl, int64_t table_rows);

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
  void clear_cache() { tokens_ = Tensor(), position_ids_ = Tensor(); }
  void collect_cache(std::vector<Tensor*>& out) {
    out.push_back(&tokens_);
    out.push_back(&position_ids_);
  }

  Parameter* wte() const { return wte_; }
  Parameter* wpe() const { return wpe_; }  // null without positions

 private:
  // tokens (B, T) → wte rows + `positions` (T, C) rows; undefined positions: none.
  Tensor lookup(Context& ctx, const Tensor& tokens, const Tensor& positions);
  int64_t vocab_, max_seq_, channels_;
  Parameter* wte_;
  Parameter* wpe_ = nullptr;
  Tensor tokens_;
  Tensor position_ids_;  // with reset positions: document_position_ids' of the forward
};

}  // namespace loom
