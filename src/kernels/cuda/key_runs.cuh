// Which keys a query sees in context parallelism's ring (kernels.h, attention_gqa_*_rows with
// `keys`), for both attention paths (attention.cu's batched GEMMs, flash_attention.cu).
#pragma once

#include <cstdint>
#include <span>

#include "base/error.h"
#include "kernels/cpu/attention.h"  // RowRange

namespace loom::cuda {

// The positions of T key rows. With count 0 the positions 0..T-1, key row j at position j (the
// whole sequence, or every position gathered); else a ring's block, `count` runs of positions in
// ascending order, run i the positions [begin[i], begin[i] + size[i]) at the next size[i] rows.
// Positions ascend with the rows either way, so the keys a query at position p sees (those at
// positions <= p) are the first visible(p) rows: its causal mask is one comparison of a key's row
// with that limit. Passed to kernels by value.
struct KeyRuns {
  static constexpr int kMaxRuns = 8;
  static constexpr int64_t kNeverSeen = INT64_MAX / 4;  // the position of a row past the last
  int64_t T = 0;
  int count = 0;
  int64_t begin[kMaxRuns] = {}, size[kMaxRuns] = {};

  __host__ __device__ int64_t visible(int64_t p) const {
    if (count == 0) return p + 1 < T ? p + 1 : T;
    int64_t n = 0;
    for (int i = 0; i < count; ++i) {
      const int64_t s = p + 1 - begin[i];
      n += s <= 0 ? 0 : (s < size[i] ? s : size[i]);
    }
    return n;
  }
  // The position of key row j.
  __host__ __device__ int64_t position(int64_t j) const {
    if (count == 0) return j;
    for (int i = 0; i < count; ++i) {
      if (j < size[i]) return begin[i] + j;
      j -= size[i];
    }
    return kNeverSeen;
  }
};

// The key rows a query sees with document masking too (cpu::DocumentStarts, `docs.start` in
// device memory): [begin(b, p), end(p)) for the query at position p of sequence b — those of
// `seen` at positions from its document's first up to p. Without documents begin is 0.
struct KeyMask {
  KeyRuns seen;
  cpu::DocumentStarts docs;
  __device__ int64_t begin(int64_t b, int64_t p) const {
    if (docs.start == nullptr) return 0;
    const int64_t first = docs.start[b * docs.stride + p];
    return first > 0 ? seen.visible(first - 1) : 0;
  }
  __device__ int64_t end(int64_t p) const { return seen.visible(p); }
};

// The runs `keys` of T key rows (none: the positions 0..T-1), checked: ascending, not
// overlapping, T positions in all, at most KeyRuns::kMaxRuns non-empty runs; `what` names the
// operation in the error.
inline KeyRuns key_runs_of(const char* what, int64_t T, std::span<const cpu::RowRange> keys) {
  KeyRuns runs{T};
  int64_t last = 0;
  for (const cpu::RowRange& k : keys) {
    if (k.size() == 0) continue;
    if (k.begin < last || k.end < k.begin)
      fail(what, ": key positions [", k.begin, ", ", k.end, ") out of order");
    if (runs.count == KeyRuns::kMaxRuns)
      fail(what, ": more than ", KeyRuns::kMaxRuns, " runs of key positions");
    runs.begin[runs.count] = k.begin;
    runs.size[runs.count] = k.size();
    ++runs.count;
    last = k.end;
  }
  if (!keys.empty() && cpu::rows_in(keys) != T)
    fail(what, ": key runs of ", cpu::rows_in(keys), " positions for ", T, " key rows");
  return runs;
}

}  // namespace loom::cuda
