// The kernels of a vocabulary-parallel embedding and LM head (parallel/tensor_parallel_vocab.h):
// one rank holds vocabulary rows [first_row, first_row + real_rows) as the first real_rows of its
// `rows` local rows (the rest is padding, up to the per-rank size), and the rank's partial
// results are summed (or maxed) over the tp group by the caller. f32 only.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom {

struct VocabShard {
  int64_t first_row = 0;  // global id of local row 0
  int64_t real_rows = 0;  // local rows that are vocabulary rows
  int64_t rows = 0;       // local rows, padding included (the logits' row stride)
  int64_t vocab = 0;      // the whole vocabulary: tokens outside [0, vocab) are refused
};

}  // namespace loom

namespace loom::cpu {

// out (N, C) = wte[token - first_row] for tokens of the shard, zero rows for the others, plus
// wpe[i mod T] when add_positions (on one rank of the group) and wpe is not null (null: a model
// without a position table). Overwrites out. A token outside [0, vocab) throws loom::Error naming
// it and its position, before anything is written.
void vocab_shard_embedding_forward(ThreadPool& pool, float* out, const int32_t* tokens,
                                   const float* wte, const float* wpe, int64_t N, int64_t T,
                                   int64_t C, const VocabShard& shard, bool add_positions);

// dwte (rows, C) and dwpe (T, C) accumulate dout (N, C): dwte only for the shard's tokens, dwpe
// always (every rank holds the whole position table) unless it is null (no position table). Rows
// are summed in position order.
void vocab_shard_embedding_backward(ThreadPool& pool, float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int64_t N, int64_t T, int64_t C,
                                    const VocabShard& shard);

// Per row of logits (N, rows): max (N) over the real columns, and target_logit (N) = the target's
// logit where this shard holds the target (left as it is elsewhere: the caller zeroes it).
void vocab_shard_logit_max(ThreadPool& pool, float* max, float* target_logit, const float* logits,
                           const int32_t* targets, int64_t N, const VocabShard& shard);

// sum (N) = Σ over the real columns of exp(logit - max), accumulated in double.
void vocab_shard_sum_exp(ThreadPool& pool, float* sum, const float* logits, const float* max,
                         int64_t N, const VocabShard& shard);

// *result = Σ_i log(sum[i]) + max[i] − target_logit[i] over the N rows (their losses, the
// group's sum, max and target logit) but those whose target is kIgnoredTarget
// (kernels/targets.h), in double, in row order: N times the mean loss.
void vocab_shard_loss_sum(ThreadPool& pool, double* result, const float* sum, const float* max,
                          const float* target_logit, const int32_t* targets, int64_t N);

// In place: logits (N, rows) become (softmax - onehot(target)) · k, softmax = exp(l - max) / sum
// with the group's max and sum; padding columns zero; a row whose target is kIgnoredTarget zero.
// With z_loss > 0 the softmax term is softmax · (1 + 2 · z_loss · lse), lse = max + log(sum)
// (cpu::cross_entropy_backward's auxiliary z-loss).
void vocab_shard_cross_entropy_backward(ThreadPool& pool, float* logits, const float* max,
                                        const float* sum, const int32_t* targets, float k,
                                        int64_t N, const VocabShard& shard, float z_loss = 0);

}  // namespace loom::cpu
