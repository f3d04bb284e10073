#include "nn/sequence_shard.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/context.h"
#include "tensor/dispatch.h"

namespace loom {

Tensor rows_of(const Tensor& table, const std::vector<cpu::RowRange>& positions) {
  LOOM_CHECK(table.ndim() == 2);
  Tensor out = Tensor::empty({cpu::rows_in(positions), table.dim(1)}, table.dtype(), table.device());
  int64_t at = 0;
  for (const cpu::RowRange& r : positions) {
    if (r.end > table.dim(0))
      fail("positions up to ", r.end, " exceed the table's ", table.dim(0), " rows");
    out.narrow(at, r.size()).copy_from(table.narrow(r.begin, r.size()));
    at += r.size();
  }
  return out;
}

void add_rows_into(Tensor& table, const Tensor& rows, const std::vector<cpu::RowRange>& positions) {
  LOOM_CHECK(table.ndim() == 2 && rows.ndim() == 2 && rows.dim(1) == table.dim(1) &&
             rows.dim(0) == cpu::rows_in(positions) && rows.dtype() == table.dtype());
  LOOM_CHECK_MSG(table.device().is_cpu() && rows.device().is_cpu(),
                 "context parallelism runs on CPU ranks");
  const int64_t W = table.dim(1);
  dispatch_float(table.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* src = rows.data<T>();
    for (const cpu::RowRange& r : positions) {
      T* dst = table.data<T>() + r.begin * W;
      for (int64_t i = 0; i < r.size() * W; ++i) dst[i] += src[i];
      src += r.size() * W;
    }
  });
}

void shard_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& local, int64_t B,
                             int64_t NH, int64_t KV, int64_t hd, Tensor& full, Tensor& att,
                             Tensor& lse) {
  const int64_t Tl = shard.local_length(), T = shard.full_length(), W = local.shape().back();
  LOOM_CHECK(local.numel() == B * Tl * W && W == (NH + 2 * KV) * hd);
  LOOM_CHECK_MSG(local.dtype() == ctx.dtype, "context parallelism runs at fp32 activations");
  full = shard.gather(ctx, local.reshape({B, Tl, W}));
  att = Tensor::empty({B * Tl, NH * hd}, ctx.dtype, ctx.device);
  lse = Tensor::empty({B, NH, Tl}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_gqa_forward_rows<T_>(ctx.exec(), att.data<T_>(), lse.data<T_>(),
                                        full.data<T_>(), B, T, NH, KV, hd, shard.positions());
  });
}

Tensor shard_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& full,
                                const Tensor& att, const Tensor& lse, const Tensor& datt,
                                const Shape& local_shape, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t B = full.dim(0), T = full.dim(1);
  Tensor dfull = Tensor::empty(full.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_gqa_backward_rows<T_>(ctx.exec(), dfull.data<T_>(), datt.data<T_>(),
                                         full.data<T_>(), att.data<T_>(), lse.data<T_>(), B, T,
                                         NH, KV, hd, shard.positions());
  });
  return shard.reduce_scatter(ctx, dfull).reshape(local_shape);
}

}  // namespace loom
