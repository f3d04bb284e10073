#include "nn/sliding_window.h"

#include <algorithm>

#include "nn/sequence_shard.h"

namespace loom {

void fold_sliding_window(int32_t* starts, int64_t B, int64_t T, int64_t window) {
  if (window <= 0) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = window; t < T; ++t) {
      int32_t& s = starts[b * T + t];
      s = std::max(s, static_cast<int32_t>(t - window + 1));
    }
}

const Tensor& sliding_window_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T,
                                    int64_t window) {
  if (cached.defined() && cached.dim(0) == B && cached.dim(1) == T &&
      cached.device() == ctx.device)
    return cached;
  Tensor host = Tensor::zeros({B, T}, DType::kI32, Device::cpu());
  fold_sliding_window(host.data<int32_t>(), B, T, window);
  cached = ctx.device.is_cpu() ? host : host.to(ctx.device);
  return cached;
}

Tensor attention_starts(Context& ctx, Tensor& cached, int64_t B, int64_t T, int64_t window) {
  if (ctx.documents != nullptr || window <= 0) return documents_of(ctx);
  const int64_t whole = ctx.sequence != nullptr ? ctx.sequence->full_length() : T;
  return sliding_window_starts(ctx, cached, B, whole, window);
}

}  // namespace loom
