#include "nn/qk_norm.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/split_rms_norm.h"
#include "tensor/dispatch.h"

namespace loom {

namespace {
std::unique_ptr<Norm> make_rms_norm(ParameterStore& store, const std::string& name,
                                    int64_t channels, double eps, TensorSplit* split) {
  if (split == nullptr) return make_norm(store, name, channels, /*rms=*/true, eps);
  return std::make_unique<SplitRmsNorm>(store, name, channels * split->ranks(), eps, *split);
}
}  // namespace

QkNorm::QkNorm(ParameterStore& store, const std::string& name, int64_t head_dim, double eps,
               bool full, int64_t heads, int64_t kv_heads, TensorSplit* split, double query_scale)
    : head_dim_(head_dim),
      full_(full),
      split_(full && split != nullptr && split->ranks() > 1),
      query_scale_(query_scale) {
  LOOM_CHECK(!full || (heads > 0 && kv_heads > 0));
  TensorSplit* rows_split = split_ ? split : nullptr;
  q_ = make_rms_norm(store, name + ".q_norm", full ? heads * head_dim : head_dim, eps, rows_split);
  k_ = make_rms_norm(store, name + ".k_norm", full ? kv_heads * head_dim : head_dim, eps,
                     rows_split);
}

namespace {
// The heads [first, first + count) of every qkv row, gathered into (rows·count, hd), or written
// back from such rows.
Tensor gather_heads(Context& ctx, const Tensor& qkv, int64_t first, int64_t count, int64_t hd) {
  const int64_t width = qkv.dim(-1), rows = qkv.numel() / width;
  Tensor out = Tensor::empty({rows * count, hd}, qkv.dtype(), qkv.device());
  dispatch_float(qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ops::copy_columns<T>(ctx.exec(), out.data<T>(), count * hd, qkv.data<T>() + first * hd, width,
                         rows, count * hd);
  });
  return out;
}
void scatter_heads(Context& ctx, Tensor& qkv, const Tensor& heads, int64_t first, int64_t count,
                   int64_t hd) {
  const int64_t width = qkv.dim(-1), rows = qkv.numel() / width;
  dispatch_float(qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ops::copy_columns<T>(ctx.exec(), qkv.data<T>() + first * hd, width, heads.data<T>(), count * hd,
                         rows, count * hd);
  });
}
void check_width(const Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t hd) {
  // (backward_widening takes bf16 and widens it first.)
  if (qkv.dim(-1) != (heads + 2 * kv_heads) * hd || qkv.dtype() == DType::kBF16 ||
      qkv.dtype() == DType::kF16)
    fail("qk_norm: qkv ", shape_str(qkv.shape()), " is not ", heads, " + 2·", kv_heads,
         " heads of ", hd, " in a float type");
}
}  // namespace

// The heads [first, first + count) of every row, as (rows·count, hd) rows for the per-head
// norm or (rows, count·hd) for the full one: the same bytes.
Tensor QkNorm::gather(Context& ctx, const Tensor& qkv, int64_t first, int64_t count) const {
  Tensor heads = gather_heads(ctx, qkv, first, count, head_dim_);
  return full_ ? heads.reshape({heads.numel() / (count * head_dim_), count * head_dim_}) : heads;
}

void QkNorm::forward(Context& ctx, Tensor& qkv, int64_t heads, int64_t kv_heads) {
  check_width(qkv, heads, kv_heads, head_dim_);
  Tensor q = q_->forward(ctx, gather(ctx, qkv, 0, heads));
  scale_in_place(ctx, q, query_scale_);
  scatter_heads(ctx, qkv, q, 0, heads, head_dim_);
  scatter_heads(ctx, qkv, k_->forward(ctx, gather(ctx, qkv, heads, kv_heads)), heads, kv_heads,
                head_dim_);
}

void QkNorm::backward(Context& ctx, Tensor& dqkv, int64_t heads, int64_t kv_heads) {
  check_width(dqkv, heads, kv_heads, head_dim_);
  Tensor dq = gather(ctx, dqkv, 0, heads);
  scale_in_place(ctx, dq, query_scale_);
  scatter_heads(ctx, dqkv, q_->backward(ctx, dq), 0, heads, head_dim_);
  scatter_heads(ctx, dqkv, k_->backward(ctx, gather(ctx, dqkv, heads, kv_heads)), heads, kv_heads,
                head_dim_);
}

Tensor QkNorm::backward_widening(Context& ctx, const Tensor& dqkv, int64_t heads,
                                 int64_t kv_heads) {
  LOOM_CHECK(dqkv.dtype() == DType::kBF16);
  Tensor wide = Tensor::empty(dqkv.shape(), DType::kF32, dqkv.device());
  ops::widen_bf16(ctx.exec(), wide.data<float>(), dqkv.data_u16(), dqkv.numel());
  backward(ctx, wide, heads, kv_heads);
  return wide;
}

}  // namespace loom
