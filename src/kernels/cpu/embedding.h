// The input embedding: token embedding plus, for GPT-2, a learned position embedding (models whose
// positions enter elsewhere, Llama's rotary embedding, pass no position table).
//
// Legend: B = batch, T = sequence length, C = channels, V = vocabulary size,
// maxT = rows of the position table (T <= maxT is the caller's contract).
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// out (B, T, C)[b, t] = wte (V, C)[tokens[b, t]] + wpe (maxT, C)[t]; the token rows alone where
// wpe is null.
// A token outside [0, V) throws loom::Error naming the token, its position and V, before
// anything is written.
template <typename Real>
void embedding_forward(ThreadPool& pool, Real* out, const int32_t* tokens, const Real* wte,
                       const Real* wpe, int64_t B, int64_t T, int64_t C, int64_t V);

// dwte (V, C) and dwpe (maxT, C) are accumulated; dwpe null (no position table) is skipped.
// tokens must be those embedding_forward accepted. Each thread owns a slice of the channels for
// all tokens, so repeated tokens never race and every row is summed in (b, t) order whatever the
// pool size.
template <typename Real>
void embedding_backward(ThreadPool& pool, Real* dwte, Real* dwpe, const Real* dout,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C);

}  // namespace loom::cpu
