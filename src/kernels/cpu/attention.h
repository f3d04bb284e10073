// Causal multi-head self-attention on GPT-2's fused qkv, computed flash-attention style
// (Dao et al., "FlashAttention", 2022): query rows are processed in blocks and only each row's
// log-sum-exp is saved, so no (B, NH, T, T) tensor is ever stored; the backward recomputes the
// probabilities from it.
//
// Legend: B = batch, T = sequence length, C = channels, NH = heads, hd = C / NH (head size).
// qkv (B, T, 3C) holds q in columns [0, C), k in [C, 2C), v in [2C, 3C); head h uses columns
// h*hd .. h*hd + hd - 1 of each. Scores are scaled by 1/sqrt(hd).
#pragma once

#include <cstdint>
#include <span>

#include "base/thread_pool.h"

namespace loom::cpu {

// Query rows per block; the scratch per thread is two (block, T) matrices.
inline constexpr int64_t kAttentionRowBlock = 64;

// Document masking (block-causal attention, data.document_mask; docs/data.md): the query at
// position p of sequence b sees only the keys of its own document, the positions from
// start[b·stride + p] (its document's first) up to p. Every attention call below takes one;
// `start` null is plain causal attention (every position up to p). The starts of a sequence
// never decrease (data/documents.h writes them so); `stride` is the whole sequence's length,
// also under context parallelism, where the rows and keys are positions of it. On a GPU
// `start` is device memory.
struct DocumentStarts {
  const int32_t* start = nullptr;
  int64_t stride = 0;
  bool masked() const { return start != nullptr; }
  // The first position the query at position p of sequence b sees.
  int64_t first(int64_t b, int64_t p) const { return start != nullptr ? start[b * stride + p] : 0; }
};

// out (B, T, C): each head's softmax(q kᵀ / sqrt(hd), causal) · v, heads side by side.
// lse (B, NH, T): log Σ_j exp(score_ij) over the unmasked j of each row, kept for the backward.
template <typename Real>
void attention_forward(ThreadPool& pool, Real* out, Real* lse, const Real* qkv, int64_t B,
                       int64_t T, int64_t C, int64_t NH, DocumentStarts docs = {});

// dqkv (B, T, 3C) is overwritten. out and lse are attention_forward's. Each (b, h) is one task
// that owns its columns of dqkv, so the result does not depend on the pool size.
template <typename Real>
void attention_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* qkv,
                        const Real* out, const Real* lse, int64_t B, int64_t T, int64_t C,
                        int64_t NH, DocumentStarts docs = {});

// Grouped-query attention reading the shared heads in place (Llama): qkv (B, T, (NH + 2·KV)·hd)
// as the qkv projection writes it — NH query heads, then KV key heads, then KV value heads, query
// head h reading key/value head h / (NH/KV); KV = NH is the 3C layout above, and the functions
// above are these with KV = NH. out (B, T, NH·hd), lse (B, NH, T).
template <typename Real>
void attention_gqa_forward(ThreadPool& pool, Real* out, Real* lse, const Real* qkv, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd, DocumentStarts docs = {});
// dqkv (B, T, (NH + 2·KV)·hd) is overwritten. Each (b, key/value head) is one task: it writes its
// query heads' dQ and adds their dK, dV contributions in ascending query head, so the result does
// not depend on the pool size.
template <typename Real>
void attention_gqa_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* qkv,
                            const Real* out, const Real* lse, int64_t B, int64_t T, int64_t NH,
                            int64_t KV, int64_t hd, DocumentStarts docs = {});

// Query positions [begin, end) of the sequence.
struct RowRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
// How many rows `rows` hold. Inline: the CUDA kernels' library calls it too.
inline int64_t rows_in(std::span<const RowRange> rows) {
  int64_t n = 0;
  for (const RowRange& r : rows) n += r.size();
  return n;
}

// Context parallelism (parallel/context_parallel.h): the attention of some query rows only,
// their queries apart from the keys and values. q (B, Tq, ·) with row stride ldq holds the
// query rows' NH query heads (from column 0), the positions in `rows` in order (Tq =
// rows_in(rows)); kv (B, T, ·) with row stride ldkv holds T positions' KV key heads and then
// their KV value heads: with `keys` empty every position 0..T-1 (the query rows then lie in
// [0, T)), else the positions of the runs `keys` (ascending, Σ sizes = T: one rank's block of a
// ring). Each query row sees the keys at positions up to its own — a prefix of kv's rows — and
// with `docs` from its document's start on; a row that sees none gets output 0 and lse -inf. out
// (B, Tq, NH·hd) and lse (B, NH, Tq). With rows = {[0, T)}, q = qkv, kv = qkv + NH·hd and both
// strides the qkv width this is attention_gqa_forward.
template <typename Real>
void attention_gqa_forward_rows(ThreadPool& pool, Real* out, Real* lse, const Real* q, int64_t ldq,
                                const Real* kv, int64_t ldkv, int64_t B, int64_t T, int64_t NH,
                                int64_t KV, int64_t hd, std::span<const RowRange> rows,
                                std::span<const RowRange> keys = {}, DocumentStarts docs = {});
// The ring's merge: out and lse (the rows' attention over some keys; from nothing, out 0 and lse
// -inf) absorb part_out and part_lse, the same rows' attention over other keys — lse' = log(e^lse
// + e^part_lse), out' = (e^lse · out + e^part_lse · part_out) / e^lse'. Layouts as the forward's:
// out (B, Tq, NH·hd), lse (B, NH, Tq).
template <typename Real>
void attention_merge_rows(ThreadPool& pool, Real* out, Real* lse, const Real* part_out,
                          const Real* part_lse, int64_t B, int64_t Tq, int64_t NH, int64_t hd);
// dq (B, Tq, ·), row stride lddq, gets the query rows' dQ (its first NH·hd columns written);
// dkv (B, T, ·), row stride ldkv, is overwritten with dK and dV at every position kv holds —
// this rank's share, zero past the last key its rows saw, to be summed over the ranks holding
// the other rows. dout and out (B, Tq, NH·hd), lse (B, NH, Tq) as the forward's: with keys, out
// and lse are the rows' attention over every key (the ring's merged result), so that the
// blocks' dQ sum to the whole dQ. dq may share rows with dkv (the whole-sequence case: dqkv and
// dqkv + NH·hd); their columns must not overlap.
template <typename Real>
void attention_gqa_backward_rows(ThreadPool& pool, Real* dq, int64_t lddq, Real* dkv,
                                 const Real* dout, const Real* q, int64_t ldq, const Real* kv,
                                 int64_t ldkv, const Real* out, const Real* lse, int64_t B,
                                 int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                 std::span<const RowRange> rows,
                                 std::span<const RowRange> keys = {}, DocumentStarts docs = {});

// Columns [0, width) of `rows` rows between row strides ld_src and ld_dst (the keys and values
// of a qkv projection's rows, for context parallelism's exchange).
template <typename Real>
void copy_columns(ThreadPool& pool, Real* dst, int64_t ld_dst, const Real* src, int64_t ld_src,
                  int64_t rows, int64_t width);

}  // namespace loom::cpu
