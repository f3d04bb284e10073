// Reductions and chunking for the local backend: the only loops over tensor elements in it.
//
// Deterministic by construction: inputs are combined in the order given (rank 0..n-1), bf16/f16
// through f32 with one rounding at the end, avg = sum / n (integer division for i32/i64), and
// integer sums wrap instead of overflowing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace loom::local {

// outs[k][i] = op over r of ins[r][i] for i in [0, count), every out getting the same bits.
// Works block by block (L1-sized), so an out may alias an in at the same offset.
void reduce_buffers(DType dtype, ReduceOp op, const std::vector<const std::byte*>& ins,
                    const std::vector<std::byte*>& outs, int64_t count);

// [begin, end) of chunk r when n elements are split over `parts` ranks; boundaries fall on
// 64-byte multiples so that two ranks never write the same cache line.
std::pair<int64_t, int64_t> chunk_range(int64_t n, size_t elem, int parts, int r);

// memcpy that skips empty and self copies.
void copy_bytes(std::byte* dst, const std::byte* src, size_t bytes);

}  // namespace loom::local
