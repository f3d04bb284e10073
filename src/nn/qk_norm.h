// Qwen 3's query/key normalisation (Megatron-LM's --qk-layernorm): an RMSNorm of every query
// head and of every key head, over the head's head_dim values, right after the qkv projection and
// before the rotation. Two head_dim-wide weights (name.q_norm.weight and name.k_norm.weight),
// each shared by all the query (key) heads, initialised to ones. In the full form (OLMo 2's,
// model.qk_norm_scope = "full") one RMSNorm spans all the query heads of a row and one all its key
// heads: weights heads·head_dim and kv_heads·head_dim wide, one value per channel.
//
// It works on the compact qkv rows of grouped-query attention, ((NH + 2·KV)·hd) wide: the query
// heads are gathered into contiguous (rows·NH, hd) rows (ops::copy_columns), normalised by an
// RmsNorm — which keeps that gathered copy as its input for the backward — and written back in
// place; the key heads likewise; the values are left alone. The backward gathers the gradient
// the same way. Under tensor parallelism each rank normalises its own heads with the shared
// weights, so a per-head weight's gradient is the sum over the tp group of the ranks' parts
// (parallel/tensor_parallel_block.h lists them among the parameters summed over tp). The full
// form spans heads a tp rank does not hold: given the tp group as a TensorSplit, its norms are
// SplitRmsNorms (nn/split_rms_norm.h), each rank's weights the shards of its heads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "nn/norm.h"
#include "nn/tensor_split.h"

namespace loom {

class QkNorm {
 public:
  // Per head; or (full) over the `heads` query heads and the `kv_heads` key heads together —
  // with a `split` of more than one rank, this rank's `heads` and `kv_heads` of split->ranks()
  // times as many (the per-head form needs no split). The normalised queries are multiplied by
  // `query_scale` (Gpt2Config::query_scale: Gemma's query_pre_attn_scalar; the rotation after
  // is linear, so the attention's scores scale by it), their gradient likewise.
  QkNorm(ParameterStore& store, const std::string& name, int64_t head_dim, double eps,
         bool full = false, int64_t heads = 0, int64_t kv_heads = 0, TensorSplit* split = nullptr,
         double query_scale = 1);
  // qkv (.., (heads + 2·kv_heads)·head_dim), ctx.dtype: its queries and keys normalised in place.
  void forward(Context& ctx, Tensor& qkv, int64_t heads, int64_t kv_heads);
  // dqkv as qkv, the gradient at the normalised queries and keys: made theirs before it, in
  // place; the weights' gradients added.
  void backward(Context& ctx, Tensor& dqkv, int64_t heads, int64_t kv_heads);
  // The same from a bf16 dqkv (the flash kernels' at bf16, the rotation undone in bf16): widened
  // to fp32 first; returns the fp32 gradient.
  Tensor backward_widening(Context& ctx, const Tensor& dqkv, int64_t heads, int64_t kv_heads);
  void clear_cache() {
    q_->clear_cache();
    k_->clear_cache();
  }
  void collect_cache(std::vector<Tensor*>& out) {
    q_->collect_cache(out);
    k_->collect_cache(out);
  }
  std::vector<Parameter*> parameters() const {
    return {q_->parameters().front(), k_->parameters().front()};
  }
  // Whether its weights are split over a tp group (shards, not summed over it).
  bool split() const { return split_; }

 private:
  Tensor gather(Context& ctx, const Tensor& qkv, int64_t first, int64_t count) const;
  int64_t head_dim_;
  bool full_;
  bool split_;
  double query_scale_;
  std::unique_ptr<Norm> q_, k_;
};

}  // namespace loom
