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

// Positions reset at each document (data.reset_position_ids, Megatron-LM's --reset-position-ids):
// ids (B, Tl)[b, i] = g − starts[b, g], g = global[i] (null global: g = i) — the place of the
// sequence's position g in its document, the row of the position table its token reads. starts
// (B, T) as data/documents.h's document_starts; global (Tl): the positions of the whole sequence
// (of length T) a context-parallel shard holds, in its order.
void document_positions(ThreadPool& pool, int32_t* ids, const int32_t* starts,
                        const int32_t* global, int64_t B, int64_t Tl, int64_t T);

// A sliding window of W positions in a (B, T) table of each query's first visible position
// (nn/sliding_window.h): out[b, t] = max(starts[b, t], t − W + 1) — starts null: 0 (the window
// alone). out may be starts.
void window_starts(ThreadPool& pool, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window);

// out (N, C)[i] += table (rows, C)[ids[i]]: the position rows of tokens whose positions are ids.
// Its adjoint is embedding_backward(dtable, nullptr, dout, ids, 1, N, C) — ids taken as tokens.
template <typename Real>
void add_rows_by_id(ThreadPool& pool, Real* out, const Real* table, const int32_t* ids, int64_t N,
                    int64_t C);

}  // namespace loom::cpu
