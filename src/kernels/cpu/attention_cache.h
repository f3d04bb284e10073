// Causal attention of a few new query rows over a key/value cache: the incremental decoding of
// sampling (train/generate.h), where each new token attends to every earlier one without the
// context's keys and values being recomputed. Inference only: no backward, nothing kept.
//
// Legend: n = new rows at positions first .. first+n−1, C = channels, NH = heads, hd = C / NH.
// q: n rows, row r at q + r·q_stride, head h in columns h·hd .. h·hd + hd − 1 (as in a fused qkv).
// k, v: the cache, (first + n, C) at least, the new rows already in place (rows first ..).
#pragma once

#include <cstdint>

#include "base/thread_pool.h"

namespace loom::cpu {

// out (n, C): row r, head h = softmax over j ≤ first + r of q_r·k_j / sqrt(hd), times v — with a
// sliding window W > 0 over the W positions first + r − W < j ≤ first + r only. Sums in double;
// each (row, head) is one task, so the result does not depend on pool.size().
template <typename Real>
void attention_with_cache(ThreadPool& pool, Real* out, const Real* q, int64_t q_stride,
                          const Real* k, const Real* v, int64_t first, int64_t n, int64_t C,
                          int64_t NH, int64_t window = 0);

}  // namespace loom::cpu
