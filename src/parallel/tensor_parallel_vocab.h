// The vocabulary split over a tensor-parallel group (issue 5): the token embedding and the tied
// LM head hold rank r's slice of the vocabulary rows, and the cross-entropy is computed without
// ever making the full logits on one rank — each rank makes its (N, V/P) slice of them, and the
// row max, the sum of exponentials and the target's logit are all-reduced (three (N) vectors).
//
// Padding: a vocabulary that does not divide over P is padded to the next multiple (V = 257,
// P = 2: 129 rows each, the last row of rank 1 is padding). Padding rows are zeros, their logits
// are excluded from the softmax (they can never win it) and their gradients stay zero, so the
// loss is the unpadded model's — the checks below compare against it.
//
// Embedding: each rank looks up the tokens in its slice (zeros elsewhere), rank 0 adds the
// position embedding (replicated; Llama has none), and an all-reduce (sequence parallelism: a reduce-scatter
// into this rank's rows) completes the sum.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/cpu/vocab_shard.h"
#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

class VocabParallelEmbedding {
 public:
  // max_seq: rows of the position table (0: none, Llama). lookup = false: the head only (a last
  // pipeline stage's copy of the tied wte; no wpe).
  VocabParallelEmbedding(ParameterStore& store, int64_t vocab, int64_t max_seq, int64_t channels,
                         float init_std, Communicator& tp, bool sequence_parallel,
                         bool lookup = true, const std::string& weight_name = "wte.weight");
  // tokens (B, T) i32 → (B·T, C), or this rank's (B·T/P, C) rows with sequence parallelism.
  // Tokens outside [0, vocab) are an error naming them.
  Tensor forward(Context& ctx, const Tensor& tokens);
  // dy shaped like forward's output; accumulates the wte slice's and wpe's gradients.
  void backward(Context& ctx, const Tensor& dy);
  // The tied LM head: mean cross-entropy of next-token prediction. final: (B·T, C) on every
  // rank (gathered by the caller under sequence parallelism); targets (B·T) i32. Keeps what
  // head_backward needs.
  // The mean loss into ctx.losses where a training step set it, else into *loss
  // (nn/step_losses.h).
  void head_forward(Context& ctx, const Tensor& final, const Tensor& targets, double* loss);
  // The gradient of scale × the loss: accumulates into wte's slice and returns this rank's part
  // of d final summed over the group — (B·T, C), or its rows with sequence parallelism.
  Tensor head_backward(Context& ctx, double scale);
  void clear_cache();
  void collect_cache(std::vector<Tensor*>& out);

  int64_t local_vocab() const { return local_vocab_; }  // rows per rank, padding included
  int64_t real_rows() const { return real_rows_; }      // of which real vocabulary rows
  VocabShard shard() const { return {first_row_, real_rows_, local_vocab_, vocab_}; }
  Parameter* wte() const { return wte_; }
  Parameter* wpe() const { return wpe_; }  // null for a head only, and without positions

 private:
  int64_t vocab_, channels_, local_vocab_, first_row_, real_rows_;
  Communicator& tp_;
  bool sequence_parallel_;
  bool lookup_;
  Parameter* wte_;
  Parameter* wpe_ = nullptr;
  Tensor tokens_;                               // embedding
  Tensor position_ids_;  // embedding with positions reset at each document (nn/embedding.h)
  Tensor final_, logits_, max_, sum_, targets_;  // head: logits become their gradient
};

}  // namespace loom
