#include "models/gpt2.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "base/error.h"
#include "config/config.h"
#include "kernels/ops.h"
#include "nn/deferred_weight_grads.h"
#include "nn/moe_mlp.h"
#include "nn/rounded_weights.h"
#include "nn/step_losses.h"
#include "nn/swiglu_mlp.h"
#include "tensor/dispatch.h"

namespace loom {

Recompute parse_recompute(const std::string& name) {
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective})
    if (name == recompute_name(mode)) return mode;
  fail("activation recomputation '", name, "' is not one of none, full, selective");
}

const char* recompute_name(Recompute mode) {
  switch (mode) {
    case Recompute::kNone: return "none";
    case Recompute::kFull: return "full";
    case Recompute::kSelective: return "selective";
  }
  LOOM_CHECK_MSG(false, "bad Recompute value");
  return "";
}

Arch parse_arch(const std::string& name) {
  for (Arch arch : {Arch::kGpt2, Arch::kLlama})
    if (name == arch_name(arch)) return arch;
  fail("model architecture '", name, "' is not one of gpt2, llama");
}

const char* arch_name(Arch arch) { return arch == Arch::kLlama ? "llama" : "gpt2"; }

void Gpt2Config::validate() const {
  if (vocab_size <= 0) fail("model.vocab_size must be positive, got ", vocab_size);
  if (max_seq_len <= 0) fail("model.max_seq_len must be positive, got ", max_seq_len);
  if (d_model <= 0) fail("model.d_model must be positive, got ", d_model);
  if (n_layers <= 0) fail("model.n_layers must be positive, got ", n_layers);
  if (n_heads <= 0 || (head_width == 0 && d_model % n_heads != 0))
    fail("model.n_heads = ", n_heads, " does not divide model.d_model = ", d_model);
  if (head_width < 0 || head_width > ModelLimits::kHeadDim || (head_width > 0 && !llama()))
    fail("model.head_dim = ", head_width, " must be in [0, ", ModelLimits::kHeadDim,
         "], and set for a Llama only");
  if (qk_norm && !llama()) fail("model.qk_norm applies to a Llama only");
  if (qk_norm_full && !qk_norm) fail("model.qk_norm_scope = \"full\" needs model.qk_norm");
  if (query_pre_attn_scalar < 0 || (query_pre_attn_scalar > 0 && !qk_norm))
    fail("model.query_pre_attn_scalar = ", query_pre_attn_scalar,
         " must be >= 0, and set with model.qk_norm only");
  if ((post_norm || sandwich_norm) && !llama())
    fail("model.norm_placement = \"", post_norm ? "post" : "sandwich",
         "\" applies to a Llama only");
  if (post_norm && sandwich_norm) fail("model.norm_placement: post or sandwich, not both");
  if (!(embedding_multiplier > 0) || !std::isfinite(embedding_multiplier))
    fail("model.embedding_multiplier must be positive and finite, got ", embedding_multiplier);
  if (rope_local_theta != 0 && (!(rope_local_theta > 1) || sliding_window == 0))
    fail("model.rope_local_theta = ", rope_local_theta,
         " must be > 1 and set with model.sliding_window (the windowed blocks' base) only");
  if (ffn_activation != GatedActivation::kSilu && (!llama() || moe()))
    fail("model.ffn_activation = \"gelu_tanh\" applies to a dense Llama's gated MLP only");
  if (sliding_window < 0 || (sliding_window > 0 && !llama()))
    fail("model.sliding_window = ", sliding_window, " must be >= 0, and set for a Llama only");
  if (full_attention_every < 0 || (full_attention_every > 0 && sliding_window == 0))
    fail("model.full_attention_every = ", full_attention_every,
         " must be >= 0, and set with model.sliding_window only");
  const auto at_most = [](const char* key, int64_t v, int64_t most) {
    if (v > most) fail(key, " = ", v, " is past the largest Loom builds, ", most);
  };
  at_most("model.vocab_size", vocab_size, ModelLimits::kVocabSize);
  at_most("model.max_seq_len", max_seq_len, ModelLimits::kSeqLen);
  at_most("model.d_model", d_model, ModelLimits::kDModel);
  at_most("model.n_layers", n_layers, ModelLimits::kLayers);
  at_most("model.n_heads × model.head_dim", attention_width(), ModelLimits::kDModel);
  if (!llama()) return;
  at_most("model.ffn_hidden", ffn_hidden, ModelLimits::kFfnHidden);
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    fail("model.n_kv_heads = ", n_kv_heads, " does not divide model.n_heads = ", n_heads);
  if (head_dim() % 2 != 0)
    fail("model head size ", head_dim(), " must be even for the rotary embedding");
  if (ffn_hidden <= 0) fail("model.ffn_hidden must be positive, got ", ffn_hidden);
  if (moe_experts < 0 || moe_experts > ModelLimits::kExperts)
    fail("model.moe_experts = ", moe_experts, " must be in [0, ", ModelLimits::kExperts, "]");
  if (moe_experts > 0 && (moe_top_k < 1 || moe_top_k > moe_experts))
    fail("model.moe_top_k = ", moe_top_k,
         " must be between 1 and model.moe_experts = ", moe_experts);
  if (moe_experts > 0 && !(moe_aux_loss_coef >= 0 && moe_aux_loss_coef < 1))
    fail("model.moe_aux_loss_coef = ", moe_aux_loss_coef, " must be in [0, 1)");
  if (moe_experts > 0 && !(moe_router_z_loss_coef >= 0 && moe_router_z_loss_coef < 1))
    fail("model.moe_router_z_loss_coef = ", moe_router_z_loss_coef, " must be in [0, 1)");
  if (moe_shared_experts < 0 || moe_shared_experts > ModelLimits::kExperts ||
      (moe_shared_experts > 0 && moe_experts == 0) ||
      moe_shared_experts * ffn_hidden > ModelLimits::kFfnHidden)
    fail("model.moe_shared_experts = ", moe_shared_experts, " must be in [0, ",
         ModelLimits::kExperts, "], with model.moe_experts, its width at most ",
         ModelLimits::kFfnHidden);
  if (!(moe_capacity.factor >= 0 && moe_capacity.factor <= ModelLimits::kExperts) ||
      (moe_capacity.factor > 0 && moe_experts == 0))
    fail("model.moe_capacity_factor = ", moe_capacity.factor, " must be in [0, ",
         ModelLimits::kExperts, "], and 0 without model.moe_experts");
  if (moe_experts > 0 &&
      (moe_router_groups > ModelLimits::kExpertGroups || !moe_shape().groups_route()))
    fail("model.moe_router_num_groups = ", moe_router_groups,
         " with model.moe_router_group_topk = ", moe_router_group_topk, " cannot route the top ",
         moe_top_k, " of ", moe_experts, " experts");
  if (!(moe_router_topk_scaling_factor >= 1e-3 && moe_router_topk_scaling_factor <= 1e3))
    fail("model.moe_router_topk_scaling_factor = ", moe_router_topk_scaling_factor,
         " must be in [0.001, 1000]");
  if (moe_router_score == RouterScore::kSigmoid && (moe_experts == 0 || moe_router_z_loss_coef > 0))
    fail("model.moe_router_score_function = \"sigmoid\" needs model.moe_experts and takes no ",
         "router z-loss (model.moe_router_z_loss_coef = ", moe_router_z_loss_coef, ")");
  if (!(rope_theta > 1)) fail("model.rope_theta must be > 1, got ", rope_theta);
  if (!(norm_eps > 0)) fail("model.norm_eps must be positive, got ", norm_eps);
}

int64_t Gpt2Config::num_parameters() const {
  const int64_t C = d_model;
  if (llama()) {  // two RMSNorm weights (four sandwiched), qkv, proj, the SwiGLU's gate/up and proj
    // A mixture: moe_experts SwiGLUs, the shared experts' and the router (C -> experts).
    const int64_t mlp =
        moe() ? (moe_experts + moe_shared_experts) * 3 * C * ffn_hidden + C * moe_experts
              : 3 * C * ffn_hidden;
    const int64_t per_block = (sandwich_norm ? 4 : 2) * C + C * qkv_width() +
                              (qkv_bias ? qkv_width() : 0) + qk_norm_params() +
                              attention_width() * C + mlp;
    return vocab_size * C + n_layers * per_block + C + (tie_embeddings ? 0 : vocab_size * C);
  }
  const int64_t per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) +
                            (4 * C * C + C);
  return vocab_size * C + max_seq_len * C + n_layers * per_block + 2 * C +
         (tie_embeddings ? 0 : vocab_size * C);
}

double Gpt2Config::flops_per_token(int64_t seq_len) const {
  // Looked-up tables are not multiplied: the positions, and an untied head's token embedding.
  // A mixture of experts multiplies a token by its moe_top_k experts' weights only.
  const int64_t idle_experts =
      moe() ? n_layers * (moe_experts - moe_top_k) * 3 * d_model * ffn_hidden : 0;
  const int64_t matrix_params = num_parameters() - position_rows() * d_model -
                                (tie_embeddings ? 0 : vocab_size * d_model) - idle_experts;
  // A sliding window spans at most its W positions of the sequence (in the blocks it windows).
  int64_t spans = 0;
  for (int64_t l = 0; l < n_layers; ++l)
    spans += window_of(l) > 0 ? std::min(seq_len, window_of(l)) : seq_len;
  return 6.0 * static_cast<double>(matrix_params) +
         12.0 * static_cast<double>(attention_width()) * static_cast<double>(spans);
}

namespace {
// GPT-2 scales the init of the residual stream's projections by 1/sqrt(2·n_layers); Llama's
// blocks are initialised the same way here.
float residual_std(const Gpt2Config& c) {
  return c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
}
std::optional<Rotary> rotary_of(const Gpt2Config& c, std::shared_ptr<RotaryTables> tables) {
  if (!c.llama()) return std::nullopt;
  return Rotary{c.n_kv_heads,    c.rope_frequencies(), c.qkv_bias,       c.head_dim(),
                c.qk_norm,       c.norm_eps,           c.sliding_window, c.qk_norm_full,
                c.query_scale(), std::move(tables)};
}
std::unique_ptr<FeedForward> make_mlp(ParameterStore& store, const std::string& name,
                                      const Gpt2Config& c, ExpertExchange* experts) {
  if (c.moe())
    return std::make_unique<MoeMlp>(store, name, c.moe_shape(), c.moe_losses(), c.init_std,
                                    residual_std(c), experts);
  if (c.llama())
    return std::make_unique<SwiGluMlp>(store, name, c.d_model, c.ffn_hidden, c.init_std,
                                       residual_std(c), HiddenSlice{}, c.ffn_activation);
  return std::make_unique<Mlp>(store, name, c.d_model, c.init_std, residual_std(c));
}
}  // namespace

Gpt2Block::Gpt2Block(ParameterStore& store, const std::string& name, const Gpt2Config& config,
                     ExpertExchange* experts, std::shared_ptr<RotaryTables> rope_tables)
    : recompute_(config.recompute),
      post_norm_(config.post_norm),
      ln_1_(make_norm(store, name + ".ln_1", config.d_model, config.llama(), config.norm_eps)),
      attn_(store, name + ".attn", config.d_model, config.n_heads, config.init_std,
            residual_std(config), rotary_of(config, std::move(rope_tables))),
      ln_2_(make_norm(store, name + ".ln_2", config.d_model, config.llama(), config.norm_eps)),
      mlp_(make_mlp(store, name + ".mlp", config, experts)) {
  if (config.sandwich_norm) {  // registered last: the pre-norm block's names and order before
    attn_out_norm_ =
        make_norm(store, name + ".attn_out_norm", config.d_model, true, config.norm_eps);
    mlp_out_norm_ = make_norm(store, name + ".mlp_out_norm", config.d_model, true, config.norm_eps);
  }
}

namespace {
// y += x, in ctx's type (post-norms' skip connections).
void add_into(Context& ctx, Tensor& y, const Tensor& x) {
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T = decltype(zero);
    ops::add_inplace<T>(ctx.exec(), y.data<T>(), x.data<T>(), y.numel());
  });
}
}  // namespace

Tensor Gpt2Block::run_forward(Context& ctx, const Tensor& x) {
  if (post_norm_) {
    // OLMo 2's order: each branch reads the residual stream itself (its Linears keep it as they
    // read it) and its output is normalised before the skip connection adds it.
    Tensor x1 = ln_1_->forward(ctx, attn_.forward(ctx, x));  // x + ln_1(attn(x))
    add_into(ctx, x1, x);
    Tensor y = ln_2_->forward(ctx, mlp_->forward(ctx, x1));  // x1 + ln_2(mlp(x1))
    add_into(ctx, y, x1);
    // Selective: the MLP's input, to restore it where it drops it (forward).
    if (recompute_ == Recompute::kSelective) middle_ = x1;
    return y;
  }
  // The LayerNorms' outputs feed only the qkv and fc Linears: forward_for_matmul writes them as
  // those keep them (16-bit on a GPU at bf16 / fp16 matmul precision).
  if (attn_out_norm_) {  // sandwich: the branches' outputs normalised, then added
    Tensor x1 = attn_out_norm_->forward(ctx, attn_.forward(ctx, ln_1_->forward_for_matmul(ctx, x)));
    add_into(ctx, x1, x);
    Tensor y = mlp_out_norm_->forward(ctx, mlp_->forward(ctx, ln_2_->forward_for_matmul(ctx, x1)));
    add_into(ctx, y, x1);
    return y;
  }
  // The skip connections are added by the branches' output projections (in the GEMMs' epilogue
  // on a GPU).
  Tensor x1 = attn_.forward_adding(ctx, ln_1_->forward_for_matmul(ctx, x), x);  // x + attn(ln_1(x))
  return mlp_->forward_adding(ctx, ln_2_->forward_for_matmul(ctx, x1), x1);     // x1 + mlp(ln_2(x1))
}

Tensor Gpt2Block::forward(Context& ctx, const Tensor& x) {
  Tensor y = run_forward(ctx, x);
  switch (recompute_) {
    case Recompute::kNone:
      break;
    case Recompute::kFull:  // keep the input only; backward re-runs the block
      clear_cache();
      input_ = x;
      break;
    case Recompute::kSelective:
      // Drop the LayerNorm outputs (cached as the qkv and fc inputs) and the GELU output;
      // LayerNorm inputs, mean and rstd and the fc output h stay, to rebuild them in backward.
      // Post-norm: no norm output to drop — the Linears keep the stream as they read it (16-bit
      // on a GPU at bf16) —, the activation's output alone; a mixture drops its rows, restored
      // from the kept x1.
      if (post_norm_) {
        if (mlp_->drop_activation_only())
          middle_ = Tensor();
        else
          mlp_->drop_recomputable();
        break;
      }
      attn_.drop_input();
      mlp_->drop_recomputable();
      break;
  }
  return y;
}

Tensor Gpt2Block::backward(Context& ctx, const Tensor& dy) {
  const bool selective = recompute_ == Recompute::kSelective;
  if (recompute_ == Recompute::kFull) {
    LOOM_CHECK(input_.defined());
    run_forward(ctx, input_);  // same inputs, same kernels: bitwise the same activations
    input_ = Tensor();
  }
  if (post_norm_) {
    // y = x1 + ln_2(mlp(x1)): dx1 = dy + mlpᵀ(ln_2ᵀ(dy)). Selective: the MLP rebuilds its
    // activation (a mixture is given its input back, kept as x1).
    if (selective && middle_.defined()) mlp_->restore_input(middle_);
    Tensor dx1 = mlp_->backward(ctx, ln_2_->backward(ctx, dy));
    add_into(ctx, dx1, dy);
    // x1 = x + ln_1(attn(x)): dx = dx1 + attnᵀ(ln_1ᵀ(dx1)).
    Tensor dx = attn_.backward(ctx, ln_1_->backward(ctx, dx1));
    add_into(ctx, dx, dx1);
    middle_ = Tensor();
    return dx;
  }
  // y = x1 + mlp(ln_2(x1)): dx1 = dy + ln_2ᵀ(mlpᵀ(dy)). Selective: ln_2's output is rebuilt
  // just before the MLP's backward (which rebuilds its GELU output itself). Sandwich: the MLP's
  // output norm's backward first (it keeps its input).
  const Tensor dmlp_out = mlp_out_norm_ ? mlp_out_norm_->backward(ctx, dy) : dy;
  if (selective) mlp_->restore_input(ln_2_->recompute_output(ctx));
  Tensor dx1 = ln_2_->backward_adding(ctx, mlp_->backward(ctx, dmlp_out), dy);
  // x1 = x + attn(ln_1(x)): dx = dx1 + ln_1ᵀ(attnᵀ(dx1)); ln_1's output likewise, only now.
  const Tensor dattn_out = attn_out_norm_ ? attn_out_norm_->backward(ctx, dx1) : dx1;
  if (selective) attn_.restore_input(ln_1_->recompute_output(ctx));
  Tensor dx = ln_1_->backward_adding(ctx, attn_.backward(ctx, dattn_out), dx1);
  return dx;
}

Tensor Gpt2Block::decode(Context& ctx, const Tensor& x, Tensor& keys, Tensor& values,
                         int64_t first) {
  if (post_norm_) {
    Tensor x1 = ln_1_->forward(ctx, attn_.decode_adding(ctx, x, nullptr, keys, values, first));
    add_into(ctx, x1, x);
    Tensor y = ln_2_->forward(ctx, mlp_->forward(ctx, x1));
    add_into(ctx, y, x1);
    clear_cache();
    return y;
  }
  if (attn_out_norm_) {
    Tensor x1 = attn_out_norm_->forward(
        ctx, attn_.decode_adding(ctx, ln_1_->forward(ctx, x), nullptr, keys, values, first));
    add_into(ctx, x1, x);
    Tensor y = mlp_out_norm_->forward(ctx, mlp_->forward(ctx, ln_2_->forward(ctx, x1)));
    add_into(ctx, y, x1);
    clear_cache();
    return y;
  }
  Tensor x1 = attn_.decode_adding(ctx, ln_1_->forward(ctx, x), &x, keys, values, first);
  Tensor y = mlp_->forward_adding(ctx, ln_2_->forward(ctx, x1), x1);
  clear_cache();
  return y;
}

void Gpt2Block::collect_cache(std::vector<Tensor*>& out) {
  ln_1_->collect_cache(out);
  attn_.collect_cache(out);
  ln_2_->collect_cache(out);
  mlp_->collect_cache(out);
  if (attn_out_norm_) {
    attn_out_norm_->collect_cache(out);
    mlp_out_norm_->collect_cache(out);
  }
  out.push_back(&input_);
  out.push_back(&middle_);
}

void Gpt2Block::clear_cache() {
  ln_1_->clear_cache();
  attn_.clear_cache();
  ln_2_->clear_cache();
  mlp_->clear_cache();
  if (attn_out_norm_) {
    attn_out_norm_->clear_cache();
    mlp_out_norm_->clear_cache();
  }
  input_ = middle_ = Tensor();
}

Gpt2Part Gpt2Part::resolved(int64_t n_layers) const {
  Gpt2Part p = *this;
  if (p.end_block < 0) p.end_block = n_layers;
  if (p.first_block < 0 || p.first_block > p.end_block || p.end_block > n_layers)
    fail("model part: blocks [", p.first_block, ", ", p.end_block, ") out of range for ",
         n_layers, " layers");
  return p;
}

Gpt2::Gpt2(const Gpt2Config& config, const Gpt2Part& part, ExpertExchange* experts)
    : config_(config), part_(part) {
  config_.validate();
  part_ = part.resolved(config_.n_layers);
  // Unit "root" (when this part has the embedding or the head): the embeddings and the final
  // LayerNorm, used at both ends of the network; then one unit per block (nn/hooks.h). A part
  // with the head but not the embedding holds its own copy of the tied wte (same name, so the
  // same initial values); pipeline parallelism sums the two copies' gradients.
  if (part_.embedding || part_.head) {
    params_.begin_unit("root");
    root_unit_ = 0;
  }
  if (part_.embedding) {
    embedding_ = std::make_unique<Embedding>(params_, config.vocab_size, config_.position_rows(),
                                             config.d_model, config.init_std);
    if (config_.tie_embeddings) head_wte_ = embedding_->wte();
  }
  if (part_.head) {
    if (!config_.tie_embeddings)
      head_wte_ = params_.add("lm_head.weight", {config.vocab_size, config.d_model},
                              InitKind::kNormal, config.init_std);
    else if (!part_.embedding)
      head_wte_ = params_.add("wte.weight", {config.vocab_size, config.d_model}, InitKind::kNormal,
                              config.init_std);
    ln_f_ = make_norm(params_, "ln_f", config.d_model, config_.llama(), config_.norm_eps);
    head_wte_->gemm_operand = true;  // the head's GEMMs read it (the tied embedding too)
  }
  for (int64_t l = part_.first_block; l < part_.end_block; ++l) {
    const std::string name = "blocks." + std::to_string(l);
    params_.begin_unit(name);
    block_unit_.push_back(params_.units().size() - 1);
    blocks_.push_back(
        std::make_unique<Gpt2Block>(params_, name, config_.block(l), experts, rope_tables_));
  }
}

void Gpt2::build(DType dtype, Device device, uint64_t seed) {
  params_.allocate(dtype, device);
  params_.initialize(seed);
}

void Gpt2::before_forward_root(Context& ctx) { if (root_unit_ >= 0) hook_before_forward(ctx, root_unit_); }
void Gpt2::after_forward_root(Context& ctx) { if (root_unit_ >= 0) hook_after_forward(ctx, root_unit_); }

Tensor Gpt2::run_blocks(Context& ctx, Tensor x) {
  for (size_t l = 0; l < blocks_.size(); ++l) {
    hook_before_forward(ctx, block_unit_[l]);
    x = blocks_[l]->forward(ctx, x);
    hook_after_forward(ctx, block_unit_[l]);
  }
  return x;
}

void Gpt2::head_forward(Context& ctx, const Tensor& x, const Tensor& targets, double* loss) {
  if (targets.dtype() != DType::kI32 || targets.numel() * config_.d_model != x.numel())
    fail("targets ", shape_str(targets.shape()), " must be i32 with one target per position of ",
         shape_str(x.shape()));
  const int64_t N = targets.numel(), C = config_.d_model, V = config_.vocab_size;
  final_ = ln_f_->forward(ctx, x).reshape({N, C});
  // On a GPU at bf16 / fp16 matmul precision the logits are stored in that 16-bit type, as
  // PyTorch's autocast leaves them: half the bytes of the largest activation.
  const DType logits_dtype = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  dlogits_ = Tensor::empty({N, V}, logits_dtype, ctx.device);
  lse_ = Tensor::empty({N}, ctx.dtype, ctx.device);
  targets_ = targets;
  Tensor losses = Tensor::empty({N}, ctx.dtype, ctx.device);
  const Parameter& wte = *head_wte_;
  if (logits_dtype != ctx.dtype) {
    ops::lm_head_forward_rounded_logits(ctx.exec(), losses.data<float>(), lse_.data<float>(),
                                        dlogits_.raw(), logits_dtype, final_.data<float>(),
                                        gemm_weight(ctx, wte), targets.data<int32_t>(), N, C, V);
  } else {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T = decltype(zero);
      // logits = final · Wᵀ, W the tied token embedding or lm_head.weight.
      ops::matmul_forward<T>(ctx.exec(), dlogits_.data<T>(), final_.data<T>(),
                             wte.value.data<T>(), nullptr, N, C, V);
      ops::cross_entropy_forward<T>(ctx.exec(), losses.data<T>(), lse_.data<T>(),
                                    dlogits_.data<T>(), targets.data<int32_t>(), N, V);
    });
  }
  report_mean_loss(ctx, losses, N, loss);
  if (ctx.z_loss > 0 && ctx.losses != nullptr && ctx.dtype == DType::kF32)
    ops::lse_square_sum<float>(ctx.exec(), ctx.losses->add_lse_square_sum_of(N), lse_.data<float>(),
                               nullptr, targets.data<int32_t>(), N);
}

double Gpt2::forward(Context& ctx, const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK_MSG(part_.embedding && part_.head, "Gpt2::forward needs the whole model");
  if (targets.shape() != tokens.shape())
    fail("targets ", shape_str(targets.shape()), " must be shaped like tokens ", shape_str(tokens.shape()));
  double loss = 0;
  forward_part(ctx, tokens, targets, &loss);
  return loss;
}

Tensor scale_embedding(Context& ctx, Tensor x, float multiplier) {
  scale_in_place(ctx, x, multiplier);
  return x;
}

Tensor Gpt2::forward_part(Context& ctx, const Tensor& input, const Tensor& targets, double* loss) {
  before_forward_root(ctx);
  Tensor x = part_.embedding ? scale_embedding(ctx, embedding_->forward(ctx, input),
                                               config_.embedding_multiplier)
                             : input;
  x = run_blocks(ctx, x);
  Tensor out;
  if (part_.head) {
    head_forward(ctx, x, targets, loss);
  } else {
    out = x;
  }
  after_forward_root(ctx);
  return out;
}

void Gpt2::backward(Context& ctx, double scale) {
  LOOM_CHECK_MSG(part_.embedding && part_.head, "Gpt2::backward needs the whole model");
  backward_part(ctx, Tensor(), scale);
}

Tensor Gpt2::backward_part(Context& ctx, const Tensor& dy, double scale) {
  if (root_unit_ >= 0) hook_before_backward(ctx, root_unit_);
  ctx.backward_scale = scale;  // for the blocks' inner losses (a mixture of experts')
  Tensor dx = dy;
  if (part_.head) {
    LOOM_CHECK(dlogits_.defined());
    const int64_t N = final_.dim(0), C = config_.d_model, V = config_.vocab_size;
    const Parameter& wte = *head_wte_;
    Tensor dfinal = Tensor::empty({N, C}, ctx.dtype, ctx.device);
    if (dlogits_.dtype() != ctx.dtype) {  // 16-bit logits (head_forward)
      // In B of a zero-bubble schedule without the head's weight gradient, which W then takes
      // from the logits' gradient (in place over them) and final_, as below.
      const bool later = ctx.deferred_weight_grads != nullptr;
      ops::lm_head_backward_from_rounded_logits(
          ctx.exec(), dfinal.data<float>(), later ? nullptr : wte.grad.data<float>(),
          dlogits_.raw(), dlogits_.dtype(), lse_.data<float>(), targets_.data<int32_t>(),
          static_cast<float>(scale / N), final_.data<float>(), gemm_weight(ctx, wte), N, C, V,
          ctx.z_loss);
      if (later) {
        Parameter* head = head_wte_;
        ctx.deferred_weight_grads->add(
            [head, dlogits = dlogits_, final = final_, N, C, V](const Exec& ex) {
              ops::matmul_backward_from_rounded(ex, nullptr, head->grad.data<float>(), nullptr,
                                                dlogits.raw(), dlogits.dtype(), final.raw(),
                                                DType::kF32, nullptr, N, C, V);
            },
            static_cast<int64_t>(dlogits_.nbytes() + final_.nbytes()));
      }
    } else {
      dispatch_float(ctx.dtype, [&](auto zero) {
        using T_ = decltype(zero);
        if (ctx.deferred_weight_grads != nullptr) {
          // B of a zero-bubble schedule: lm_head_backward's two steps — the logits' gradient in
          // place, dfinal through the head — and the head's weight gradient, the last stage's
          // largest GEMM, left for W (keeping the logits' gradient and final_ until then).
          ops::cross_entropy_backward<T_>(ctx.exec(), dlogits_.data<T_>(), dlogits_.data<T_>(),
                                          lse_.data<T_>(), targets_.data<int32_t>(),
                                          static_cast<T_>(scale / N), N, V, ctx.z_loss);
          ops::matmul_backward<T_>(ctx.exec(), dfinal.data<T_>(), nullptr, nullptr,
                                   dlogits_.data<T_>(), final_.data<T_>(), wte.value.data<T_>(), N,
                                   C, V);
          Parameter* head = head_wte_;
          ctx.deferred_weight_grads->add(
              [head, dlogits = dlogits_, final = final_, N, C, V](const Exec& ex) {
                ops::matmul_backward<T_>(ex, nullptr, head->grad.data<T_>(), nullptr,
                                         dlogits.data<T_>(), final.data<T_>(), nullptr, N, C, V);
              },
              static_cast<int64_t>(dlogits_.nbytes() + final_.nbytes()));
          return;
        }
        // The logits' gradient, in place over them, through the tied head into dfinal and
        // wte.grad.
        ops::lm_head_backward<T_>(ctx.exec(), dfinal.data<T_>(), wte.grad.data<T_>(),
                                  dlogits_.data<T_>(), lse_.data<T_>(), targets_.data<int32_t>(),
                                  static_cast<T_>(scale / N), final_.data<T_>(),
                                  wte.value.data<T_>(), N, C, V, ctx.z_loss);
      });
    }
    const Shape shape = {targets_.dim(0), targets_.dim(1), C};
    dlogits_ = lse_ = final_ = targets_ = Tensor();
    dx = ln_f_->backward(ctx, dfinal.reshape(shape));
  } else {
    LOOM_CHECK_MSG(dy.defined(), "a model part without the head needs its output's gradient");
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    hook_before_backward(ctx, block_unit_[l]);
    dx = blocks_[l]->backward(ctx, dx);
    hook_after_backward(ctx, block_unit_[l]);
  }
  Tensor out;
  if (part_.embedding) {
    embedding_->backward(ctx, scale_embedding(ctx, dx, config_.embedding_multiplier));
  } else {
    out = dx;
  }
  if (root_unit_ >= 0) hook_after_backward(ctx, root_unit_);
  return out;
}

double Gpt2::aux_loss() const {
  return blocks_aux_loss(blocks_);
}

void Gpt2::set_expert_biases(const std::vector<float>& biases) {
  set_blocks_expert_biases(blocks_, part_.first_block, config_.moe_experts, biases);
}

void Gpt2::add_expert_tokens(std::vector<double>& counts) const {
  add_blocks_expert_tokens(blocks_, part_.first_block, counts);
}

Tensor Gpt2::logits(Context& ctx, const Tensor& tokens) {
  LOOM_CHECK_MSG(part_.embedding && part_.head, "Gpt2::logits needs the whole model");
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = config_.d_model, V = config_.vocab_size;
  before_forward_root(ctx);
  Tensor final =
      ln_f_->forward(ctx, run_blocks(ctx, scale_embedding(ctx, embedding_->forward(ctx, tokens),
                                                          config_.embedding_multiplier)));
  clear_cache();
  Tensor out = Tensor::empty({B, T, V}, ctx.dtype, ctx.device);
  const Parameter& wte = *head_wte_;
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::matmul_forward<T_>(ctx.exec(), out.data<T_>(), final.data<T_>(), wte.value.data<T_>(),
                            nullptr, B * T, C, V);
  });
  after_forward_root(ctx);
  return out;
}

Tensor Gpt2::decode(Context& ctx, const Tensor& tokens, KvCache& cache) {
  LOOM_CHECK_MSG(part_.embedding && part_.head, "Gpt2::decode needs the whole model");
  if (tokens.ndim() != 2 || tokens.dim(0) != 1 || tokens.dtype() != DType::kI32)
    fail("decoding takes (1, n) i32 tokens, got ", shape_str(tokens.shape()));
  const int64_t n = tokens.dim(1), C = config_.d_model, V = config_.vocab_size;
  if (cache.length + n > config_.max_seq_len)
    fail("decoding: ", cache.length, " + ", n, " tokens exceed model.max_seq_len = ",
         config_.max_seq_len);
  if (cache.keys.empty()) {
    for (size_t l = 0; l < blocks_.size(); ++l) {
      const int64_t width = config_.attention_width();
      cache.keys.push_back(Tensor::empty({config_.max_seq_len, width}, ctx.dtype, ctx.device));
      cache.values.push_back(Tensor::empty({config_.max_seq_len, width}, ctx.dtype, ctx.device));
    }
  }
  Tensor x = scale_embedding(ctx, embedding_->forward_at(ctx, tokens, cache.length),
                             config_.embedding_multiplier);
  for (size_t l = 0; l < blocks_.size(); ++l)
    x = blocks_[l]->decode(ctx, x, cache.keys[l], cache.values[l], cache.length);
  Tensor final = ln_f_->forward(ctx, x);
  ln_f_->clear_cache();
  Tensor out = Tensor::empty({n, V}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::matmul_forward<T_>(ctx.exec(), out.data<T_>(), final.data<T_>(),
                            head_wte_->value.data<T_>(), nullptr, n, C, V);
  });
  cache.length += n;
  return out;
}

std::vector<Tensor*> Gpt2::cache_slots() {
  std::vector<Tensor*> slots;
  if (embedding_) embedding_->collect_cache(slots);
  for (auto& block : blocks_) block->collect_cache(slots);
  if (ln_f_) ln_f_->collect_cache(slots);
  slots.insert(slots.end(), {&final_, &dlogits_, &lse_, &targets_});
  return slots;
}

std::vector<Tensor> Gpt2Stage::stash_activations() {
  std::vector<Tensor> stash;
  for (Tensor* t : cache_slots()) {
    stash.push_back(std::move(*t));
    *t = Tensor();
  }
  return stash;
}

void Gpt2Stage::unstash_activations(std::vector<Tensor> stash) {
  std::vector<Tensor*> slots = cache_slots();
  LOOM_CHECK(stash.size() == slots.size());
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = std::move(stash[i]);
}

void Gpt2Stage::clear_cache() {
  for (Tensor* t : cache_slots()) *t = Tensor();
}

}  // namespace loom
