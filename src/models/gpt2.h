// GPT-2 (Radford et al. 2019), exactly: token + learned position embedding, pre-LayerNorm blocks
// (causal self-attention with bias, 4× MLP with tanh-GELU), a final LayerNorm and an LM head tied
// to the token embedding; no dropout.
//
// Shapes: B = batch, T = sequence length, C = d_model, V = vocab, N = B·T.
// The model is pure math: it knows nothing of ranks or communication (parallel/ wraps it).
#pragma once

#include <memory>
#include <vector>

#include "nn/causal_self_attention.h"
#include "nn/embedding.h"
#include "nn/layer_norm.h"
#include "nn/mlp.h"

namespace loom {

struct Gpt2Config {
  int64_t vocab_size = 256;
  int64_t max_seq_len = 64;  // rows of the position embedding
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  float init_std = 0.02f;
  // Activation recomputation: keep only each block's input in forward; re-run the block's
  // forward right before its backward. Same numbers, bitwise; less memory, ~1/3 more compute.
  bool recompute = false;

  void validate() const;  // throws loom::Error naming the offending field
  int64_t num_parameters() const;
};

// One pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·)).
class Gpt2Block {
 public:
  Gpt2Block(ParameterStore& store, const std::string& name, const Gpt2Config& config);
  Tensor forward(Context& ctx, const Tensor& x);  // (B, T, C) -> (B, T, C)
  Tensor backward(Context& ctx, const Tensor& dy);
  void clear_cache();

 private:
  Tensor run_forward(Context& ctx, const Tensor& x);
  bool recompute_;
  LayerNorm ln_1_;
  CausalSelfAttention attn_;
  LayerNorm ln_2_;
  Mlp mlp_;
  Tensor input_;  // kept for recomputation
};

class Gpt2 {
 public:
  // Parameter units (nn/hooks.h): the root (embeddings, final LayerNorm), then one per block.
  static constexpr size_t kRootUnit = 0;
  static constexpr size_t kFirstBlockUnit = 1;

  explicit Gpt2(const Gpt2Config& config);

  const Gpt2Config& config() const { return config_; }
  ParameterStore& params() { return params_; }
  // Allocates parameters (dtype f32 for training, f64 for gradient checks) and initialises them
  // from (seed, parameter name, element index).
  void build(DType dtype, Device device, uint64_t seed);

  // Mean cross-entropy of next-token prediction over all B·T positions. tokens, targets: (B, T)
  // i32. Caches activations for backward.
  double forward(Context& ctx, const Tensor& tokens, const Tensor& targets);
  // Accumulates into the parameter gradients the gradient of `scale` × the last forward's mean
  // loss (scale = 1 / micro-batches for gradient accumulation). Frees the cached activations.
  void backward(Context& ctx, double scale = 1.0);
  // Logits (B, T, V) without caching anything: for sampling and evaluation.
  Tensor logits(Context& ctx, const Tensor& tokens);
  void clear_cache();

 private:
  Tensor trunk(Context& ctx, const Tensor& tokens);  // embedding, blocks, ln_f -> (B, T, C)

  Gpt2Config config_;
  ParameterStore params_;
  std::unique_ptr<Embedding> embedding_;
  std::vector<std::unique_ptr<Gpt2Block>> blocks_;
  std::unique_ptr<LayerNorm> ln_f_;
  // Cached for backward.
  Tensor final_;    // (N, C) ln_f output
  Tensor dlogits_;  // (N, V): holds logits after forward, turned into their gradient in backward
  Tensor lse_;      // (N)
  Tensor targets_;
};

}  // namespace loom
