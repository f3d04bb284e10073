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
  void collect_cache(std::vector<Tensor*>& out);

 private:
  Tensor run_forward(Context& ctx, const Tensor& x);
  bool recompute_;
  LayerNorm ln_1_;
  CausalSelfAttention attn_;
  LayerNorm ln_2_;
  Mlp mlp_;
  Tensor input_;  // kept for recomputation
};

// Which part of the network a Gpt2 object holds (pipeline stages hold parts): blocks
// [first_block, end_block) (end_block −1: to the last), and whether it begins with the embedding
// and ends with the final LayerNorm + LM head + loss. The default is the whole model.
struct Gpt2Part {
  int64_t first_block = 0;
  int64_t end_block = -1;
  bool embedding = true;
  bool head = true;
};

class Gpt2 {
 public:
  // Parameter units (nn/hooks.h): the root (embeddings and final LayerNorm, when the part has
  // either end), then one per block.
  explicit Gpt2(const Gpt2Config& config, const Gpt2Part& part = {});

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

  // A part's forward: `input` is tokens (B, T) i32 when the part has the embedding, else the
  // previous part's output (B, T, C). With the head, sets *loss (mean over positions; targets
  // (B, T) i32) and returns an undefined tensor; else returns the output (B, T, C).
  Tensor forward_part(Context& ctx, const Tensor& input, const Tensor& targets, double* loss);
  // A part's backward: `dy` is the gradient of the output (ignored with the head, which starts
  // from scale × its loss). Returns the gradient of the input (undefined with the embedding).
  Tensor backward_part(Context& ctx, const Tensor& dy, double scale);
  // Moves out / back in every tensor forward keeps for backward, so that several micro-batches
  // can be in flight (pipeline schedules): stash after a forward, unstash before its backward.
  std::vector<Tensor> stash_activations();
  void unstash_activations(std::vector<Tensor> stash);
  const Gpt2Part& part() const { return part_; }
  // The LM head's weight (the tied wte; its own copy in a part without the embedding).
  Parameter* head_weight() const { return head_wte_; }

 private:
  Tensor run_blocks(Context& ctx, Tensor x);
  double head_forward(Context& ctx, const Tensor& x, const Tensor& targets);
  void before_forward_root(Context& ctx);
  void after_forward_root(Context& ctx);
  std::vector<Tensor*> cache_slots();

  Gpt2Config config_;
  Gpt2Part part_;
  ParameterStore params_;
  int root_unit_ = -1;        // -1: this part has no root unit
  size_t first_block_unit_ = 0;
  std::unique_ptr<Embedding> embedding_;
  Parameter* head_wte_ = nullptr;
  std::vector<std::unique_ptr<Gpt2Block>> blocks_;
  std::unique_ptr<LayerNorm> ln_f_;
  // Cached for backward.
  Tensor final_;    // (N, C) ln_f output
  Tensor dlogits_;  // (N, V): holds logits after forward, turned into their gradient in backward
  Tensor lse_;      // (N)
  Tensor targets_;
};

}  // namespace loom
