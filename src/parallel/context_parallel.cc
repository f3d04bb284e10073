#include "parallel/context_parallel.h"

#include <cstring>

#include "base/error.h"
#include "device/allocator.h"
#include "kernels/ops.h"
#include "nn/context.h"
#include "tensor/dispatch.h"

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

ContextParallel::ContextParallel(Communicator& cp, int64_t T, bool ring)
    : cp_(cp), T_(T), ring_(ring) {
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
  cp_.all_gather_async(local, stacked)->wait_on_device();
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
  cp_.reduce_scatter_async(stacked, local, ReduceOp::kSum)->wait_on_device();
  return local;
}

// The ring. Step s of n: this rank holds rank (r − s)'s block and computes on it while rank
// (r − s − 1)'s arrives from the previous rank (and the current one leaves for the next). Two
// receive buffers alternate (one with two ranks), allocated as first needed; a block is
// overwritten only after its send completed.
namespace {
constexpr int kTagBlock = 0, kTagGrad = 1;
}

void ContextParallel::walk_ring(Context& ctx, const Tensor& local,
                                const std::function<void(int, const Tensor&)>& step) {
  const int n = cp_.size(), r = cp_.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  Tensor buffers[2];
  Tensor current = local;
  for (int s = 0; s < n; ++s) {
    WorkHandle passed;
    if (s + 1 < n) {
      Tensor& into = buffers[s % 2];
      if (!into.defined()) into = Tensor::empty(local.shape(), local.dtype(), ctx.device);
      // One operation: under nccl the send and the recv go in one group (a ring of separate
      // sends would wait on itself).
      passed = cp_.send_recv_async(current, next, into, prev, kTagBlock);
    }
    step(s, current);
    if (s + 1 < n) {
      passed->wait_on_device();
      current = buffers[s % 2];
    }
  }
}

void ContextParallel::ring_blocks(Context& ctx, const Tensor& local, const BlockVisit& visit) {
  const int n = cp_.size(), r = cp_.rank();
  walk_ring(ctx, local,
            [&](int s, const Tensor& block) { visit(block, positions_[(r - s + n) % n]); });
}

// The blocks go round as in the forward. Block o's gradient starts on its owner (step 0), gains
// each rank's share as it follows the block (rank o + s adds its own at step s: the sum in ring
// order from the owner, the same bits on every run), and after the last step, complete, goes
// one rank further: home. Each rank's share is computed while the running sum it joins is still
// in flight. Three gradient buffers rotate: the running sum in hand (then sent on), the one
// being received, and the share.
Tensor ContextParallel::ring_blocks_backward(Context& ctx, const Tensor& local, DType grad_dtype,
                                             const GradVisit& visit) {
  const int n = cp_.size(), r = cp_.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  auto like = [&] { return Tensor::empty(local.shape(), grad_dtype, ctx.device); };
  Tensor sum = like(), incoming = like(), share = like();
  WorkHandle sums_passed;
  walk_ring(ctx, local, [&](int s, const Tensor& block) {
    if (s == 0) {
      visit(block, positions_[r], sum);  // the own block's sum starts here
    } else {
      visit(block, positions_[(r - s + n) % n], share);
      // The block's sum from its owner up to the previous rank is in; the last sum sent, so its
      // buffer takes the next one.
      sums_passed->wait_on_device();
      dispatch_float(incoming.dtype(), [&](auto zero) {
        using Real = decltype(zero);
        ops::add_inplace<Real>(ctx.exec(), incoming.data<Real>(), share.data<Real>(),
                               incoming.numel());
      });
      std::swap(sum, incoming);
    }
    // The sum on to the next rank; in comes the next block's running sum, or after the last step
    // this rank's own, complete.
    sums_passed = cp_.send_recv_async(sum, next, incoming, prev, kTagGrad);
  });
  sums_passed->wait_on_device();
  return incoming;
}

}  // namespace loom
