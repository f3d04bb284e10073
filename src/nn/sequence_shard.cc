#include "nn/sequence_shard.h"

#include "base/error.h"
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
    out.narrow(at, r.size()).copy_from(table.narrow(r.begin, r.size()));
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
Tensor SequenceShard::ring_blocks_backward(Context&, const Tensor&, const GradVisit&) {
  fail("this sequence shard has no ring exchange");
}

namespace {
// The ring's forward: the rows' attention over each block as it comes round, merged into att and
// lse (the own block's written straight in: it comes first).
template <typename T_>
void ring_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& q, const Tensor& kv,
                            int64_t B, int64_t NH, int64_t KV, int64_t hd, Tensor& att,
                            Tensor& lse) {
  const int64_t Tl = shard.local_length(), C = NH * hd, kv_width = kv.dim(2);
  Tensor part_att = Tensor::empty(att.shape(), att.dtype(), ctx.device);
  Tensor part_lse = Tensor::empty(lse.shape(), lse.dtype(), ctx.device);
  bool first = true;
  shard.ring_blocks(ctx, kv, [&](const Tensor& block, const std::vector<cpu::RowRange>& keys) {
    Tensor& o = first ? att : part_att;
    Tensor& l = first ? lse : part_lse;
    ops::attention_gqa_forward_rows<T_>(ctx.exec(), o.data<T_>(), l.data<T_>(), q.data<T_>(), C,
                                        block.data<T_>(), kv_width, B, cpu::rows_in(keys), NH, KV,
                                        hd, shard.positions(), keys);
    if (!first)
      ops::attention_merge_rows<T_>(ctx.exec(), att.data<T_>(), lse.data<T_>(),
                                    part_att.data<T_>(), part_lse.data<T_>(), B, Tl, NH, hd);
    first = false;
  });
}

// Its backward: dQ summed over the blocks in ring order, each block's dK and dV handed to the
// ring to travel home. Returns (B, Tl, 2·KV·hd), the group's sum for this rank's keys and values.
template <typename T_>
Tensor ring_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& q,
                               const Tensor& kv, const Tensor& att, const Tensor& lse,
                               const Tensor& datt, int64_t NH, int64_t KV, int64_t hd,
                               Tensor& dq) {
  const int64_t B = kv.dim(0), C = NH * hd, kv_width = kv.dim(2);
  Tensor part_dq = Tensor::empty(dq.shape(), dq.dtype(), ctx.device);
  bool first = true;
  return shard.ring_blocks_backward(
      ctx, kv,
      [&](const Tensor& block, const std::vector<cpu::RowRange>& keys, Tensor& grad) {
        Tensor& d = first ? dq : part_dq;
        ops::attention_gqa_backward_rows<T_>(
            ctx.exec(), d.data<T_>(), C, grad.data<T_>(), datt.data<T_>(), q.data<T_>(), C,
            block.data<T_>(), kv_width, att.data<T_>(), lse.data<T_>(), B, cpu::rows_in(keys), NH,
            KV, hd, shard.positions(), keys);
        if (!first) ops::add_inplace<T_>(ctx.exec(), dq.data<T_>(), part_dq.data<T_>(), dq.numel());
        first = false;
      });
}
}  // namespace

void shard_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& qkv, int64_t B,
                             int64_t NH, int64_t KV, int64_t hd, Tensor& q, Tensor& kv,
                             Tensor& att, Tensor& lse) {
  const int64_t Tl = shard.local_length(), T = shard.full_length(), W = qkv.shape().back();
  LOOM_CHECK(qkv.numel() == B * Tl * W && W == (NH + 2 * KV) * hd);
  LOOM_CHECK_MSG(qkv.dtype() == ctx.dtype,
                 "context parallelism's attention takes its qkv at the activations' dtype");
  const int64_t C = NH * hd, kv_width = 2 * KV * hd;
  // On a GPU at bf16 whose flash kernels take these rows: q and kv in bf16 (half the bytes kept
  // and exchanged; the kernels would round them to bf16 as they load them anyway).
  const bool bf16 = ops::attention_rows_take_bf16(ctx.exec(), NH, hd, B, shard.positions());
  const DType kept = bf16 ? DType::kBF16 : qkv.dtype();
  q = Tensor::empty({B, Tl, C}, kept, ctx.device);
  Tensor kv_local = Tensor::empty({B, Tl, kv_width}, kept, ctx.device);
  att = Tensor::empty({B * Tl, C}, ctx.dtype, ctx.device);
  lse = Tensor::empty({B, NH, Tl}, ctx.dtype, ctx.device);
  if (bf16) {
    ops::copy_columns_to_bf16(ctx.exec(), q.raw(), C, qkv.data<float>(), W, B * Tl, C);
    ops::copy_columns_to_bf16(ctx.exec(), kv_local.raw(), kv_width, qkv.data<float>() + C, W,
                              B * Tl, kv_width);
    kv = shard.gather(ctx, kv_local);
    ops::attention_gqa_forward_rows_bf16(ctx.exec(), att.data<float>(), lse.data<float>(), q.raw(),
                                         C, kv.raw(), kv_width, B, T, NH, KV, hd,
                                         shard.positions());
    return;
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::copy_columns<T_>(ctx.exec(), q.data<T_>(), C, qkv.data<T_>(), W, B * Tl, C);
    ops::copy_columns<T_>(ctx.exec(), kv_local.data<T_>(), kv_width, qkv.data<T_>() + C, W,
                          B * Tl, kv_width);
  });
  if (shard.ring()) {  // keep this rank's keys and values only; the others come round
    kv = kv_local;
    dispatch_float(ctx.dtype, [&](auto zero) {
      ring_attention_forward<decltype(zero)>(ctx, shard, q, kv, B, NH, KV, hd, att, lse);
    });
    return;
  }
  kv = shard.gather(ctx, kv_local);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_gqa_forward_rows<T_>(ctx.exec(), att.data<T_>(), lse.data<T_>(), q.data<T_>(),
                                        C, kv.data<T_>(), kv_width, B, T, NH, KV, hd,
                                        shard.positions());
  });
}

Tensor shard_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& q,
                                const Tensor& kv, const Tensor& att, const Tensor& lse,
                                const Tensor& datt, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t B = kv.dim(0), T = kv.dim(1), kv_width = kv.dim(2), C = NH * hd;
  const int64_t Tl = shard.local_length(), W = C + kv_width;
  Tensor dqkv = Tensor::empty({B, Tl, W}, ctx.dtype, ctx.device);
  if (shard.ring()) {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      Tensor dq = Tensor::empty({B, Tl, C}, ctx.dtype, ctx.device);
      const Tensor mine =
          ring_attention_backward<T_>(ctx, shard, q, kv, att, lse, datt, NH, KV, hd, dq);
      ops::copy_columns<T_>(ctx.exec(), dqkv.data<T_>(), W, dq.data<T_>(), C, B * Tl, C);
      ops::copy_columns<T_>(ctx.exec(), dqkv.data<T_>() + C, W, mine.data<T_>(), kv_width, B * Tl,
                            kv_width);
    });
    return dqkv;
  }
  Tensor dkv = Tensor::empty(kv.shape(), ctx.dtype, ctx.device);
  if (kv.dtype() == DType::kBF16) {  // the forward's bf16 q and kv (attention_rows_take_bf16)
    ops::attention_gqa_backward_rows_bf16(ctx.exec(), dqkv.data<float>(), W, dkv.data<float>(),
                                          datt.data<float>(), q.raw(), C, kv.raw(), kv_width,
                                          att.data<float>(), lse.data<float>(), B, T, NH, KV, hd,
                                          shard.positions());
  } else {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::attention_gqa_backward_rows<T_>(ctx.exec(), dqkv.data<T_>(), W, dkv.data<T_>(),
                                           datt.data<T_>(), q.data<T_>(), C, kv.data<T_>(),
                                           kv_width, att.data<T_>(), lse.data<T_>(), B, T, NH, KV,
                                           hd, shard.positions());
    });
  }
  const Tensor mine = shard.reduce_scatter(ctx, dkv);  // (B, Tl, 2·KV·hd)
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::copy_columns<T_>(ctx.exec(), dqkv.data<T_>() + C, W, mine.data<T_>(), kv_width, B * Tl,
                          kv_width);
  });
  return dqkv;
}

}  // namespace loom
