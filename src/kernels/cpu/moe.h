// A mixture of experts' routing and token movement (nn/moe_mlp.h), in a fixed order: each token's
// work is its own, and a token's contributions are added expert by expert, so every thread count
// gives the same bits (and the GPU kernels, kernels/cuda/moe.cu, the same formulas).
//
// Legend: N tokens (B sequences of T), E experts, K chosen per token, C channels. choice and
// weight are (N, K): token t's j-th expert and its weight at t·K + j. An expert's n rows are the
// tokens routed to it (rows[i]) and where in their choice it stands (slots[i]).
#pragma once

#include <cstdint>

#include "base/thread_pool.h"
#include "kernels/moe_routing.h"

namespace loom::cpu {

// probs (N, E) = the router's scores per token: softmax(logits) (exp and sum in double), or with
// routing.sigmoid each logit's sigmoid on its own (DeepSeek-V3's affinities); choice (N, K) the K
// largest scores' experts, best first, equal ones to the lower index; weight (N, K) their scores
// over their sum (Mixtral's renormalisation; DeepSeek-V3's normalisation; not with
// routing.normalize false), times routing.scale;
// lse (N) log Σ exp logits (the router z-loss's). With routing.bias (E) the K are chosen by
// p_e + bias[e] (in double) instead — DeepSeek-V3's balancing biases, which steer the choice
// only: the weights stay the chosen scores normalised. With routing.groups > 1 only the experts
// of the token's best routing.group_topk groups are candidates, a group scored by the sum of its
// best K / group_topk choice scores (in descending order; equal groups to the lower index).
template <typename Real>
void moe_route(ThreadPool& pool, Real* probs, int32_t* choice, Real* weight, Real* lse,
               const Real* logits, int64_t N, int64_t E, int64_t K, const MoeRouting& routing);

// sums (B, E): Σ over each sequence's T tokens, in order, of its probabilities (in double) — with
// `sigmoid` scores, of each token's scores over their sum (DeepSeek-V3's balance loss's
// normalised affinities).
template <typename Real>
void moe_prob_sums(ThreadPool& pool, double* sums, const Real* probs, int64_t B, int64_t T,
                   int64_t E, bool sigmoid);

// out (n rows) = in's rows `rows`, each row_bytes bytes (a multiple of 2).
void gather_rows(ThreadPool& pool, void* out, const void* in, const int32_t* rows, int64_t n,
                 int64_t row_bytes);

// y[rows[i]] += w_i · src[i] (C each), w_i = weight[rows[i]·K + slots[i]], or 1 when weight is
// null. rows distinct (one expert's).
template <typename Real>
void moe_scatter_add(ThreadPool& pool, Real* y, const Real* src, const int32_t* rows,
                     const int32_t* slots, const Real* weight, int64_t n, int64_t C, int64_t K);

// One expert's output gradient from its gathered dy rows g (n, C): dweight[rows[i]·K + slots[i]]
// = g[i] · out[i] (the loss's gradient at the routing weight, summed in double), then g[i] *= w_i
// (what the expert's own backward takes).
template <typename Real>
void moe_expert_output_grad(ThreadPool& pool, Real* g, Real* dweight, const Real* out,
                            const int32_t* rows, const int32_t* slots, const Real* weight,
                            int64_t n, int64_t C, int64_t K);

// The router logits' gradient dlogits (N, E): through the renormalisation w_j = p_j / S (S the
// chosen probabilities' sum) dp_j = (dweight_j − Σ_i w_i·dweight_i) / S for the chosen, plus the
// balance loss's balance[b·E + e] for every expert of sequence b's tokens, then through the
// softmax, dl = p ⊙ (dp − p·dp); plus the router z-loss's z · 2·lse·p (z: its coefficient times
// the loss's scale over the tokens; 0 without, lse then unread). With `sigmoid` scores the
// balance term reaches p through the normalisation p / Σ_e p_e, and dl = dp ⊙ p ⊙ (1 − p) (no
// z-loss: z must be 0). With weights scaled (w_j = scale · p_j / S) dp_j = (scale·dweight_j −
// Σ_i w_i·dweight_i) / S; without the normalisation (`normalize` false: w_j = scale · p_j)
// dp_j = scale·dweight_j. In double.
template <typename Real>
void moe_router_backward(ThreadPool& pool, Real* dlogits, const Real* probs, const int32_t* choice,
                         const Real* weight, const Real* dweight, const double* balance,
                         const Real* lse, double z, int64_t B, int64_t T, int64_t E, int64_t K,
                         bool sigmoid, double scale, bool normalize);

}  // namespace loom::cpu
