#include "nn/embedding.h"

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/sequence_shard.h"
#include "tensor/dispatch.h"

namespace loom {

Tensor document_position_ids(Context& ctx, int64_t B, int64_t Tl, int64_t table_rows) {
  if (!ctx.reset_position_ids || ctx.documents == nullptr) return Tensor();
  const Tensor& starts = *ctx.documents;
  const int64_t T = starts.dim(1);
  LOOM_CHECK(starts.dim(0) == B && (ctx.sequence != nullptr || T == Tl));
  if (T > table_rows)
    fail("sequence length ", T, " exceeds the position embedding's ", table_rows, " rows");
  Tensor global;  // a context-parallel shard's positions of the whole sequence, in its order
  if (ctx.sequence != nullptr) {
    LOOM_CHECK(ctx.sequence->local_length() == Tl);
    Tensor on_host = Tensor::empty({Tl}, DType::kI32, Device::cpu());
    int32_t* g = on_host.data<int32_t>();
    for (const cpu::RowRange& r : ctx.sequence->positions())
      for (int64_t p = r.begin; p < r.end; ++p) *g++ = static_cast<int32_t>(p);
    global = ctx.device.is_cpu() ? on_host : on_host.to_queued(ctx.device);
  }
  Tensor ids = Tensor::empty({B, Tl}, DType::kI32, ctx.device);
  ops::document_positions(ctx.exec(), ids.data<int32_t>(), starts.data<int32_t>(),
                          global.defined() ? global.data<int32_t>() : nullptr, B, Tl, T);
  return ids;
}

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
  if (wpe_ != nullptr) position_ids_ = document_position_ids(ctx, tokens.dim(0), T, max_seq_);
  if (position_ids_.defined()) {  // each token's place in its document: its row of wpe added
    Tensor out = lookup(ctx, tokens, Tensor());
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::add_rows_by_id<T_>(ctx.exec(), out.data<T_>(), wpe_->value.data<T_>(),
                              position_ids_.data<int32_t>(), tokens.numel(), channels_);
    });
    return out;
  }
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
  // A context-parallel shard's positions take their gradient apart, then add it to their rows;
  // positions reset at each document add theirs to the rows they read (ids taken as tokens).
  const bool by_id = position_ids_.defined();
  const bool shard = ctx.sequence != nullptr && wpe_ != nullptr && !by_id;
  Tensor dpositions = shard ? Tensor::zeros({T, channels_}, ctx.dtype, ctx.device) : Tensor();
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::embedding_backward<T_>(ctx.exec(), wte_->grad.data<T_>(),
                                shard            ? dpositions.data<T_>()
                                : wpe_ && !by_id ? wpe_->grad.data<T_>()
                                                 : nullptr,
                                dy.data<T_>(), tokens_.data<int32_t>(), B, T, channels_);
    if (by_id)
      ops::embedding_backward<T_>(ctx.exec(), wpe_->grad.data<T_>(), nullptr, dy.data<T_>(),
                                  position_ids_.data<int32_t>(), 1, B * T, channels_);
  });
  if (shard) add_rows_into(ctx.exec(), wpe_->grad, dpositions, ctx.sequence->positions());
  tokens_ = Tensor();
  position_ids_ = Tensor();
}

}  // namespace loom
