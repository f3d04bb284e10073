#include "nn/sequence_shard.h"

#include "base/error.h"
#include "device/allocator.h"
#include "kernels/ops.h"
#include "nn/context.h"
#include "tensor/dispatch.h"

namespace loom {

Tensor rows_of(const Tensor& table, const std::vector<cpu::RowRange>& positions) {
  LOOM_CHECK(table.ndim() == 2);
  Tensor out =
      Tensor::empty({cpu::rows_in(positions), table.dim(1)}, table.dtype(), table.device());
  int64_t at = 0;
  for (const cpu::RowRange& r : positions) {
    if (r.end > table.dim(0))
      fail("positions up to ", r.end, " exceed the table's ", table.dim(0), " rows");
    // In the compute stream's order on a GPU: no wait per range.
    const Tensor rows = table.narrow(r.begin, r.size());
    copy_bytes_queued(out.narrow(at, r.size()).raw(), rows.raw(), table.device(), rows.nbytes());
    at += r.size();
  }
  return out;
}

void add_rows_into(const Exec& ex, Tensor& table, const Tensor& rows,
                   const std::vector<cpu::RowRange>& positions) {
  LOOM_CHECK(table.ndim() == 2 && rows.ndim() == 2 && rows.dim(1) == table.dim(1) &&
             rows.dim(0) == cpu::rows_in(positions) && rows.dtype() == table.dtype());
  const int64_t W = table.dim(1);
  dispatch_float(table.dtype(), [&](auto zero) {
    using T = decltype(zero);
    int64_t at = 0;
    for (const cpu::RowRange& r : positions) {
      ops::add_inplace<T>(ex, table.data<T>() + r.begin * W, rows.data<T>() + at * W, r.size() * W);
      at += r.size();
    }
  });
}

void SequenceShard::ring_blocks(Context&, const Tensor&, const BlockVisit&) {
  fail("this sequence shard has no ring exchange");
}
Tensor SequenceShard::ring_blocks_backward(Context&, const Tensor&, DType, const GradVisit&) {
  fail("this sequence shard has no ring exchange");
}

namespace {
// The rows' attention over one block of keys and values (o, l shaped as att and lse).
using AttendBlock = std::function<void(Tensor& o, Tensor& l, const Tensor& block,
                                       const std::vector<cpu::RowRange>& keys)>;
// Its backward: this rank's dQ over the block into dq, the block's dK/dV share into grad.
using AttendBlockBackward = std::function<void(Tensor& dq, Tensor& grad, const Tensor& block,
                                               const std::vector<cpu::RowRange>& keys)>;

// The ring's forward: the rows' attention over each block as it comes round, merged into att and
// lse (the own block's written straight in: it comes first).
void ring_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& kv, int64_t B,
                            int64_t NH, int64_t hd, Tensor& att, Tensor& lse,
                            const AttendBlock& attend) {
  const int64_t Tl = shard.local_length();
  Tensor part_att = Tensor::empty(att.shape(), att.dtype(), ctx.device);
  Tensor part_lse = Tensor::empty(lse.shape(), lse.dtype(), ctx.device);
  bool first = true;
  shard.ring_blocks(ctx, kv, [&](const Tensor& block, const std::vector<cpu::RowRange>& keys) {
    attend(first ? att : part_att, first ? lse : part_lse, block, keys);
    if (!first)
      dispatch_float(att.dtype(), [&](auto zero) {
        using T_ = decltype(zero);
        ops::attention_merge_rows<T_>(ctx.exec(), att.data<T_>(), lse.data<T_>(),
                                      part_att.data<T_>(), part_lse.data<T_>(), B, Tl, NH, hd);
      });
    first = false;
  });
}

// Its backward: dQ summed over the blocks in ring order, each block's dK and dV (in dq's dtype)
// handed to the ring to travel home. Returns (B, Tl, 2·KV·hd), the group's sum for this rank's
// keys and values.
Tensor ring_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& kv, Tensor& dq,
                               const AttendBlockBackward& attend) {
  Tensor part_dq = Tensor::empty(dq.shape(), dq.dtype(), ctx.device);
  bool first = true;
  return shard.ring_blocks_backward(
      ctx, kv, dq.dtype(),
      [&](const Tensor& block, const std::vector<cpu::RowRange>& keys, Tensor& grad) {
        attend(first ? dq : part_dq, grad, block, keys);
        if (!first)
          dispatch_float(dq.dtype(), [&](auto zero) {
            using T_ = decltype(zero);
            ops::add_inplace<T_>(ctx.exec(), dq.data<T_>(), part_dq.data<T_>(), dq.numel());
          });
        first = false;
      });
}
}  // namespace

bool shard_attention_takes_bf16(const Context& ctx, const SequenceShard& shard, int64_t B,
                                int64_t NH, int64_t hd) {
  const std::vector<cpu::RowRange> no_keys;
  return ops::attention_rows_take_bf16(ctx.exec(), NH, hd, B, shard.positions(),
                                       shard.ring() ? shard.positions() : no_keys);
}

void shard_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& qkv, int64_t B,
                             int64_t NH, int64_t KV, int64_t hd, Tensor& q, Tensor& kv, Tensor& att,
                             Tensor& lse, bool rounded_output, cpu::DocumentStarts docs) {
  const int64_t Tl = shard.local_length(), T = shard.full_length(), W = qkv.shape().back();
  LOOM_CHECK(qkv.numel() == B * Tl * W && W == (NH + 2 * KV) * hd);
  const int64_t C = NH * hd, kv_width = 2 * KV * hd;
  // On a GPU at bf16 whose flash kernels take these rows (and, with the ring, a block of keys at
  // positions like them): q and kv in bf16 (half the bytes kept and exchanged; the kernels would
  // round them to bf16 as they load them anyway).
  const std::vector<cpu::RowRange> no_keys;
  const bool bf16 = shard_attention_takes_bf16(ctx, shard, B, NH, hd);
  LOOM_CHECK_MSG(qkv.dtype() == ctx.dtype || (bf16 && qkv.dtype() == DType::kBF16),
                 "context parallelism's attention takes its qkv at the activations' dtype, or in "
                 "bf16 where it keeps q and kv so");
  const DType kept = bf16 ? DType::kBF16 : ctx.dtype;
  q = Tensor::empty({B, Tl, C}, kept, ctx.device);
  Tensor kv_local = Tensor::empty({B, Tl, kv_width}, kept, ctx.device);
  // With `rounded_output` after the all-gather the flash kernels write att in bf16 themselves;
  // the ring merges its blocks in fp32 and rounds once at the end.
  rounded_output = rounded_output && bf16;
  const bool written_rounded = rounded_output && !shard.ring();
  att = Tensor::empty({B * Tl, C}, written_rounded ? DType::kBF16 : ctx.dtype, ctx.device);
  lse = Tensor::empty({B, NH, Tl}, ctx.dtype, ctx.device);
  if (bf16 && qkv.dtype() == DType::kBF16) {
    const uint16_t* rounded = qkv.data_u16();
    ops::copy_columns_16(ctx.exec(), q.raw(), C, rounded, W, B * Tl, C);
    ops::copy_columns_16(ctx.exec(), kv_local.raw(), kv_width, rounded + C, W, B * Tl, kv_width);
  } else if (bf16) {
    ops::copy_columns_to_bf16(ctx.exec(), q.raw(), C, qkv.data<float>(), W, B * Tl, C);
    ops::copy_columns_to_bf16(ctx.exec(), kv_local.raw(), kv_width, qkv.data<float>() + C, W,
                              B * Tl, kv_width);
  } else {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::copy_columns<T_>(ctx.exec(), q.data<T_>(), C, qkv.data<T_>(), W, B * Tl, C);
      ops::copy_columns<T_>(ctx.exec(), kv_local.data<T_>(), kv_width, qkv.data<T_>() + C, W,
                            B * Tl, kv_width);
    });
  }
  // The rows' attention over keys and values `block` at positions `keys` (none: every position).
  const auto attend = [&](Tensor& o, Tensor& l, const Tensor& block,
                          const std::vector<cpu::RowRange>& keys) {
    const int64_t Tk = keys.empty() ? T : cpu::rows_in(keys);
    if (bf16) {
      ops::attention_gqa_forward_rows_bf16(ctx.exec(), o.raw(), DType::kF32, l.data<float>(),
                                           q.raw(), C, block.raw(), kv_width, B, Tk, NH, KV, hd,
                                           shard.positions(), keys, docs);
      return;
    }
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::attention_gqa_forward_rows<T_>(ctx.exec(), o.data<T_>(), l.data<T_>(), q.data<T_>(), C,
                                          block.data<T_>(), kv_width, B, Tk, NH, KV, hd,
                                          shard.positions(), keys, docs);
    });
  };
  if (shard.ring()) {  // keep this rank's keys and values only; the others come round
    kv = kv_local;
    ring_attention_forward(ctx, shard, kv, B, NH, hd, att, lse, attend);
    if (rounded_output) {  // merged in fp32, rounded once
      Tensor att16 = Tensor::empty(att.shape(), DType::kBF16, ctx.device);
      ops::round_to_bf16(ctx.exec(), att16.data_u16(), att.data<float>(), att.numel());
      att = att16;
    }
    return;
  }
  kv = shard.gather(ctx, kv_local);
  if (written_rounded) {  // in bf16 by the flash kernels, as the whole sequence's
    ops::attention_gqa_forward_rows_bf16(ctx.exec(), att.raw(), DType::kBF16, lse.data<float>(),
                                         q.raw(), C, kv.raw(), kv_width, B, T, NH, KV, hd,
                                         shard.positions(), {}, docs);
    return;
  }
  attend(att, lse, kv, no_keys);
}

Tensor shard_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& q,
                                const Tensor& kv, const Tensor& att, const Tensor& lse,
                                const Tensor& datt, int64_t NH, int64_t KV, int64_t hd,
                                cpu::DocumentStarts docs) {
  const int64_t B = kv.dim(0), kv_width = kv.dim(2), C = NH * hd;
  const int64_t Tl = shard.local_length(), W = C + kv_width;
  Tensor dqkv = Tensor::empty({B, Tl, W}, ctx.dtype, ctx.device);
  // dq (row stride ld) and the block's dK/dV share `grad` over keys and values `block` at
  // positions `keys` (none: every position), with the forward's merged att and lse.
  const auto attend = [&](Tensor& dq, int64_t ld, Tensor& grad, const Tensor& block,
                          const std::vector<cpu::RowRange>& keys) {
    const int64_t Tk = block.dim(1);
    if (block.dtype() == DType::kBF16) {  // the forward's bf16 q and kv (attention_rows_take_bf16)
      ops::attention_gqa_backward_rows_bf16(ctx.exec(), dq.data<float>(), ld, grad.data<float>(),
                                            datt.data<float>(), q.raw(), C, block.raw(), kv_width,
                                            att.raw(), att.dtype(), lse.data<float>(), B, Tk, NH,
                                            KV, hd, shard.positions(), keys, docs);
      return;
    }
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::attention_gqa_backward_rows<T_>(ctx.exec(), dq.data<T_>(), ld, grad.data<T_>(),
                                           datt.data<T_>(), q.data<T_>(), C, block.data<T_>(),
                                           kv_width, att.data<T_>(), lse.data<T_>(), B, Tk, NH, KV,
                                           hd, shard.positions(), keys, docs);
    });
  };
  Tensor mine;  // (B, Tl, 2·KV·hd): the group's sum of dK and dV at this rank's positions
  if (shard.ring()) {
    Tensor dq = Tensor::empty({B, Tl, C}, ctx.dtype, ctx.device);
    mine = ring_attention_backward(
        ctx, shard, kv, dq,
        [&](Tensor& d, Tensor& grad, const Tensor& block, const std::vector<cpu::RowRange>& keys) {
          attend(d, C, grad, block, keys);
        });
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::copy_columns<T_>(ctx.exec(), dqkv.data<T_>(), W, dq.data<T_>(), C, B * Tl, C);
    });
  } else {
    Tensor dkv = Tensor::empty(kv.shape(), ctx.dtype, ctx.device);
    attend(dqkv, W, dkv, kv, {});
    mine = shard.reduce_scatter(ctx, dkv);
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::copy_columns<T_>(ctx.exec(), dqkv.data<T_>() + C, W, mine.data<T_>(), kv_width, B * Tl,
                          kv_width);
  });
  return dqkv;
}

}  // namespace loom
