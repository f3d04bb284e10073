#include "nn/embedding.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/sequence_shard.h"
#include "tensor/dispatch.h"

namespace loom {

Embedding::Embedding(ParameterStore& store, int64_t vocab, int64_t max_seq, int64_t channels,
                     float init_std)
    : vocab_(vocab), max_seq_(max_seq), channels_(channels) {
  wte_ = store.add("wte.weight", {vocab, channels}, InitKind::kNormal, init_std);
  if (max_seq > 0) wpe_ = store.add("wpe.weight", {max_seq, channels}, InitKind::kNormal, init_std);
}

Tensor Embedding::forward(Context& ctx, const Tensor& tokens) {
  if (tokens.ndim() != 2 || tokens.dtype() != DType::kI32)
    fail("embedding expects (B, T) i32 tokens, got ", shape_str(tokens.shape()), " ",
         dtype_name(tokens.dtype()));
  const int64_t T = tokens.dim(1);
  if (wpe_ != nullptr && T > max_seq_)
    fail("sequence length ", T, " exceeds the position embedding's ", max_seq_, " rows");
  tokens_ = tokens;
  if (ctx.sequence != nullptr && wpe_ != nullptr) {
    // A context-parallel shard: its positions' rows of wpe, gathered (nn/sequence_shard.h).
    LOOM_CHECK(T == ctx.sequence->local_length());
    return lookup(ctx, tokens, rows_of(wpe_->value, ctx.sequence->positions()));
  }
  return forward_at(ctx, tokens, 0);
}

Tensor Embedding::forward_at(Context& ctx, const Tensor& tokens, int64_t first) {
  if (tokens.ndim() != 2 || tokens.dtype() != DType::kI32)
    fail("embedding expects (B, T) i32 tokens, got ", shape_str(tokens.shape()));
  const int64_t T = tokens.dim(1);
  if (wpe_ != nullptr && first + T > max_seq_)
    fail("positions up to ", first + T, " exceed the position embedding's ", max_seq_, " rows");
  return lookup(ctx, tokens, wpe_ ? wpe_->value.narrow(first, T) : Tensor());
}

Tensor Embedding::lookup(Context& ctx, const Tensor& tokens, const Tensor& positions) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1);
  Tensor out = Tensor::empty({B, T, channels_}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::embedding_forward<T_>(ctx.exec(), out.data<T_>(), tokens.data<int32_t>(),
                               wte_->value.data<T_>(),
                               positions.defined() ? positions.data<T_>() : nullptr, B, T,
                               channels_, vocab_);
  });
  return out;
}

void Embedding::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(tokens_.defined());
  const int64_t B = tokens_.dim(0), T = tokens_.dim(1);
  // A context-parallel shard's positions take their gradient apart, then add it to their rows.
  const bool shard = ctx.sequence != nullptr && wpe_ != nullptr;
  Tensor dpositions = shard ? Tensor::zeros({T, channels_}, ctx.dtype, ctx.device) : Tensor();
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::embedding_backward<T_>(ctx.exec(), wte_->grad.data<T_>(),
                                shard  ? dpositions.data<T_>()
                                : wpe_ ? wpe_->grad.data<T_>()
                                       : nullptr,
                                dy.data<T_>(), tokens_.data<int32_t>(), B, T, channels_);
  });
  if (shard) add_rows_into(ctx.exec(), wpe_->grad, dpositions, ctx.sequence->positions());
  tokens_ = Tensor();
}

}  // namespace loom
