// Documents within a training sequence (document masking, data.document_mask; docs/data.md).
//
// Corpora are documents joined by an end-of-text token (GPT-2's <|endoftext|>, 50256 in llm.c's
// shards), and a sequence of T tokens cut from them spans several. With document masking a
// token attends only to the earlier tokens of its own document (block-causal attention: Llama 3's
// pretraining, Megatron-LM's --reset-attention-mask, torchtitan's block_causal mask). A document
// ends with its end-of-text token, as Megatron-LM and torchtitan count it: the token after one
// starts the next document. Positions are not reset unless data.reset_position_ids is on (Megatron-
// LM's --reset-position-ids; nn/embedding.h): by default a document's first token keeps its place
// in the sequence, as torchtitan.
//
// With data.eod_mask_loss (Megatron-LM's --eod-mask-loss) the position whose input is the
// end-of-text token predicts nothing: its target (the next document's first token, which the
// previous document cannot tell) is kIgnoredTarget, and the loss is the mean over the targets
// that count (docs/data.md).
#pragma once

#include <cstdint>

namespace loom {

// starts (B, T): for each position of each sequence of `tokens` (B, T), the position its document
// begins at — 0, or one past the last `eot` token before it. Never decreasing along a sequence:
// what cpu::DocumentStarts takes.
void document_starts(int32_t* starts, const int32_t* tokens, int64_t B, int64_t T, int32_t eot);

// targets[i] = kIgnoredTarget (kernels/targets.h) wherever inputs[i] is `eot`, over n positions;
// returns how many targets still count (counted_targets: a loss mask's too are left out).
int64_t mask_targets_after_eot(int32_t* targets, const int32_t* inputs, int64_t n, int32_t eot);
// How many of n targets count: those that are not kIgnoredTarget.
int64_t counted_targets(const int32_t* targets, int64_t n);

}  // namespace loom
