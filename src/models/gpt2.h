// GPT-2 (Radford et al. 2019), exactly: token + learned position embedding, pre-LayerNorm blocks
// (causal self-attention with bias, 4× MLP with tanh-GELU), a final LayerNorm and an LM head tied
// to the token embedding; no dropout.
//
// The same decoder-only transformer in Llama's form (Touvron et al. 2023; Arch::kLlama): no
// position table (rotary embeddings turn queries and keys in attention), RMSNorm instead of
// LayerNorm, a SwiGLU MLP, no biases, grouped-query attention (n_kv_heads key/value heads).
// Parameter names are the same as GPT-2's where the part exists ("blocks.3.ln_1.weight" is an
// RMSNorm's there). Either form's LM head is tied to the token embedding (GPT-2, Llama 3.2 1B/3B)
// or, with tie_embeddings = false, a weight of its own, lm_head.weight (Llama 2/3 8B and up).
//
// Shapes: B = batch, T = sequence length, C = d_model, V = vocab, N = B·T.
// The model is pure math: it knows nothing of ranks or communication (parallel/ wraps it).
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "base/check.h"
#include "kernels/cpu/rope.h"
#include "kernels/gated_activation.h"
#include "nn/causal_self_attention.h"
#include "nn/embedding.h"
#include "nn/expert_exchange.h"
#include "nn/layer_norm.h"
#include "nn/mlp.h"
#include "nn/moe_mlp.h"
#include "nn/norm.h"

namespace loom {

// Activation recomputation (config key parallel.recompute), per transformer block; every mode
// gives bitwise the same numbers (same kernels on the same inputs), they trade memory for compute:
//   kNone       keep every activation backward needs.
//   kFull       keep only the block's input; re-run the whole block forward right before its
//               backward (~1/3 more compute: one more forward; with tensor parallelism its
//               collectives too).
//   kSelective  keep matmul and attention outputs, drop the cheap element-wise ones — the two
//               LayerNorm outputs and the GELU output — and recompute them from what is kept
//               anyway (LayerNorm input, mean and rstd; the fc output) right before backward needs
//               them: no extra matmul. With sequence parallelism the LayerNorm outputs dropped
//               are this rank's rows (the column-parallel layers gather them in backward
//               anyway). Post-norm blocks (OLMo 2) have no norm output to drop: the GELU's
//               (SwiGLU's) alone.
enum class Recompute { kNone, kFull, kSelective };

// "none" | "full" | "selective"; throws loom::Error listing them for anything else.
Recompute parse_recompute(const std::string& name);
const char* recompute_name(Recompute mode);

enum class Arch { kGpt2, kLlama };
// "gpt2" | "llama"; throws loom::Error listing them for anything else.
Arch parse_arch(const std::string& name);
const char* arch_name(Arch arch);

struct Gpt2Config {
  Arch arch = Arch::kGpt2;
  int64_t vocab_size = 256;
  int64_t max_seq_len = 64;  // rows of the position embedding
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  float init_std = 0.02f;
  Recompute recompute = Recompute::kNone;  // activation recomputation per block (above)
  // false: the LM head's own weight, lm_head.weight (V × C), instead of the token embedding's.
  bool tie_embeddings = true;
  // Llama only (resolved: never 0 there):
  int64_t n_kv_heads = 0;   // key/value heads, dividing n_heads
  bool qkv_bias = false;    // the qkv projection's bias (Qwen 2's); GPT-2's attention has it anyway
  int64_t head_width = 0;   // model.head_dim: each head's width; 0: d_model / n_heads
  bool qk_norm = false;     // RMSNorm of each query and key head (Qwen 3's; nn: Rotary::qk_norm)
  // model.qk_norm_scope = "full": of all the query heads together, all the key heads together
  bool qk_norm_full = false;
  // model.query_pre_attn_scalar: the scores scaled by 1/√ of it instead of 1/√head_dim (Gemma's);
  // 0: head_dim. With qk_norm only: the query norm's output is multiplied by query_scale().
  int64_t query_pre_attn_scalar = 0;
  // model.norm_placement = "post": x + norm(attn(x)), then + norm(mlp(·)) (OLMo 2's)
  bool post_norm = false;
  // model.norm_placement = "sandwich": x + norm(attn(norm(x))), then + norm(mlp(norm(·))) (Gemma
  // 2 / 3's four norms a block; Peri-LN)
  bool sandwich_norm = false;
  // model.ffn_activation: the gated MLP's gate activation, SiLU (SwiGLU) or the tanh GELU (GeGLU,
  // Gemma's)
  GatedActivation ffn_activation = GatedActivation::kSilu;
  // model.embedding_multiplier: the token embedding's rows times this as they enter the blocks
  // (Gemma's √d_model, Granite's embedding_multiplier); the tied head reads the rows unscaled.
  float embedding_multiplier = 1.0f;
  int64_t sliding_window = 0;  // each query's W latest keys (nn/sliding_window.h); 0: all
  int64_t full_attention_every = 0;  // with a window: blocks N, 2N, … (1-based) unwindowed; 0: none
  int64_t ffn_hidden = 0;   // the SwiGLU's hidden width
  double rope_theta = 10000;
  // Llama 3.1's scaling of the rotary frequencies (cpu::RopeFrequencies); factor 0: none. With
  // rope_scaling_linear, the factor divides every frequency instead (model.rope_scaling =
  // "linear"; Gemma 3 4B+'s, in its whole-sequence blocks).
  double rope_scaling_factor = 0;
  bool rope_scaling_linear = false;
  // model.rope_local_theta: the windowed blocks' rotary base, unscaled (Gemma 3's
  // rope_local_base_freq: 10 000 in its sliding-window blocks, rope_theta in the others); 0: none.
  double rope_local_theta = 0;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int64_t rope_original_max_seq_len = 8192;
  double norm_eps = 1e-5;
  // Llama only: a mixture of moe_experts SwiGLU MLPs in each block, moe_top_k of them per token,
  // with the per-sequence balance loss weighed by moe_aux_loss_coef (nn/moe_mlp.h); 0: dense.
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;
  float moe_aux_loss_coef = 0.01f;
  float moe_router_z_loss_coef = 0;  // ST-MoE's router z-loss (nn/moe_mlp.h: MoeLosses)
  int64_t moe_shared_experts = 0;    // shared experts, every token's (nn/moe_mlp.h: MoeShape)
  MoeCapacity moe_capacity;          // each expert's per sequence (nn/moe_capacity.h); dropless
  RouterScore moe_router_score = RouterScore::kSoftmax;  // nn/moe_mlp.h
  int64_t moe_router_groups = 1;  // group-limited routing (MoeShape::router_groups); 1: none
  int64_t moe_router_group_topk = 1;
  double moe_router_topk_scaling_factor = 1;  // the routing weights' factor
  bool moe_router_norm_topk_prob = true;      // false: the chosen scores not normalised

  cpu::RopeFrequencies rope_frequencies() const {
    return {rope_theta,
            rope_scaling_factor,
            rope_low_freq_factor,
            rope_high_freq_factor,
            static_cast<double>(rope_original_max_seq_len),
            rope_scaling_linear};
  }

  bool llama() const { return arch == Arch::kLlama; }
  bool moe() const { return llama() && moe_experts > 0; }
  // A mixture's shape and losses (nn/moe_mlp.h), from the moe_ keys.
  MoeShape moe_shape() const {
    return {d_model,
            ffn_hidden,
            moe_experts,
            moe_top_k,
            moe_shared_experts,
            moe_capacity,
            moe_router_score,
            moe_router_groups,
            moe_router_group_topk,
            moe_router_topk_scaling_factor,
            moe_router_norm_topk_prob};
  }
  MoeLosses moe_losses() const { return {moe_aux_loss_coef, moe_router_z_loss_coef}; }
  // The length of the step's expert counts (Gpt2Stage::add_expert_tokens): n_layers × experts
  // and the pairs dropped; 0 when dense.
  size_t expert_counts_size() const {
    return moe() ? static_cast<size_t>(n_layers * moe_experts + 1) : 0;
  }
  int64_t head_dim() const { return head_width > 0 ? head_width : d_model / n_heads; }
  // The attention's scale as a factor on the queries: √(head_dim / query_pre_attn_scalar), so that
  // the kernels' 1/√head_dim makes 1/√query_pre_attn_scalar; 1 without it.
  double query_scale() const {
    return query_pre_attn_scalar > 0 ? std::sqrt(static_cast<double>(head_dim()) /
                                                 static_cast<double>(query_pre_attn_scalar))
                                     : 1.0;
  }
  // A block's query/key norm weights: two head_dim-wide, or (qk_norm_full) the queries' and the
  // keys' whole widths.
  int64_t qk_norm_params() const {
    if (!qk_norm) return 0;
    return qk_norm_full ? (n_heads + kv_heads()) * head_dim() : 2 * head_dim();
  }
  // Block `layer`'s sliding window (0-based; 0: the whole past): sliding_window, but in every
  // full_attention_every-th block (Gemma 3's 6, GPT-OSS's 2, Megatron-LM's
  // --window-attn-skip-freq).
  int64_t window_of(int64_t layer) const {
    const bool full = full_attention_every > 0 && (layer + 1) % full_attention_every == 0;
    return full ? 0 : sliding_window;
  }
  // The config block `layer` is built with: its own window (and with rope_local_theta, a
  // windowed block's own rotary base, without scaling).
  Gpt2Config block(int64_t layer) const {
    Gpt2Config c = *this;
    c.sliding_window = window_of(layer);
    if (c.sliding_window > 0 && rope_local_theta > 0) {
      c.rope_theta = rope_local_theta;
      c.rope_scaling_factor = 0;
      c.rope_scaling_linear = false;
    }
    c.rope_local_theta = 0;
    c.full_attention_every = 0;
    return c;
  }
  // The queries' width, and the attention output's (the output projection's input):
  // n_heads·head_dim, d_model unless head_width says otherwise.
  int64_t attention_width() const { return n_heads * head_dim(); }
  int64_t kv_heads() const { return llama() ? n_kv_heads : n_heads; }
  int64_t hidden() const { return llama() ? ffn_hidden : 4 * d_model; }  // the MLP's width
  // The qkv projection's outputs: 3·d_model, or with grouped-query attention
  // (n_heads + 2·n_kv_heads)·head_dim.
  int64_t qkv_width() const { return attention_width() + 2 * kv_heads() * head_dim(); }
  // Whether qkv has a bias: GPT-2's always, Llama's with qkv_bias (the output projection's and
  // the MLP's: GPT-2's only).
  bool has_qkv_bias() const { return !llama() || qkv_bias; }
  // Rows of the learned position table: max_seq_len (GPT-2) or none (Llama).
  int64_t position_rows() const { return llama() ? 0 : max_seq_len; }

  void validate() const;  // throws loom::Error naming the offending field
  int64_t num_parameters() const;
  // Training flops per token at sequence length T, the count MFU is measured with (PaLM's, as
  // nanoGPT and llm.c use it): 6 per weight in a matrix product (forward 2, backward 4; the
  // position table is looked up, not multiplied) plus attention's 12 · n_layers · n_heads ·
  // head_dim · T (d_model for n_heads · head_dim unless model.head_dim says otherwise; T at most
  // the sliding window's W).
  double flops_per_token(int64_t seq_len) const;
};

// One pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·)); or with post_norm
// (OLMo 2's) x + ln_1(attn(x)), then + ln_2(mlp(·)); or with sandwich_norm (Gemma's)
// x + attn_out_norm(attn(ln_1(x))), then + mlp_out_norm(mlp(ln_2(·))).
class Gpt2Block {
 public:
  // `experts`: a mixture's expert-parallel group (nn/moe_mlp.h); null: every expert here.
  // `rope_tables`: the model's rotary tables, shared by its blocks (null: the block's own).
  Gpt2Block(ParameterStore& store, const std::string& name, const Gpt2Config& config,
            ExpertExchange* experts = nullptr, std::shared_ptr<RotaryTables> rope_tables = nullptr);
  Tensor forward(Context& ctx, const Tensor& x);  // (B, T, C) -> (B, T, C)
  Tensor backward(Context& ctx, const Tensor& dy);
  // Incremental decoding: x (1, n, C) at positions first ..; the block's keys and values go into
  // (and are read from) `keys` and `values` (CausalSelfAttention::decode_adding).
  Tensor decode(Context& ctx, const Tensor& x, Tensor& keys, Tensor& values, int64_t first);
  void clear_cache();
  void collect_cache(std::vector<Tensor*>& out);
  // The loss the block's MLP added in its last forward (FeedForward::aux_loss): a mixture of
  // experts' balance loss; 0 for a dense one.
  double aux_loss() const { return mlp_->aux_loss(); }
  // Its MLP's tokens per expert in its last forward (FeedForward::expert_tokens); null if dense.
  const std::vector<int64_t>* expert_tokens() const { return mlp_->expert_tokens(); }
  int64_t dropped_pairs() const { return mlp_->dropped_pairs(); }  // FeedForward::dropped_pairs
  // Its mixture's balancing biases (nn/moe_mlp.h: set_expert_bias); nothing if dense.
  void set_expert_bias(const float* bias) { mlp_->set_expert_bias(bias); }

 private:
  Tensor run_forward(Context& ctx, const Tensor& x);
  Recompute recompute_;
  bool post_norm_;
  std::unique_ptr<Norm> ln_1_;
  CausalSelfAttention attn_;
  std::unique_ptr<Norm> ln_2_;
  std::unique_ptr<FeedForward> mlp_;
  std::unique_ptr<Norm> attn_out_norm_, mlp_out_norm_;  // sandwich_norm: the branches' outputs
  Tensor input_;   // Recompute::kFull: the block input, all that forward keeps
  Tensor middle_;  // post_norm, selective, a mixture: its input x1, restored
};

// Which part of the network a Gpt2 object holds (pipeline stages hold parts): blocks
// [first_block, end_block) (end_block −1: to the last), and whether it begins with the embedding
// and ends with the final LayerNorm + LM head + loss. The default is the whole model.
struct Gpt2Part {
  int64_t first_block = 0;
  int64_t end_block = -1;
  bool embedding = true;
  bool head = true;

  // end_block −1 made explicit; throws naming the range when it does not fit `n_layers`.
  Gpt2Part resolved(int64_t n_layers) const;
};

// What one pipeline stage of GPT-2 runs, whatever splits it further: Gpt2 (one device) and
// TpGpt2 (parallel/tensor_parallel_gpt2.h, the part split over a tensor-parallel group)
// implement it, and the pipeline engine (parallel/pipeline_parallel.h) drives either.
class Gpt2Stage {
 public:
  virtual ~Gpt2Stage() = default;
  virtual const Gpt2Config& config() const = 0;
  virtual const Gpt2Part& part() const = 0;
  virtual ParameterStore& params() = 0;
  // A part's forward: `input` is tokens (B, T) i32 when the part has the embedding, else the
  // previous part's output. targets (B, T) i32 are always given (their shape is the batch's).
  // With the head, returns an undefined tensor and sets *loss (mean over positions) — or, where
  // a training step set ctx.losses, queues it there (nn/step_losses.h) and leaves *loss (which
  // may then be null); else returns the output.
  virtual Tensor forward_part(Context& ctx, const Tensor& input, const Tensor& targets,
                              double* loss) = 0;
  // A part's backward: `dy` is the gradient of the output (ignored with the head, which starts
  // from scale × its loss). Returns the gradient of the input (undefined with the embedding).
  virtual Tensor backward_part(Context& ctx, const Tensor& dy, double scale) = 0;
  // Moves out / back in every tensor forward keeps for backward, so that several micro-batches
  // can be in flight (pipeline schedules): stash after a forward, unstash before its backward.
  std::vector<Tensor> stash_activations();
  void unstash_activations(std::vector<Tensor> stash);
  void clear_cache();  // drops every kept activation
  // The LM head's weight: the tied wte (its own copy in a part without the embedding), or
  // lm_head.weight.
  virtual Parameter* head_weight() const = 0;
  // The losses the part's blocks added in its last forward beside the head's cross-entropy (a
  // mixture of experts' balance losses, with their coefficient; Gpt2::aux_loss); 0 for dense.
  virtual double aux_loss() const { return 0; }
  // Adds the tokens the part's blocks sent to each expert in its last forward into `counts`
  // (expert_counts_size: n_layers × moe_experts, block-major, by the blocks' global index, then
  // the pairs the experts' capacity dropped, over every block); nothing for dense ones.
  virtual void add_expert_tokens(std::vector<double>& counts) const { (void)counts; }
  // Sets the part's blocks' mixtures' balancing biases (nn/moe_mlp.h: set_expert_bias) from
  // `biases`, n_layers × moe_experts block-major by the blocks' global index; nothing for dense
  // ones.
  virtual void set_expert_biases(const std::vector<float>& biases) { (void)biases; }

  // aux_loss, add_expert_tokens and set_expert_biases over `blocks` (unique_ptrs to Gpt2Block or
  // TpGpt2Block), the first of them global block `first_block`: what Gpt2 and TpGpt2 share.
  template <typename Blocks>
  static double blocks_aux_loss(const Blocks& blocks) {
    double sum = 0;
    for (const auto& block : blocks) sum += block->aux_loss();
    return sum;
  }
  template <typename Blocks>
  static void add_blocks_expert_tokens(const Blocks& blocks, int64_t first_block,
                                       std::vector<double>& counts) {
    for (size_t l = 0; l < blocks.size(); ++l) {
      const std::vector<int64_t>* tokens = blocks[l]->expert_tokens();
      if (tokens == nullptr) continue;
      const size_t first = (static_cast<size_t>(first_block) + l) * tokens->size();
      LOOM_CHECK(first + tokens->size() < counts.size());
      for (size_t e = 0; e < tokens->size(); ++e)
        counts[first + e] += static_cast<double>((*tokens)[e]);
      counts.back() += static_cast<double>(blocks[l]->dropped_pairs());
    }
  }
  template <typename Blocks>
  static void set_blocks_expert_biases(const Blocks& blocks, int64_t first_block, int64_t experts,
                                       const std::vector<float>& biases) {
    const size_t E = static_cast<size_t>(experts);
    for (size_t l = 0; l < blocks.size(); ++l) {
      const size_t first = (static_cast<size_t>(first_block) + l) * E;
      LOOM_CHECK(first + E <= biases.size());
      blocks[l]->set_expert_bias(biases.data() + first);
    }
  }
  // The head's copy of the tied wte in a part without the embedding (a last pipeline stage):
  // the same values and, once pipeline parallelism sums the two, the same gradient as the first
  // stage's wte, so norms and checkpoints count it once; null everywhere else.
  Parameter* tied_head_copy() const {
    return config().tie_embeddings && part().head && !part().embedding ? head_weight() : nullptr;
  }

 protected:
  // Every member tensor that forward fills for backward, in a fixed order.
  virtual std::vector<Tensor*> cache_slots() = 0;
};

// The keys and values of the tokens a sampler has run through the model (Gpt2::decode): per block
// (max_seq_len, d_model), rows 0 .. length−1 filled; with Llama's blocks the keys turned by their
// positions and the shared key/value heads repeated per query head.
struct KvCache {
  int64_t length = 0;
  std::vector<Tensor> keys, values;
};

// x (the embedding's rows, or their gradient) times `multiplier` in place
// (Gpt2Config::embedding_multiplier); x itself where that is 1.
Tensor scale_embedding(Context& ctx, Tensor x, float multiplier);

class Gpt2 : public Gpt2Stage {
 public:
  // Parameter units (nn/hooks.h): the root (embeddings and final LayerNorm, when the part has
  // either end), then one per block — followed, under expert parallelism (`experts`, a
  // mixture's expert-parallel group, kept; parallel/expert_parallel.h), by one for its experts.
  explicit Gpt2(const Gpt2Config& config, const Gpt2Part& part = {},
                ExpertExchange* experts = nullptr);

  const Gpt2Config& config() const override { return config_; }
  ParameterStore& params() override { return params_; }
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
  // Incremental decoding on the CPU, for sampling: the logits (n, V) of tokens (1, n) that follow
  // the cache's `length` tokens, each attending to every earlier one through the cache, which
  // takes their keys and values (length += n). Equal, to float rounding, to logits() of all
  // length + n tokens at once; length + n must not exceed max_seq_len. An empty cache is sized on
  // first use.
  Tensor decode(Context& ctx, const Tensor& tokens, KvCache& cache);

  // Gpt2Stage: parts' inputs and outputs are (B, T, C).
  Tensor forward_part(Context& ctx, const Tensor& input, const Tensor& targets,
                      double* loss) override;
  Tensor backward_part(Context& ctx, const Tensor& dy, double scale) override;
  const Gpt2Part& part() const override { return part_; }
  Parameter* head_weight() const override { return head_wte_; }
  // Σ over this part's blocks of the losses they added in their last forward (Gpt2Block::
  // aux_loss): a mixture of experts' balance losses, which backward differentiates beside the
  // cross-entropy that forward returns. 0 for dense blocks.
  double aux_loss() const override;
  void add_expert_tokens(std::vector<double>& counts) const override;
  void set_expert_biases(const std::vector<float>& biases) override;

 private:
  Tensor run_blocks(Context& ctx, Tensor x);
  // The head's loss into ctx.losses where set, else into *loss (report_mean_loss).
  void head_forward(Context& ctx, const Tensor& x, const Tensor& targets, double* loss);
  void before_forward_root(Context& ctx);
  void after_forward_root(Context& ctx);
  std::vector<Tensor*> cache_slots() override;

  Gpt2Config config_;
  Gpt2Part part_;
  ParameterStore params_;
  int root_unit_ = -1;        // -1: this part has no root unit
  std::vector<size_t> block_unit_;  // each block's unit
  std::unique_ptr<Embedding> embedding_;
  Parameter* head_wte_ = nullptr;
  // The blocks' rotary cos/sin tables, one per set of frequencies (nn/causal_self_attention.h).
  std::shared_ptr<RotaryTables> rope_tables_ = std::make_shared<RotaryTables>();
  std::vector<std::unique_ptr<Gpt2Block>> blocks_;

 public:
  const RotaryTables& rotary_tables() const { return *rope_tables_; }
  std::unique_ptr<Norm> ln_f_;
  // Cached for backward.
  Tensor final_;    // (N, C) ln_f output
  Tensor dlogits_;  // (N, V): holds logits after forward, turned into their gradient in backward
  Tensor lse_;      // (N)
  Tensor targets_;
};

}  // namespace loom
