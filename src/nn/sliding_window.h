// Sliding-window attention (Mistral 7B v0.1's, model.sliding_window): a query at position p sees
// the W keys at positions p − W < j ≤ p, and none before (transformers' sliding_window since
// 4.51, Megatron-LM's --window-size W−1,0). Every attention kernel already takes, per query, the
// first position it sees (cpu::DocumentStarts, for document masking): a window is that table
// with each row's first position raised to p − W + 1 — non-decreasing along the sequence as the
// kernels need — so the CPU's, the GPU's flash and batched kernels, context parallelism's rows
// and ring blocks and every layout apply it unchanged, and the flash kernels skip the tiles
// before it (O(T·W) work). Each windowed attention makes its table itself (ops::window_starts):
// the window's alone once per shape, or with document masking from the micro-batch's document
// starts each forward — so a model may window some blocks and not others
// (model.full_attention_every). Decoding with a cache reads the window's keys only
// (cpu::attention_with_cache).
#pragma once

#include <cstdint>

#include "nn/context.h"

namespace loom {

// The window's table alone, (B, T) int32 on ctx's device — T the whole sequence under context
// parallelism, whose kernels index it by position — in `cached` (kept while its shape holds).
const Tensor& sliding_window_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T,
                                    int64_t window);

// What an attention with a `window` (0: none) masks with: ctx.documents, raised to the window (a
// fresh table); without documents the window's table (in `cached`); neither: nothing (causal).
// T: the attention's local length.
Tensor attention_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T, int64_t window);

}  // namespace loom
