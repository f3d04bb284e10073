#include "nn/sliding_window.h"

#include "kernels/ops.h"
#include "nn/sequence_shard.h"

namespace loom {

const Tensor& sliding_window_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T,
                                    int64_t window) {
  if (cached.defined() && cached.dim(0) == B && cached.dim(1) == T &&
      cached.device() == ctx.device)
    return cached;
  cached = Tensor::empty({B, T}, DType::kI32, ctx.device);
  ops::window_starts(ctx.exec(), cached.data<int32_t>(), nullptr, B, T, window);
  return cached;
}

Tensor attention_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T, int64_t window) {
  if (window <= 0) return documents_of(ctx);
  if (ctx.documents == nullptr) {
    const int64_t whole = ctx.sequence != nullptr ? ctx.sequence->full_length() : T;
    return sliding_window_starts(ctx, cached, B, whole, window);
  }
  // The micro-batch's documents with the window: this block's own table (others may see the
  // documents whole), kept by the attention for its backward.
  const Tensor& documents = *ctx.documents;
  Tensor both = Tensor::empty(documents.shape(), DType::kI32, ctx.device);
  ops::window_starts(ctx.exec(), both.data<int32_t>(), documents.data<int32_t>(), documents.dim(0),
                     documents.dim(1), window);
  return both;
}

}  // namespace loom
