// Causal multi-head self-attention of GPT-2: a fused qkv projection (C -> 3C), softmax attention
// per head with a causal mask, an output projection (C -> C). The attention kernel keeps only
// the per-row log-sum-exp for backward, not the T×T probabilities.
//
// Llama's (with Rotary): no biases, grouped-query attention — kv_heads key/value heads, each
// shared by n_heads / kv_heads query heads, so qkv is C -> (n_heads + 2·kv_heads)·head_dim — and
// rotary position embeddings (Su et al. 2021, HF transformers' rotate_half pairing) turning the
// queries and keys by their position. The projection's output is turned in place
// (ops::rope_forward) and the attention reads the shared key/value heads where they are
// (ops::attention_gqa_forward; its backward sums each shared head's query heads' gradients), so
// nothing repeated is kept for the backward. Decoding with a cache (decode_adding) stores the keys
// and values repeated per query head (ops::rope_gqa_forward), as the cached attention reads them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/rope.h"
#include "nn/linear.h"
#include "nn/qk_norm.h"

namespace loom {

// The rotary embedding's (T, head_dim) cos/sin tables on ctx's device, in ctx's dtype, shared by
// a model's attention layers: one table for each set of frequencies (Gemma's windowed blocks have
// their own), not one for each block — at 128k positions and heads of 128 a table is 64 MiB in
// f32, 80 blocks' would be 5 GiB. A table is made on the host (cpu::rope_table: in double, then
// rounded, the same values on every device) and copied when a layer first asks for it, and made
// again when T, the device or the dtype change (a module sees one kind of context for its
// lifetime; under context parallelism the rows of its positions in the whole sequence's table).
// Not for several threads at once: one per model (each rank builds its own).
class RotaryTables {
 public:
  const Tensor& get(Context& ctx, int64_t T, int64_t head_dim,
                    const cpu::RopeFrequencies& frequencies);
  int64_t count() const { return static_cast<int64_t>(slots_.size()); }
  int64_t bytes() const;  // of the tables held

 private:
  struct Slot {
    int64_t head_dim;
    cpu::RopeFrequencies frequencies;
    Tensor table;
  };
  std::vector<Slot> slots_;
};

// Llama's attention: key/value heads and the rotary embedding's frequencies.
struct Rotary {
  int64_t kv_heads = 0;
  cpu::RopeFrequencies frequencies;
  bool qkv_bias = false;  // Qwen 2's biases on the queries, keys and values (turned with them)
  int64_t head_dim = 0;   // each head's width; 0: channels / heads
  // Qwen 3's RMSNorm of each query and key head before the rotation (nn/qk_norm.h), with eps.
  // On a GPU at bf16 the attention's kernels then read an fp32 qkv (normalised and turned in
  // fp32; the flash kernels round it as they load it) and their bf16 dqkv is widened for the
  // norms' backward; at fp16 the fp32 attention kernels run.
  bool qk_norm = false;
  double norm_eps = 1e-5;
  int64_t sliding_window = 0;  // each query's W latest keys only (nn/sliding_window.h); 0: all
  bool qk_norm_full = false;   // OLMo 2's form: over all the query (key) heads together
  double query_scale = 1;      // the query norm's output times this (QkNorm; Gemma 3 27B's)
  // The model's tables, shared by its blocks; null: the layer makes its own.
  std::shared_ptr<RotaryTables> tables = nullptr;
};

class CausalSelfAttention {
 public:
  CausalSelfAttention(ParameterStore& store, const std::string& name, int64_t channels,
                      int64_t heads, float init_std, float proj_std,
                      std::optional<Rotary> rotary = std::nullopt);
  Tensor forward(Context& ctx, const Tensor& x);    // x: (B, T, C)
  // forward + residual (B, T, C), the block's skip connection added by the output projection.
  Tensor forward_adding(Context& ctx, const Tensor& x, const Tensor& residual);
  Tensor backward(Context& ctx, const Tensor& dy);  // dy: (B, T, C)
  void clear_cache();
  // Incremental decoding (sampling): x (1, n, C) are the tokens at positions first ..
  // first+n−1; their keys and values (turned and repeated with Rotary) go into rows first .. of
  // keys and values, (max_seq_len, NH·hd), which hold the earlier positions'; returns
  // proj(attention over rows 0 .. first+n−1) + residual (null: none, as post-norms add it after
  // their norm). Keeps nothing for a backward.
  Tensor decode_adding(Context& ctx, const Tensor& x, const Tensor* residual, Tensor& keys,
                       Tensor& values, int64_t first);
  // Selective recomputation (models/gpt2.h): the qkv projection's cached input is the owner's
  // LayerNorm output, which the owner drops after forward and rebuilds before backward.
  void drop_input() { qkv_.drop_input(); }
  void restore_input(const Tensor& x) { qkv_.restore_input(x); }
  void collect_cache(std::vector<Tensor*>& out) {
    qkv_.collect_cache(out);
    proj_.collect_cache(out);
    if (qk_norm_) qk_norm_->collect_cache(out);
    out.insert(out.end(), {&qkv_out_, &kv_full_, &att_, &lse_, &documents_});
  }

 private:
  Tensor attend(Context& ctx, const Tensor& x);  // qkv and attention: proj's input
  Tensor attend_rotary(Context& ctx, const Tensor& x);
  Tensor backward_rotary(Context& ctx, const Tensor& dy);
  // Context parallelism (ctx.sequence): this rank's query rows over the gathered sequence.
  Tensor attend_shard(Context& ctx, const Tensor& x);
  Tensor backward_shard(Context& ctx, const Tensor& dy);
  // The qkv projection's output in fp32 (ctx.dtype), its queries and keys normalised and
  // turned: with Rotary, before attention.
  Tensor project_turned(Context& ctx, const Tensor& x);
  int64_t channels_, heads_;
  int64_t head_dim_;  // channels / heads, or Rotary::head_dim
  int64_t width_;     // heads·head_dim: the attention's output, proj's input
  std::optional<Rotary> rotary_;
  std::shared_ptr<RotaryTables> tables_;  // with Rotary: its cos/sin tables (shared)
  Linear qkv_;
  Linear proj_;
  std::optional<QkNorm> qk_norm_;
  Tensor qkv_out_;  // (B, T, 3C); with Rotary (B, T, (NH + 2·KV)·hd), q and k turned; with
                    // context parallelism the queries alone, (B, T, NH·hd)
  Tensor kv_full_;  // context parallelism: the whole sequence's keys and values, gathered
  Tensor att_;      // (B, T, NH·hd) attention output before proj
  Tensor lse_;      // (B, NH, T)
  Tensor documents_;  // document masking: the forward's ctx.documents, for the backward; with a
                      // sliding window and no documents the window's table
  Tensor window_;     // with a sliding window: its own table (nn/sliding_window.h), kept
};

}  // namespace loom
