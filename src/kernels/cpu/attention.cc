#include "kernels/cpu/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "base/check.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {
namespace {

// This thread's scratch of at least `size` elements, kept from call to call: allocating it per
// call cost a zero fill and, above glibc's mmap threshold (the backward's 128 KB), an mmap whose
// fresh pages fault in on every layer — 5–8% of the attention's time.
template <typename Real>
Real* thread_scratch(int64_t size) {
  thread_local std::vector<Real> scratch;
  if (static_cast<int64_t>(scratch.size()) < size) scratch.resize(size);
  return scratch.data();
}

// ThreadPool::parallel_tasks with a scratch buffer per thread rather than per task: runs
// fn(task, scratch) for every task in [0, tasks), handed out one at a time so a thread that
// starts late simply takes fewer. fn must write scratch before reading it.
template <typename Real, typename Fn>
void for_each_task(ThreadPool& pool, int64_t tasks, int64_t scratch_size, const Fn& fn) {
  std::atomic<int64_t> next{0};
  pool.parallel_for(std::min<int64_t>(pool.size(), tasks), 1, [&](int64_t, int64_t) {
    Real* scratch = thread_scratch<Real>(scratch_size);
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t, scratch);
  });
}

// Where one (b, h) lives: query row r of head h is q[r * ldq], key/value position t of its
// key/value head k[t * ldkv], v[t * ldkv]. Query head h reads key/value head h / (NH / KV)
// (grouped-query attention; KV = NH: GPT-2's 3C layout).
template <typename Real>
struct Head {
  int64_t ldq;
  const Real* q;
  int64_t ldkv;
  const Real* k;
  const Real* v;
};

// q (B, Tq, ldq): the query heads from column 0; kv (B, T, ldkv): KV key heads, then KV value
// heads.
template <typename Real>
Head<Real> head_of(const Real* q, int64_t ldq, int64_t Tq, const Real* kv, int64_t ldkv, int64_t T,
                   int64_t b, int64_t h, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t g = h / (NH / KV);
  const Real* keys = kv + b * T * ldkv;
  return {ldq, q + b * Tq * ldq + h * hd, ldkv, keys + g * hd, keys + (KV + g) * hd};
}

// The keys a kernel call holds: kv's rows at the positions of `keys` (runs in ascending
// position), or with no runs positions 0..T-1. A query at position p sees the keys at positions
// <= p: a prefix of kv's rows, visible(p) of them.
struct KeyRuns {
  std::span<const RowRange> runs;
  int64_t T;
  // Whether the keys are the whole sequence 0..T-1 (one-device attention, the gathered
  // exchange): the query rows must then lie within it.
  bool whole() const { return runs.empty(); }
  int64_t visible(int64_t p) const {
    if (whole()) return std::min(p + 1, T);
    int64_t n = 0;
    for (const RowRange& r : runs) n += std::clamp<int64_t>(p + 1 - r.begin, 0, r.size());
    return n;
  }
};

KeyRuns key_runs_of(std::span<const RowRange> keys, int64_t T,
                    std::span<const RowRange> rows) {
  if (keys.empty()) {
    for (const RowRange& r : rows) LOOM_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= T);
    return {keys, T};
  }
  LOOM_CHECK(rows_in(keys) == T);
  int64_t end = 0;
  for (const RowRange& k : keys) {
    LOOM_CHECK_MSG(k.begin >= end && k.begin <= k.end, "key runs must ascend without overlap");
    end = k.end;
  }
  for (const RowRange& r : rows) LOOM_CHECK(r.begin >= 0 && r.begin <= r.end);
  return {keys, T};
}

// The key rows [begin, end) a query at position p sees: those at positions in [first, p],
// first its document's start (0 without document masking).
struct KeySpan {
  int64_t begin, end;
  int64_t size() const { return end > begin ? end - begin : 0; }
};
KeySpan key_span(const KeyRuns& seen, const DocumentStarts& docs, int64_t b, int64_t p) {
  const int64_t first = docs.first(b, p);
  return {first > 0 ? seen.visible(first - 1) : 0, seen.visible(p)};
}

// The key rows a block of query rows [i0, i1) (ascending positions) sees in all: from the
// earliest document start among them (its first row's, as starts never decrease; the minimum
// all the same) to its last row's position.
KeySpan block_span(const KeyRuns& seen, const DocumentStarts& docs, int64_t b, int64_t i0,
                   int64_t i1) {
  KeySpan span{key_span(seen, docs, b, i0).begin, seen.visible(i1 - 1)};
  if (docs.masked())
    for (int64_t p = i0 + 1; p < i1; ++p)
      span.begin = std::min(span.begin, key_span(seen, docs, b, p).begin);
  return span;
}

}  // namespace

// Per (b, h) and block of query rows i0..i1 (key rows k0..k1 are all it can see: keys 0..i1 - 1
// over the whole sequence, from the block's first document start with document masking):
//   1. S = Q_blk · K[k0:k1]ᵀ / sqrt(hd)      one GEMM, into scratch
//   2. row-wise masked softmax of S, in place, saving lse
//   3. O_blk = P · V[k0:k1]                   one GEMM, straight into out
// A row that sees no key (a ring's block of later positions, or of an earlier document) gets
// output 0 and lse -inf: the empty sum, which attention_merge_rows then weighs by exp(-inf) = 0.
template <typename Real>
void attention_gqa_forward_rows(ThreadPool& pool, Real* out, Real* lse, const Real* q, int64_t ldq,
                                const Real* kv, int64_t ldkv, int64_t B, int64_t T, int64_t NH,
                                int64_t KV, int64_t hd, std::span<const RowRange> rows,
                                std::span<const RowRange> keys, DocumentStarts docs) {
  LOOM_CHECK(NH > 0 && KV > 0 && NH % KV == 0 && hd > 0);
  const KeyRuns seen = key_runs_of(keys, T, rows);
  const int64_t C = NH * hd, Tq = rows_in(rows);
  const Real scale = Real(1) / std::sqrt(Real(hd));
  for_each_task<Real>(pool, B * NH, kAttentionRowBlock * T, [&](int64_t task, Real* S) {
    const int64_t b = task / NH, h = task % NH;
    const Head<Real> x = head_of(q, ldq, Tq, kv, ldkv, T, b, h, NH, KV, hd);
    Real* o = out + b * Tq * C + h * hd;
    Real* l = lse + task * Tq;
    int64_t local = 0;  // the range's first row in q, out and lse
    for (const RowRange& range : rows) {
      for (int64_t i0 = range.begin; i0 < range.end; i0 += kAttentionRowBlock) {
        const int64_t i1 = std::min(range.end, i0 + kAttentionRowBlock), n_rows = i1 - i0;
        const int64_t at = local + (i0 - range.begin);
        const KeySpan block = block_span(seen, docs, b, i0, i1);
        const int64_t k0 = block.begin, cols = block.size();
        if (cols == 0) {
          for (int64_t r = 0; r < n_rows; ++r) {
            std::fill(o + (at + r) * C, o + (at + r) * C + hd, Real(0));
            l[at + r] = -std::numeric_limits<Real>::infinity();
          }
          continue;
        }
        gemm_serial<Real>(false, true, n_rows, cols, hd, scale, x.q + at * x.ldq, x.ldq,
                          x.k + k0 * x.ldkv, x.ldkv, 0, S, cols);
        for (int64_t r = 0; r < n_rows; ++r) {
          Real* s = S + r * cols;
          const KeySpan row = key_span(seen, docs, b, i0 + r);
          const int64_t n = row.size();
          if (n == 0) {
            std::fill(s, s + cols, Real(0));
            l[at + r] = -std::numeric_limits<Real>::infinity();
            continue;
          }
          const int64_t lo = row.begin - k0;  // the row's keys are s[lo, lo + n)
          std::fill(s, s + lo, Real(0));
          s += lo;
          // Subtracting the row max keeps exp() <= 1: no overflow, whatever the scores.
          Real mx, sum;
          if constexpr (std::is_same_v<Real, float>) {
            // Vectorised exp, fused with the sum (kept in double) — see vec_math.h.
            mx = vmath::max_value(s, n);
            sum = static_cast<Real>(vmath::exp_sum(s, s, mx, n));
          } else {
            mx = *std::max_element(s, s + n);
            for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j] - mx);
            sum = detail::lane_sum<Real>(s, n);
          }
          const Real inv = Real(1) / sum;
          for (int64_t j = 0; j < n; ++j) s[j] *= inv;
          std::fill(s + n, S + (r + 1) * cols, Real(0));
          l[at + r] = mx + std::log(sum);
        }
        gemm_serial<Real>(false, false, n_rows, hd, cols, 1, S, cols, x.v + k0 * x.ldkv, x.ldkv, 0,
                          o + at * C, C);
      }
      local += range.size();
    }
  });
}

template <typename Real>
void attention_gqa_forward(ThreadPool& pool, Real* out, Real* lse, const Real* qkv, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd, DocumentStarts docs) {
  const RowRange all{0, T};
  const int64_t ld = (NH + 2 * KV) * hd;
  attention_gqa_forward_rows(pool, out, lse, qkv, ld, qkv + NH * hd, ld, B, T, NH, KV, hd,
                             {&all, 1}, {}, docs);
}

template <typename Real>
void attention_forward(ThreadPool& pool, Real* out, Real* lse, const Real* qkv, int64_t B,
                       int64_t T, int64_t C, int64_t NH, DocumentStarts docs) {
  LOOM_CHECK(NH > 0 && C % NH == 0);
  attention_gqa_forward(pool, out, lse, qkv, B, T, NH, NH, C / NH, docs);
}

namespace {
// One query head's share of the backward: its dQ written, and dK and dV — its key/value head's,
// shared with the rest of its group — added to. x: the head of sequence b; o, dO, l: its output,
// output gradient and lse; scratch: two (kAttentionRowBlock, T) matrices.
template <typename Real>
void attention_head_backward(Real* dq, int64_t lddq, Real* dk, Real* dv, const Real* dO,
                             const Head<Real>& x, const Real* o, const Real* l,
                             std::span<const RowRange> rows, const KeyRuns& seen,
                             const DocumentStarts& docs, int64_t b, int64_t C, int64_t hd,
                             Real scale, Real* scratch, int64_t block_area) {
  Real* P = scratch;
  Real* dS = scratch + block_area;
  int64_t local = 0;  // the range's first row in q, dq, dO, o and l
  for (const RowRange& range : rows) {
    for (int64_t i0 = range.begin; i0 < range.end; i0 += kAttentionRowBlock) {
      const int64_t i1 = std::min(range.end, i0 + kAttentionRowBlock), n_rows = i1 - i0;
      const int64_t at = local + (i0 - range.begin);
      const KeySpan block = block_span(seen, docs, b, i0, i1);
      const int64_t k0 = block.begin, cols = block.size();
      if (cols == 0) {  // no key here for these rows: their dQ is 0, no key gets anything
        for (int64_t r = 0; r < n_rows; ++r)
          std::fill(dq + (at + r) * lddq, dq + (at + r) * lddq + hd, Real(0));
        continue;
      }
      const Real* k = x.k + k0 * x.ldkv;
      const Real* v = x.v + k0 * x.ldkv;
      gemm_serial<Real>(false, true, n_rows, cols, hd, scale, x.q + at * x.ldq, x.ldq, k, x.ldkv, 0,
                        P, cols);
      gemm_serial<Real>(false, true, n_rows, cols, hd, 1, dO + at * C, C, v, x.ldkv, 0, dS, cols);
      for (int64_t r = 0; r < n_rows; ++r) {
        const KeySpan row = key_span(seen, docs, b, i0 + r);
        const int64_t n = row.size(), lo = n > 0 ? row.begin - k0 : 0;
        Real* p = P + r * cols;
        Real* ds = dS + r * cols;  // holds dP on entry
        std::fill(p, p + lo, Real(0));
        std::fill(ds, ds + lo, Real(0));
        const Real D = detail::lane_dot<Real>(dO + (at + r) * C, o + (at + r) * C, hd);
        const Real li = l[at + r];
        Real* pr = p + lo;
        Real* dsr = ds + lo;
        if constexpr (std::is_same_v<Real, float>) {
          vmath::exp_shifted(pr, pr, li, 1.0f, n);
          for (int64_t j = 0; j < n; ++j) dsr[j] = pr[j] * (dsr[j] - D) * scale;
        } else {
          for (int64_t j = 0; j < n; ++j) {
            pr[j] = std::exp(pr[j] - li);
            dsr[j] = pr[j] * (dsr[j] - D) * scale;
          }
        }
        std::fill(pr + n, p + cols, Real(0));
        std::fill(dsr + n, ds + cols, Real(0));
      }
      gemm_serial<Real>(false, false, n_rows, hd, cols, 1, dS, cols, k, x.ldkv, 0, dq + at * lddq,
                        lddq);
      gemm_serial<Real>(true, false, cols, hd, n_rows, 1, dS, cols, x.q + at * x.ldq, x.ldq, 1,
                        dk + k0 * x.ldkv, x.ldkv);
      gemm_serial<Real>(true, false, cols, hd, n_rows, 1, P, cols, dO + at * C, C, 1,
                        dv + k0 * x.ldkv, x.ldkv);
    }
    local += range.size();
  }
}
}  // namespace

// Per (b, key/value head), with its dK and dV zeroed first, then for each query head it serves,
// in ascending order, per block of query rows i0..i1 seeing key rows k0..k1 (the forward's):
//   1. P = exp(Q_blk · K[k0:k1]ᵀ / sqrt(hd) - lse), masked      recomputed, not stored
//   2. dP = dO_blk · V[k0:k1]ᵀ
//   3. dS = P ∘ (dP - D) / sqrt(hd), D_i = Σ_d dO_id · O_id    (= Σ_j P_ij dP_ij, cheaper)
//   4. dQ_blk = dS · K[k0:k1];  dK[k0:k1] += dSᵀ · Q_blk;  dV[k0:k1] += Pᵀ · dO_blk
template <typename Real>
void attention_gqa_backward_rows(ThreadPool& pool, Real* dq, int64_t lddq, Real* dkv,
                                 const Real* dout, const Real* q, int64_t ldq, const Real* kv,
                                 int64_t ldkv, const Real* out, const Real* lse, int64_t B,
                                 int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                 std::span<const RowRange> rows, std::span<const RowRange> keys,
                                 DocumentStarts docs) {
  LOOM_CHECK(NH > 0 && KV > 0 && NH % KV == 0 && hd > 0);
  const KeyRuns seen = key_runs_of(keys, T, rows);
  const int64_t C = NH * hd, group = NH / KV, Tq = rows_in(rows);
  const Real scale = Real(1) / std::sqrt(Real(hd));
  const int64_t block_area = kAttentionRowBlock * T;
  // One task per (b, key/value head): it alone writes that head's dK and dV (and its query
  // heads' dQ), so the sums over the group run in one fixed order, whatever the pool size.
  for_each_task<Real>(pool, B * KV, 2 * block_area, [&](int64_t task, Real* scratch) {
    const int64_t b = task / KV, g = task % KV;
    Real* dk = dkv + b * T * ldkv + g * hd;
    Real* dv = dkv + b * T * ldkv + (KV + g) * hd;
    for (int64_t t = 0; t < T; ++t) {
      std::fill(dk + t * ldkv, dk + t * ldkv + hd, Real(0));
      std::fill(dv + t * ldkv, dv + t * ldkv + hd, Real(0));
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      attention_head_backward(dq + b * Tq * lddq + h * hd, lddq, dk, dv, dout + b * Tq * C + h * hd,
                              head_of(q, ldq, Tq, kv, ldkv, T, b, h, NH, KV, hd),
                              out + b * Tq * C + h * hd, lse + (b * NH + h) * Tq, rows, seen, docs,
                              b, C, hd, scale, scratch, block_area);
  });
}

template <typename Real>
void attention_gqa_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* qkv,
                            const Real* out, const Real* lse, int64_t B, int64_t T, int64_t NH,
                            int64_t KV, int64_t hd, DocumentStarts docs) {
  const RowRange all{0, T};
  const int64_t ld = (NH + 2 * KV) * hd;
  attention_gqa_backward_rows(pool, dqkv, ld, dqkv + NH * hd, dout, qkv, ld, qkv + NH * hd, ld, out,
                              lse, B, T, NH, KV, hd, {&all, 1}, {}, docs);
}

template <typename Real>
void attention_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* qkv,
                        const Real* out, const Real* lse, int64_t B, int64_t T, int64_t C,
                        int64_t NH, DocumentStarts docs) {
  LOOM_CHECK(NH > 0 && C % NH == 0);
  attention_gqa_backward(pool, dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH, docs);
}

template void attention_gqa_forward<float>(ThreadPool&, float*, float*, const float*, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, DocumentStarts);
template void attention_gqa_forward<double>(ThreadPool&, double*, double*, const double*, int64_t,
                                            int64_t, int64_t, int64_t, int64_t, DocumentStarts);
template void attention_gqa_backward<float>(ThreadPool&, float*, const float*, const float*,
                                            const float*, const float*, int64_t, int64_t, int64_t,
                                            int64_t, int64_t, DocumentStarts);
template void attention_gqa_backward<double>(ThreadPool&, double*, const double*, const double*,
                                             const double*, const double*, int64_t, int64_t,
                                             int64_t, int64_t, int64_t, DocumentStarts);

template <typename Real>
void copy_columns(ThreadPool& pool, Real* dst, int64_t ld_dst, const Real* src, int64_t ld_src,
                  int64_t rows, int64_t width) {
  pool.parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::copy(src + r * ld_src, src + r * ld_src + width, dst + r * ld_dst);
  });
}

template void copy_columns<float>(ThreadPool&, float*, int64_t, const float*, int64_t, int64_t,
                                  int64_t);
template void copy_columns<double>(ThreadPool&, double*, int64_t, const double*, int64_t, int64_t,
                                   int64_t);

template void attention_gqa_forward_rows<float>(ThreadPool&, float*, float*, const float*, int64_t,
                                                const float*, int64_t, int64_t, int64_t, int64_t,
                                                int64_t, int64_t, std::span<const RowRange>,
                                                std::span<const RowRange>, DocumentStarts);
template void attention_gqa_forward_rows<double>(ThreadPool&, double*, double*, const double*,
                                                 int64_t, const double*, int64_t, int64_t, int64_t,
                                                 int64_t, int64_t, int64_t,
                                                 std::span<const RowRange>,
                                                 std::span<const RowRange>, DocumentStarts);
template void attention_gqa_backward_rows<float>(ThreadPool&, float*, int64_t, float*, const float*,
                                                 const float*, int64_t, const float*, int64_t,
                                                 const float*, const float*, int64_t, int64_t,
                                                 int64_t, int64_t, int64_t,
                                                 std::span<const RowRange>,
                                                 std::span<const RowRange>, DocumentStarts);
template void attention_gqa_backward_rows<double>(ThreadPool&, double*, int64_t, double*,
                                                  const double*, const double*, int64_t,
                                                  const double*, int64_t, const double*,
                                                  const double*, int64_t, int64_t, int64_t, int64_t,
                                                  int64_t, std::span<const RowRange>,
                                                  std::span<const RowRange>, DocumentStarts);

template void attention_forward<float>(ThreadPool&, float*, float*, const float*, int64_t, int64_t,
                                       int64_t, int64_t, DocumentStarts);
template void attention_forward<double>(ThreadPool&, double*, double*, const double*, int64_t,
                                        int64_t, int64_t, int64_t, DocumentStarts);
template void attention_backward<float>(ThreadPool&, float*, const float*, const float*,
                                        const float*, const float*, int64_t, int64_t, int64_t,
                                        int64_t, DocumentStarts);
template void attention_backward<double>(ThreadPool&, double*, const double*, const double*,
                                         const double*, const double*, int64_t, int64_t, int64_t,
                                         int64_t, DocumentStarts);

// Per (b, h, row): the two partial softmaxes weighed by their sums, relative to the larger lse
// so that neither exp overflows; a side with lse -inf (no key) weighs 0.
template <typename Real>
void attention_merge_rows(ThreadPool& pool, Real* out, Real* lse, const Real* part_out,
                          const Real* part_lse, int64_t B, int64_t Tq, int64_t NH, int64_t hd) {
  const int64_t C = NH * hd;
  pool.parallel_for(B * Tq, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t b = row / Tq, t = row % Tq;
      for (int64_t h = 0; h < NH; ++h) {
        Real& l = lse[(b * NH + h) * Tq + t];
        const Real pl = part_lse[(b * NH + h) * Tq + t];
        if (pl == -std::numeric_limits<Real>::infinity()) continue;  // the part saw no key
        Real* o = out + row * C + h * hd;
        const Real* po = part_out + row * C + h * hd;
        if (l == -std::numeric_limits<Real>::infinity()) {  // nothing yet: the part alone
          std::copy(po, po + hd, o);
          l = pl;
          continue;
        }
        const Real m = std::max(l, pl);
        const Real w = std::exp(l - m), pw = std::exp(pl - m), sum = w + pw;
        const Real a = w / sum, pa = pw / sum;
        for (int64_t d = 0; d < hd; ++d) o[d] = a * o[d] + pa * po[d];
        l = m + std::log(sum);
      }
    }
  });
}

template void attention_merge_rows<float>(ThreadPool&, float*, float*, const float*, const float*,
                                          int64_t, int64_t, int64_t, int64_t);
template void attention_merge_rows<double>(ThreadPool&, double*, double*, const double*,
                                           const double*, int64_t, int64_t, int64_t, int64_t);

}  // namespace loom::cpu
