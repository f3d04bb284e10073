#include "parallel/context_parallel.h"

#include <cstring>

#include "base/error.h"
#include "device/allocator.h"
#include "nn/context.h"

namespace loom {

std::vector<cpu::RowRange> zigzag_positions(int64_t T, int cp, int rank) {
  LOOM_CHECK(cp >= 1 && rank >= 0 && rank < cp);
  if (cp == 1) return {{0, T}};
  if (T % (2 * cp) != 0)
    fail("context parallelism over ", cp, " ranks cuts each sequence into ", 2 * cp,
         " chunks: model.seq_len = ", T, " is not a multiple of ", 2 * cp);
  const int64_t chunk = T / (2 * cp);
  const int64_t late = 2 * cp - 1 - rank;
  return {{rank * chunk, (rank + 1) * chunk}, {late * chunk, (late + 1) * chunk}};
}

Tensor shard_tokens(const Tensor& tokens, const std::vector<cpu::RowRange>& positions) {
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::kI32 && tokens.device().is_cpu());
  const int64_t B = tokens.dim(0), T = tokens.dim(1), Tl = cpu::rows_in(positions);
  Tensor out = Tensor::empty({B, Tl}, DType::kI32, Device::cpu());
  for (int64_t b = 0; b < B; ++b) {
    int32_t* dst = out.data<int32_t>() + b * Tl;
    for (const cpu::RowRange& r : positions) {
      LOOM_CHECK(r.end <= T);
      std::memcpy(dst, tokens.data<int32_t>() + b * T + r.begin, r.size() * sizeof(int32_t));
      dst += r.size();
    }
  }
  return out;
}

ContextParallel::ContextParallel(Communicator& cp, int64_t T) : cp_(cp), T_(T) {
  for (int r = 0; r < cp.size(); ++r) positions_.push_back(zigzag_positions(T, cp.size(), r));
}

namespace {
// Moves rows between (cp·B·Tl, W) — every rank's local tensor, rank after rank — and the whole
// sequence's (B·T, W), on any device: to_full copies stacked → full, else full → stacked.
void move_rows(const std::vector<std::vector<cpu::RowRange>>& positions, Tensor stacked,
               Tensor full, int64_t B, int64_t T, bool to_full) {
  const int64_t Tl = cpu::rows_in(positions[0]);
  for (size_t q = 0; q < positions.size(); ++q)
    for (int64_t b = 0; b < B; ++b) {
      int64_t local = (static_cast<int64_t>(q) * B + b) * Tl;
      for (const cpu::RowRange& r : positions[q]) {
        Tensor mine = stacked.narrow(local, r.size());
        Tensor whole = full.narrow(b * T + r.begin, r.size());
        // Queued on a GPU's compute stream, not one synchronous copy each: the collective that
        // reads `stacked` next, and the attention that reads `full`, run after them there.
        if (to_full)
          copy_bytes_queued(whole.raw(), mine.raw(), full.device(), mine.nbytes());
        else
          copy_bytes_queued(mine.raw(), whole.raw(), full.device(), mine.nbytes());
        local += r.size();
      }
    }
}
}  // namespace

Tensor ContextParallel::gather(Context& ctx, const Tensor& local) {
  LOOM_CHECK(local.ndim() == 3 && local.dim(1) == local_length());
  const int64_t B = local.dim(0), W = local.dim(2), cp = cp_.size(), Tl = local.dim(1);
  Tensor stacked = Tensor::empty({cp, B, Tl, W}, local.dtype(), ctx.device);
  cp_.all_gather(local, stacked);
  Tensor full = Tensor::empty({B, T_, W}, local.dtype(), ctx.device);
  move_rows(positions_, stacked.reshape({cp * B * Tl, W}), full.reshape({B * T_, W}), B, T_, true);
  return full;
}

Tensor ContextParallel::reduce_scatter(Context& ctx, const Tensor& full) {
  LOOM_CHECK(full.ndim() == 3 && full.dim(1) == T_);
  const int64_t B = full.dim(0), W = full.dim(2), cp = cp_.size(), Tl = local_length();
  Tensor stacked = Tensor::empty({cp, B, Tl, W}, full.dtype(), ctx.device);
  move_rows(positions_, stacked.reshape({cp * B * Tl, W}), full.reshape({B * T_, W}), B, T_, false);
  Tensor local = Tensor::empty({B, Tl, W}, full.dtype(), ctx.device);
  cp_.reduce_scatter(stacked, local, ReduceOp::kSum);
  return local;
}

}  // namespace loom
