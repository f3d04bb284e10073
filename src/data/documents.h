// Documents within a training sequence (document masking, data.document_mask; docs/data.md).
//
// Corpora are documents joined by an end-of-text token (GPT-2's <|endoftext|>, 50256 in llm.c's
// shards), and a sequence of T tokens cut from them spans several. With document masking a
// token attends only to the earlier tokens of its own document (block-causal attention: Llama 3's
// pretraining, Megatron-LM's --reset-attention-mask, torchtitan's block_causal mask). A document
// ends with its end-of-text token, as Megatron-LM and torchtitan count it: the token after one
// starts the next document. Positions are not reset: a document's first token keeps its place in
// the sequence (as torchtitan; Megatron-LM's --reset-position-ids is not offered).
#pragma once

#include <cstdint>

namespace loom {

// starts (B, T): for each position of each sequence of `tokens` (B, T), the position its document
// begins at — 0, or one past the last `eot` token before it. Never decreasing along a sequence:
// what cpu::DocumentStarts takes.
void document_starts(int32_t* starts, const int32_t* tokens, int64_t B, int64_t T, int32_t eot);

}  // namespace loom
