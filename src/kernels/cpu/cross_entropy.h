// Softmax fused with cross-entropy: the probabilities are never stored, only each row's
// log-sum-exp, from which the backward recomputes them.
//
// Legend: N = rows (B*T), V = vocabulary size.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// losses (N)[i] = lse[i] - logits[i, targets[i]], lse (N)[i] = log Σ_v exp(logits[i, v]);
// logits (N, V). A row whose target is kIgnoredTarget (kernels/targets.h) has loss 0 (its lse is
// written). Any other target outside [0, V) throws loom::Error naming it and its row, before
// anything is written.
template <typename Real>
void cross_entropy_forward(ThreadPool& pool, Real* losses, Real* lse, const Real* logits,
                           const int32_t* targets, int64_t N, int64_t V);

// dlogits (N, V) = (softmax(logits) - onehot(targets)) · dloss, overwritten; it may alias
// logits, which saves the largest activation of a language model. dloss is the gradient of
// every row's loss (1/N for a mean over rows). An ignored row's gradient is zero.
// With z_loss > 0 each row's loss also has PaLM's auxiliary z_loss · lse² (train.z_loss), which
// pulls log Σ exp toward 0: the softmax term becomes softmax · (1 + 2 · z_loss · lse).
template <typename Real>
void cross_entropy_backward(ThreadPool& pool, Real* dlogits, const Real* logits, const Real* lse,
                            const int32_t* targets, Real dloss, int64_t N, int64_t V,
                            float z_loss = 0);

// A language model's head after its loss: cross_entropy_backward in place over logits (N, V),
// then matmul_backward without a bias through the head's weight (V, C) and input (N, C): dinp
// (N, C) overwritten when non-null, dweight accumulated. One op so a GPU can hand the gradient
// to its GEMMs in their operand precision (cuda::lm_head_backward); afterwards `logits` holds
// no defined values.
template <typename Real>
void lm_head_backward(ThreadPool& pool, Real* dinp, Real* dweight, Real* logits, const Real* lse,
                      const int32_t* targets, Real dloss, const Real* inp, const Real* weight,
                      int64_t N, int64_t C, int64_t V, float z_loss = 0);

// *result = Σ lse_i² over the rows whose target is not kIgnoredTarget, in double, in row order:
// N times the mean z-loss term (train.z_loss's, before its coefficient). lse_i = lse[i], or with
// `sum`, the vocabulary-parallel head's lse[i] + log(sum[i]) (lse then holding each row's max).
void lse_square_sum(ThreadPool& pool, double* result, const float* lse, const float* sum,
                    const int32_t* targets, int64_t N);

}  // namespace loom::cpu
