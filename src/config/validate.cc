// validate(): the value rules of a Config and the constraints between keys. Every violation is
// collected, then reported in one error, so a user fixes a config in one round.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "config/config.h"
#include "config/format.h"

namespace loom {
namespace {

class Problems {
 public:
  template <typename... Args>
  void add(Args&&... args) {
    list_.push_back(detail::concat(std::forward<Args>(args)...));
  }

  void positive(const char* key, int64_t v) {
    if (v <= 0) add(key, " = ", v, " must be positive");
  }
  void non_negative(const char* key, int64_t v) {
    if (v < 0) add(key, " = ", v, " must be >= 0");
  }
  void at_most(const char* key, int64_t v, int64_t most) {
    if (v > most) add(key, " = ", v, " is past the largest Loom builds, ", most);
  }
  // [lo, hi] or, with hi_open, [lo, hi). NaN fails every range.
  void in_range(const char* key, double v, double lo, double hi, bool hi_open = false) {
    const bool ok = v >= lo && (hi_open ? v < hi : v <= hi);
    if (!ok)
      add(key, " = ", format_double(v), " must be in [", format_double(lo), ", ", format_double(hi),
          hi_open ? ")" : "]");
  }
  template <typename List>
  void one_of(const char* key, const std::string& v, const List& allowed) {
    for (std::string_view a : allowed)
      if (a == v) return;
    std::string list;
    for (std::string_view a : allowed) list += detail::concat(list.empty() ? "" : ", ", a);
    add(key, " = ", toml_quote(v), " must be one of: ", list);
  }
  void one_of(const char* key, const std::string& v, std::initializer_list<const char*> allowed) {
    one_of<std::initializer_list<const char*>>(key, v, allowed);
  }

  void throw_if_any() const {
    if (list_.empty()) return;
    if (list_.size() == 1) fail("invalid config: ", list_[0]);
    std::string message = "invalid config (" + std::to_string(list_.size()) + " problems):";
    for (const std::string& p : list_) message += "\n  " + p;
    fail(message);
  }

 private:
  std::vector<std::string> list_;
};

constexpr double kInf = INFINITY;

// "cpu", "cuda" or "cuda:N".
bool valid_device(const std::string& d) {
  if (d == "cpu" || d == "cuda") return true;
  if (!d.starts_with("cuda:") || d.size() == 5 || d.size() > 9) return false;
  return std::all_of(d.begin() + 5, d.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The keys only Llama's blocks read: an error under GPT-2 when changed (they would do nothing).
void validate_llama_keys(const ModelConfig& m, Problems& p) {
  if (m.arch != "llama") {
    const ModelConfig defaults;
    if (m.n_kv_heads != defaults.n_kv_heads) p.add("model.n_kv_heads applies to model.arch = \"llama\" only");
    if (m.qkv_bias != defaults.qkv_bias)
      p.add(
          "model.qkv_bias applies to model.arch = \"llama\" only (GPT-2's attention has its "
          "biases)");
    if (m.head_dim != defaults.head_dim)
      p.add("model.head_dim applies to model.arch = \"llama\" only");
    if (m.qk_norm != defaults.qk_norm)
      p.add("model.qk_norm applies to model.arch = \"llama\" only");
    if (m.qk_norm_scope != defaults.qk_norm_scope)
      p.add("model.qk_norm_scope applies to model.arch = \"llama\" only");
    if (m.query_pre_attn_scalar != defaults.query_pre_attn_scalar)
      p.add("model.query_pre_attn_scalar applies to model.arch = \"llama\" only");
    if (m.norm_placement != defaults.norm_placement)
      p.add(
          "model.norm_placement applies to model.arch = \"llama\" only (GPT-2's LayerNorms come "
          "before)");
    if (m.rope_local_theta != defaults.rope_local_theta)
      p.add("model.rope_local_theta applies to model.arch = \"llama\" only");
    if (m.ffn_activation != defaults.ffn_activation)
      p.add(
          "model.ffn_activation applies to model.arch = \"llama\" only (GPT-2's MLP is not "
          "gated)");
    if (m.sliding_window != defaults.sliding_window)
      p.add("model.sliding_window applies to model.arch = \"llama\" only");
    if (m.full_attention_every != defaults.full_attention_every)
      p.add("model.full_attention_every applies to model.arch = \"llama\" only");
    if (m.ffn_hidden != defaults.ffn_hidden) p.add("model.ffn_hidden applies to model.arch = \"llama\" only");
    if (m.rope_theta != defaults.rope_theta) p.add("model.rope_theta applies to model.arch = \"llama\" only");
    if (m.norm_eps != defaults.norm_eps) p.add("model.norm_eps applies to model.arch = \"llama\" only");
    if (m.rope_scaling != defaults.rope_scaling)
      p.add("model.rope_scaling applies to model.arch = \"llama\" only");
    if (m.moe_experts != defaults.moe_experts)
      p.add(
          "model.moe_experts applies to model.arch = \"llama\" only (its experts are SwiGLU "
          "MLPs, as Mixtral's)");
    return;
  }
  p.one_of("model.rope_scaling", m.rope_scaling, {"none", "llama3", "linear"});
  p.one_of("model.qk_norm_scope", m.qk_norm_scope, {"head", "full"});
  p.one_of("model.norm_placement", m.norm_placement, {"pre", "post", "sandwich"});
  p.one_of("model.ffn_activation", m.ffn_activation, {"silu", "gelu_tanh"});
  if (m.rope_local_theta != 0 && (!(m.rope_local_theta > 1) || m.sliding_window == 0))
    p.add("model.rope_local_theta = ", format_double(m.rope_local_theta),
          " must be > 1 and set with model.sliding_window (the windowed blocks' rotary base)");
  if (m.ffn_activation == "gelu_tanh" && m.moe_experts > 0)
    p.add("model.ffn_activation = \"gelu_tanh\" applies to a dense MLP: a mixture's experts ",
          "are SwiGLUs (model.moe_experts = ", m.moe_experts, ")");
  p.non_negative("model.query_pre_attn_scalar", m.query_pre_attn_scalar);
  p.at_most("model.query_pre_attn_scalar", m.query_pre_attn_scalar, ModelLimits::kDModel);
  if (m.query_pre_attn_scalar > 0 && !m.qk_norm)
    p.add("model.query_pre_attn_scalar = ", m.query_pre_attn_scalar,
          " needs model.qk_norm = true (the scale is applied to the query norm's output, as in ",
          "Gemma 3)");
  if (!m.qk_norm && m.qk_norm_scope != ModelConfig().qk_norm_scope)
    p.add("model.qk_norm_scope = \"", m.qk_norm_scope, "\" needs model.qk_norm = true");
  if (m.rope_scaling != "none" &&
      !(m.rope_scaling_factor >= 1 && std::isfinite(m.rope_scaling_factor)))
    p.add("model.rope_scaling_factor = ", format_double(m.rope_scaling_factor), " must be >= 1");
  if (m.rope_scaling == "linear") {
    // Only the factor is linear scaling's: Llama 3.1's other keys would be silently unused.
    const ModelConfig defaults;
    for (const auto& [key, set] :
         {std::pair{"rope_low_freq_factor",
                    m.rope_low_freq_factor != defaults.rope_low_freq_factor},
          std::pair{"rope_high_freq_factor",
                    m.rope_high_freq_factor != defaults.rope_high_freq_factor},
          std::pair{"rope_original_max_seq_len",
                    m.rope_original_max_seq_len != defaults.rope_original_max_seq_len}})
      if (set)
        p.add("model.", key, " applies to model.rope_scaling = \"llama3\" only (\"linear\" ",
              "takes model.rope_scaling_factor alone)");
  }
  if (m.rope_scaling == "llama3") {
    if (!(m.rope_low_freq_factor > 0 && m.rope_high_freq_factor > m.rope_low_freq_factor &&
          std::isfinite(m.rope_high_freq_factor)))
      p.add("model.rope_low_freq_factor = ", format_double(m.rope_low_freq_factor),
            " and model.rope_high_freq_factor = ", format_double(m.rope_high_freq_factor),
            " must satisfy 0 < low < high");
    p.positive("model.rope_original_max_seq_len", m.rope_original_max_seq_len);
  }
  p.non_negative("model.n_kv_heads", m.n_kv_heads);
  if (m.n_kv_heads > 0 && m.n_heads > 0 && m.n_heads % m.n_kv_heads != 0)
    p.add("model.n_kv_heads = ", m.n_kv_heads, " does not divide model.n_heads = ", m.n_heads,
          " (each key/value head serves the same number of query heads)");
  p.non_negative("model.head_dim", m.head_dim);
  p.non_negative("model.sliding_window", m.sliding_window);
  p.non_negative("model.full_attention_every", m.full_attention_every);
  if (m.full_attention_every > 0 && m.sliding_window == 0)
    p.add("model.full_attention_every = ", m.full_attention_every,
          " picks the blocks without a window: it needs model.sliding_window");
  p.at_most("model.head_dim", m.head_dim, ModelLimits::kHeadDim);
  if (m.head_dim > 0 && m.head_dim % 2 != 0)
    p.add("model.head_dim = ", m.head_dim,
          " must be even: the rotary embedding turns pairs of a head's dimensions");
  if (m.head_dim == 0 && m.n_heads > 0 && m.d_model > 0 && m.d_model % m.n_heads == 0 &&
      (m.d_model / m.n_heads) % 2 != 0)
    p.add("model.d_model / model.n_heads = ", m.d_model / m.n_heads,
          " must be even: the rotary embedding turns pairs of a head's dimensions (or set "
          "model.head_dim)");
  if (m.head_dim > 0 && m.n_heads > 0 && m.n_heads <= ModelLimits::kDModel &&
      m.n_heads * m.head_dim > ModelLimits::kDModel)
    p.add("model.n_heads × model.head_dim = ", m.n_heads * m.head_dim,
          " is past the widest attention Loom builds, ", ModelLimits::kDModel);
  p.non_negative("model.ffn_hidden", m.ffn_hidden);
  if (!(m.rope_theta > 1 && std::isfinite(m.rope_theta)))
    p.add("model.rope_theta = ", format_double(m.rope_theta), " must be > 1");
  if (!(m.norm_eps > 0 && std::isfinite(m.norm_eps)))
    p.add("model.norm_eps = ", format_double(m.norm_eps), " must be positive");
}

// Mixture of experts (nn/moe_mlp.h): the top-k choice needs k experts; the routing keys do
// nothing without experts, so changing them alone is an error.
void validate_moe_keys(const ModelConfig& m, Problems& p) {
  const ModelConfig defaults;
  p.non_negative("model.moe_experts", m.moe_experts);
  p.at_most("model.moe_experts", m.moe_experts, ModelLimits::kExperts);
  if (m.moe_experts == 0) {
    if (m.moe_top_k != defaults.moe_top_k)
      p.add("model.moe_top_k applies with model.moe_experts > 0 only");
    if (m.moe_aux_loss_coef != defaults.moe_aux_loss_coef)
      p.add("model.moe_aux_loss_coef applies with model.moe_experts > 0 only");
    if (m.moe_router_z_loss_coef != defaults.moe_router_z_loss_coef)
      p.add("model.moe_router_z_loss_coef applies with model.moe_experts > 0 only");
    if (m.moe_shared_experts != defaults.moe_shared_experts)
      p.add("model.moe_shared_experts applies with model.moe_experts > 0 only");
    if (m.moe_bias_update_rate != defaults.moe_bias_update_rate)
      p.add("model.moe_bias_update_rate applies with model.moe_experts > 0 only");
    if (m.moe_capacity_factor != defaults.moe_capacity_factor)
      p.add("model.moe_capacity_factor applies with model.moe_experts > 0 only");
    if (m.moe_router_score_function != defaults.moe_router_score_function)
      p.add("model.moe_router_score_function applies with model.moe_experts > 0 only");
    if (m.moe_router_num_groups != defaults.moe_router_num_groups)
      p.add("model.moe_router_num_groups applies with model.moe_experts > 0 only");
    if (m.moe_router_topk_scaling_factor != defaults.moe_router_topk_scaling_factor)
      p.add("model.moe_router_topk_scaling_factor applies with model.moe_experts > 0 only");
    if (m.moe_router_norm_topk_prob != defaults.moe_router_norm_topk_prob)
      p.add("model.moe_router_norm_topk_prob applies with model.moe_experts > 0 only");
    return;
  }
  if (m.moe_top_k < 1 || (m.moe_experts > 0 && m.moe_top_k > m.moe_experts))
    p.add("model.moe_top_k = ", m.moe_top_k,
          " must be between 1 and model.moe_experts = ", m.moe_experts);
  p.in_range("model.moe_aux_loss_coef", m.moe_aux_loss_coef, 0, 1, true);
  p.in_range("model.moe_router_z_loss_coef", m.moe_router_z_loss_coef, 0, 1, true);
  p.in_range("model.moe_bias_update_rate", m.moe_bias_update_rate, 0, 1, true);
  p.in_range("model.moe_capacity_factor", m.moe_capacity_factor, 0, ModelLimits::kExperts);
  p.one_of("model.moe_token_drop_policy", m.moe_token_drop_policy, {"probs", "position"});
  p.one_of("model.moe_router_score_function", m.moe_router_score_function, {"softmax", "sigmoid"});
  p.in_range("model.moe_router_topk_scaling_factor", m.moe_router_topk_scaling_factor, 1e-3, 1e3);
  p.non_negative("model.moe_router_num_groups", m.moe_router_num_groups);
  p.at_most("model.moe_router_num_groups", m.moe_router_num_groups, ModelLimits::kExpertGroups);
  p.non_negative("model.moe_router_group_topk", m.moe_router_group_topk);
  if (m.moe_router_num_groups == 0 && m.moe_router_group_topk != 0)
    p.add("model.moe_router_group_topk applies with model.moe_router_num_groups > 0 only");
  if (m.moe_experts > 0 && m.moe_router_num_groups > 0) {
    const int64_t G = m.moe_router_num_groups, GK = m.moe_router_group_topk;
    if (m.moe_experts % G != 0)
      p.add("model.moe_router_num_groups = ", G,
            " does not divide model.moe_experts = ", m.moe_experts);
    else if (GK < 1 || GK > G || m.moe_top_k % GK != 0 || m.moe_top_k / GK > m.moe_experts / G)
      p.add("model.moe_router_group_topk = ", GK,
            " must be in [1, model.moe_router_num_groups = ", G,
            "], divide model.moe_top_k = ", m.moe_top_k, ", and leave each group at most ",
            "as many choices as experts");
  }
  if (m.moe_router_score_function == "sigmoid" && m.moe_router_z_loss_coef > 0)
    p.add("model.moe_router_z_loss_coef applies with model.moe_router_score_function = ",
          "\"softmax\" only (the z-loss is the softmax's log-sum-exp)");
  if (m.moe_token_drop_policy != defaults.moe_token_drop_policy && !(m.moe_capacity_factor > 0))
    p.add("model.moe_token_drop_policy applies with model.moe_capacity_factor > 0 only");
  p.non_negative("model.moe_shared_experts", m.moe_shared_experts);
  p.at_most("model.moe_shared_experts", m.moe_shared_experts, ModelLimits::kExperts);
  if (m.moe_shared_experts > 0 && m.moe_shared_experts <= ModelLimits::kExperts &&
      m.ffn_hidden > 0 && m.ffn_hidden <= ModelLimits::kFfnHidden &&
      m.moe_shared_experts * m.ffn_hidden > ModelLimits::kFfnHidden)
    p.add("model.moe_shared_experts × model.ffn_hidden = ", m.moe_shared_experts * m.ffn_hidden,
          " is past the largest SwiGLU width Loom builds, ", ModelLimits::kFfnHidden);
}

void validate_model(const ModelConfig& m, Problems& p) {
  p.one_of("model.arch", m.arch, {"gpt2", "llama"});
  p.positive("model.vocab_size", m.vocab_size);
  p.positive("model.seq_len", m.seq_len);
  p.positive("model.d_model", m.d_model);
  p.positive("model.n_layers", m.n_layers);
  p.positive("model.n_heads", m.n_heads);
  p.at_most("model.vocab_size", m.vocab_size, ModelLimits::kVocabSize);
  p.at_most("model.seq_len", m.seq_len, ModelLimits::kSeqLen);
  p.at_most("model.max_seq_len", m.max_seq_len, ModelLimits::kSeqLen);
  p.at_most("model.d_model", m.d_model, ModelLimits::kDModel);
  p.at_most("model.n_layers", m.n_layers, ModelLimits::kLayers);
  p.at_most("model.ffn_hidden", m.ffn_hidden, ModelLimits::kFfnHidden);
  // With model.head_dim set the heads' width is its own, not a slice of d_model.
  if (m.n_heads > 0 && m.d_model % m.n_heads != 0 && !(m.arch == "llama" && m.head_dim > 0))
    p.add("model.n_heads = ", m.n_heads, " does not divide model.d_model = ", m.d_model,
          m.arch == "llama" ? " (or set model.head_dim)" : "");
  p.non_negative("model.max_seq_len", m.max_seq_len);
  if (m.max_seq_len > 0 && m.seq_len > m.max_seq_len)
    p.add("model.seq_len = ", m.seq_len, " exceeds model.max_seq_len = ", m.max_seq_len);
  if (!(m.init_std > 0 && std::isfinite(m.init_std)))
    p.add("model.init_std = ", format_double(m.init_std), " must be positive");
  if (!(m.embedding_multiplier > 0 && std::isfinite(m.embedding_multiplier)))
    p.add("model.embedding_multiplier = ", format_double(m.embedding_multiplier),
          " must be positive");
  validate_llama_keys(m, p);
  validate_moe_keys(m, p);
}

void validate_data(const DataConfig& d, Problems& p) {
  if (d.seed < -1) p.add("data.seed = ", d.seed, " must be >= 0, or -1 for train.seed's");
  try {
    if (!d.val_sets.empty()) (void)parse_val_sets(d.val_sets);
  } catch (const Error& e) {
    p.add(e.what());
  }
  if (d.blend.empty()) return;
  if (!d.train.empty())
    p.add("data.train = ", toml_quote(d.train), " and data.blend = ", toml_quote(d.blend),
          " are both set: set one (data.blend mixes several training corpora; "
          "`--set data.train=` clears data.train)");
  try {
    (void)parse_data_blend(d.blend);
  } catch (const Error& e) {
    p.add(e.what());
  }
}

// Every batch of the ramp-up must split as batch_size does: into micro-batches of every
// data-parallel rank (and, under an interleaved schedule, into groups of pp of them).
void validate_batch_rampup(const TrainConfig& t, const ParallelConfig& par, Problems& p) {
  std::optional<BatchRampup> ramp;
  try {
    ramp = parse_batch_rampup(t.batch_rampup);
  } catch (const Error& e) {
    p.add(e.what());
    return;
  }
  if (!ramp || t.batch_size <= 0 || t.micro_batch_size <= 0 || par.dp <= 0) return;
  if (ramp->start >= t.batch_size) {
    p.add("train.batch_rampup's START = ", ramp->start,
          " is not below train.batch_size = ", t.batch_size);
    return;
  }
  if ((t.batch_size - ramp->start) % ramp->increment != 0)
    p.add("train.batch_rampup: train.batch_size - START = ", t.batch_size - ramp->start,
          " is not a multiple of INCREMENT = ", ramp->increment);
  int64_t unit = t.micro_batch_size * par.dp;
  const char* what = "train.micro_batch_size × parallel.dp";
  if (par.pp > 1 && schedule_takes_groups_of_pp(par.schedule)) {
    unit *= par.pp;
    what = "train.micro_batch_size × parallel.dp × parallel.pp (an interleaved schedule's groups)";
  }
  if (ramp->start % unit != 0 || ramp->increment % unit != 0)
    p.add("train.batch_rampup: START = ", ramp->start, " and INCREMENT = ", ramp->increment,
          " must be multiples of ", what, " = ", unit, ", as every step's batch splits so");
  // The LR schedule counts sequences in full batches under a ramp: a warm-up longer than the
  // run's sequences would never reach train.lr.
  if (t.steps > 0 && t.warmup_steps > 0 &&
      t.warmup_steps * t.batch_size > t.samples_before(t.steps))
    p.add("train.warmup_steps = ", t.warmup_steps, " full batches (", t.warmup_steps * t.batch_size,
          " sequences) exceeds the run's ", t.samples_before(t.steps),
          " sequences under train.batch_rampup (the LR schedule counts sequences: the rate would "
          "never reach train.lr)");
}

void validate_train(const TrainConfig& t, const ParallelConfig& par, Problems& p) {
  p.positive("train.steps", t.steps);
  p.positive("train.batch_size", t.batch_size);
  p.positive("train.micro_batch_size", t.micro_batch_size);
  if (t.batch_size > 0 && t.micro_batch_size > 0 && par.dp > 0 &&
      t.batch_size % (t.micro_batch_size * par.dp) != 0)
    p.add("train.batch_size = ", t.batch_size,
          " is not divisible by train.micro_batch_size × parallel.dp = ", t.micro_batch_size, " × ",
          par.dp, " = ", t.micro_batch_size * par.dp);
  // An interleaved schedule takes the micro-batches of a step in groups of pp (make_schedule).
  else if (t.batch_size > 0 && t.micro_batch_size > 0 && par.dp > 0 && par.pp > 1 &&
           schedule_takes_groups_of_pp(par.schedule) &&
           (t.batch_size / (t.micro_batch_size * par.dp)) % par.pp != 0)
    p.add("parallel.schedule = ", toml_quote(par.schedule), " needs the micro-batches per step, ",
          "train.batch_size / (train.micro_batch_size × parallel.dp) = ",
          t.batch_size / (t.micro_batch_size * par.dp), ", to be a multiple of parallel.pp = ",
          par.pp);
  validate_batch_rampup(t, par, p);
  p.in_range("train.lr", t.lr, 0, kInf, /*hi_open=*/true);
  p.non_negative("train.warmup_steps", t.warmup_steps);
  if (t.steps > 0 && t.warmup_steps > t.steps)
    p.add("train.warmup_steps = ", t.warmup_steps, " exceeds train.steps = ", t.steps);
  p.one_of("train.lr_schedule", t.lr_schedule, {"cosine", "linear", "constant", "wsd"});
  p.in_range("train.min_lr_ratio", t.min_lr_ratio, 0, 1);
  if (!(t.lr_decay_fraction > 0 && t.lr_decay_fraction <= 1))
    p.add("train.lr_decay_fraction = ", format_double(t.lr_decay_fraction),
          " must be in (0, 1]: the share of train.steps that the wsd schedule decays over");
  p.in_range("train.weight_decay", t.weight_decay, 0, kInf, true);
  p.in_range("train.beta1", t.beta1, 0, 1, true);
  p.in_range("train.beta2", t.beta2, 0, 1, true);
  if (!(t.eps > 0 && std::isfinite(t.eps)))
    p.add("train.eps = ", format_double(t.eps), " must be positive");
  p.in_range("train.grad_clip", t.grad_clip, 0, kInf, true);
  p.in_range("train.z_loss", t.z_loss, 0, 1, true);
  p.one_of("train.loss_scale", t.loss_scale, {"auto", "none", "static", "dynamic"});
  const auto power_of_two = [](double s) {
    int exponent = 0;
    return s >= 1 && s <= 0x1p64 && std::frexp(s, &exponent) == 0.5;
  };
  if (!power_of_two(t.loss_scale_init))
    p.add("train.loss_scale_init = ", format_double(t.loss_scale_init),
          " must be a power of two in [1, 2^64] (so that scaling is exact)");
  if (!power_of_two(t.loss_scale_min) || t.loss_scale_min > t.loss_scale_init)
    p.add("train.loss_scale_min = ", format_double(t.loss_scale_min),
          " must be a power of two in [1, train.loss_scale_init]");
  p.positive("train.loss_scale_window", t.loss_scale_window);
  p.non_negative("train.seed", t.seed);
  p.non_negative("train.eval_every", t.eval_every);
  p.positive("train.eval_batches", t.eval_batches);
  p.non_negative("train.save_every", t.save_every);
  p.non_negative("train.keep_checkpoints", t.keep_checkpoints);
  p.one_of("train.checkpoint_format", t.checkpoint_format, {"whole", "sharded"});
  p.positive("train.log_every", t.log_every);
  // train.recompute = true is the deprecated spelling of parallel.recompute = "full".
  if (t.recompute && par.recompute == "selective")
    p.add("train.recompute = true (deprecated: parallel.recompute = \"full\") disagrees with ",
          "parallel.recompute = ", toml_quote(par.recompute), "; set parallel.recompute only");
}

void validate_parallel(const ParallelConfig& par, const ModelConfig& m, Problems& p) {
  // 0 = left out, inferred from the world size (resolve_parallel_degrees).
  p.non_negative("parallel.dp", par.dp);
  p.non_negative("parallel.tp", par.tp);
  p.non_negative("parallel.pp", par.pp);
  if (!(par.bucket_mb > 0)) p.add("parallel.bucket_mb = ", par.bucket_mb, " must be positive");
  p.one_of("parallel.grad_reduce_dtype", par.grad_reduce_dtype, {"fp32", "bf16"});
  p.one_of("parallel.param_gather_dtype", par.param_gather_dtype, {"fp32", "bf16"});
  p.one_of("parallel.pp_send_dtype", par.pp_send_dtype, {"fp32", "bf16"});
  p.one_of("parallel.tp_backward_overlap", par.tp_backward_overlap, {"auto", "on", "off"});
  if (par.param_gather_dtype == "bf16" && par.zero != 3)
    p.add("parallel.param_gather_dtype = \"bf16\" is for ZeRO-3's parameter gathers: it needs "
          "parallel.zero = 3, got ", par.zero);
  if (par.zero < 0 || par.zero > 3) p.add("parallel.zero = ", par.zero, " must be 0, 1, 2 or 3");
  p.one_of("parallel.schedule", par.schedule, kPipelineSchedules);
  p.one_of("parallel.recompute", par.recompute, {"none", "full", "selective"});
  p.positive("parallel.virtual_stages", par.virtual_stages);
  if (par.virtual_stages > 1 && !schedule_takes_chunks(par.schedule))
    p.add("parallel.virtual_stages = ", par.virtual_stages,
          " needs parallel.schedule = ", "\"interleaved\", \"zb-interleaved\" or \"zb-v\", got ",
          toml_quote(par.schedule));
  if (par.schedule == "zb-v" && par.pp > 1 && par.virtual_stages != 2)
    p.add(
        "parallel.schedule = \"zb-v\" runs two chunks per rank in a V: it needs "
        "parallel.virtual_stages = 2, got ",
        par.virtual_stages);
  if (par.virtual_stages > 1 && par.pp == 1)
    p.add("parallel.virtual_stages = ", par.virtual_stages, " needs parallel.pp > 1 (chunks ",
          "interleave across pipeline ranks)");
  // Megatron-style tensor parallelism splits whole attention heads across tp ranks.
  if (par.tp > 0 && m.n_heads > 0 && m.n_heads % par.tp != 0)
    p.add("parallel.tp = ", par.tp, " does not divide model.n_heads = ", m.n_heads);
  if (m.arch == "llama" && par.tp > 0 && m.n_heads > 0 && m.n_kv_heads >= 0) {
    // Each rank holds whole key/value heads and the query heads they serve, and a slice of
    // the SwiGLU's gate and up projections.
    if (m.resolved_n_kv_heads() > 0 && m.resolved_n_kv_heads() % par.tp != 0)
      p.add("parallel.tp = ", par.tp, " does not divide the key/value heads, model.n_kv_heads = ",
            m.resolved_n_kv_heads());
    if (m.d_model > 0 && m.d_model <= ModelLimits::kDModel && m.ffn_hidden >= 0 &&
        m.resolved_ffn_hidden() % par.tp != 0)
      p.add("parallel.tp = ", par.tp, " does not divide the SwiGLU's hidden width ",
            m.resolved_ffn_hidden(), " (model.ffn_hidden)");
  }
  // Context parallelism cuts each sequence into 2·cp chunks (parallel/context_parallel.h).
  p.positive("parallel.cp", par.cp);
  p.positive("parallel.ep", par.ep);
  p.non_negative("parallel.dp_shard", par.dp_shard);
  if (par.dp_shard > 0 && par.dp > 0) {
    if (par.dp % par.dp_shard != 0)
      p.add("parallel.dp_shard = ", par.dp_shard, " does not divide parallel.dp = ", par.dp,
            " (ZeRO's state is sharded over groups of dp_shard data-parallel ranks)");
    else if (par.dp_shard < par.dp && par.zero == 0)
      p.add("parallel.dp_shard = ", par.dp_shard, " shards ZeRO's state, and parallel.zero = 0 ",
            "shards nothing: set parallel.zero to 1, 2 or 3, or leave parallel.dp_shard out");
  }
  p.one_of("parallel.ep_dispatch", par.ep_dispatch, {"all_gather", "all_to_all"});
  p.one_of("parallel.cp_comm", par.cp_comm, {"all_gather", "ring"});
  if (par.cp > 1 && m.seq_len > 0 && m.seq_len % (2 * par.cp) != 0)
    p.add("parallel.cp = ", par.cp, " cuts each sequence into ", 2 * par.cp,
          " chunks (two per rank, for balance): model.seq_len = ", m.seq_len,
          " is not a multiple of ", 2 * par.cp);
  // Every pipeline stage (times its virtual chunks) needs at least one block.
  if (par.pp > 0 && par.virtual_stages > 0 && m.n_layers > 0 &&
      int64_t{par.pp} * par.virtual_stages > m.n_layers)
    p.add("parallel.pp × parallel.virtual_stages = ", par.pp, " × ", par.virtual_stages, " = ",
          int64_t{par.pp} * par.virtual_stages, " exceeds model.n_layers = ", m.n_layers);
}

void validate_runtime(const RuntimeConfig& r, const ParallelConfig& par, Problems& p) {
  p.positive("runtime.ranks", r.ranks);
  const int64_t world = int64_t{par.dp} * par.tp * par.pp * std::max(par.cp, 1);
  if (r.ranks > 0 && par.dp > 0 && par.tp > 0 && par.pp > 0 && r.ranks != world) {
    if (par.cp > 1)
      p.add("runtime.ranks = ", r.ranks,
            " does not equal parallel.dp × parallel.tp × parallel.pp × parallel.cp = ", par.dp,
            " × ", par.tp, " × ", par.pp, " × ", par.cp, " = ", world);
    else
      p.add("runtime.ranks = ", r.ranks,
            " does not equal parallel.dp × parallel.tp × parallel.pp = ", par.dp, " × ", par.tp,
            " × ", par.pp, " = ", world);
  }

  p.one_of("runtime.backend", r.backend, {"auto", "local", "mpi", "nccl"});
  if (!valid_device(r.device))
    p.add("runtime.device = ", toml_quote(r.device), " must be \"cpu\", \"cuda\" or \"cuda:N\"");
  else if (r.backend == "nccl" && !r.device.starts_with("cuda"))
    p.add("runtime.backend = \"nccl\" needs a cuda runtime.device, got ", toml_quote(r.device));
  p.one_of("runtime.matmul_precision", r.matmul_precision, {"fp32", "tf32", "bf16", "fp16", "fp8"});
  p.positive("runtime.fp8_block", r.fp8_block);
  if ((r.matmul_precision == "tf32" || r.matmul_precision == "fp16") && valid_device(r.device) &&
      !r.device.starts_with("cuda"))
    p.add("runtime.matmul_precision = ", toml_quote(r.matmul_precision),
          " needs runtime.device = \"cuda\": CPU ranks run fp32 or bf16 GEMMs");
  p.non_negative("runtime.threads_per_rank", r.threads_per_rank);
}

void validate_metrics(const MetricsConfig& m, Problems& p) {
  p.in_range("metrics.prometheus_port", m.prometheus_port, 0, 65535);
  if (!(m.peak_tflops >= 0)) p.add("metrics.peak_tflops = ", m.peak_tflops, " must be >= 0");
  p.non_negative("metrics.trace_from_step", m.trace_from_step);
  p.positive("metrics.trace_steps", m.trace_steps);
}

}  // namespace

void validate(const Config& config) {
  Problems problems;
  validate_model(config.model, problems);
  validate_data(config.data, problems);
  if ((config.data.document_mask || config.data.eod_mask_loss) &&
      (config.data.eot_token < 0 || config.data.eot_token >= config.model.vocab_size))
    problems.add("data.eot_token = ", config.data.eot_token,
                 " is not a token id of model.vocab_size = ", config.model.vocab_size,
                 config.data.document_mask ? " (data.document_mask ends documents at it)"
                                           : " (data.eod_mask_loss masks the loss at it)");
  if (config.data.reset_position_ids && !config.data.document_mask)
    problems.add(
        "data.reset_position_ids = true needs data.document_mask = true: positions "
        "restart at each document only where each token attends within its document");
  validate_train(config.train, config.parallel, problems);
  validate_parallel(config.parallel, config.model, problems);
  validate_runtime(config.runtime, config.parallel, problems);
  validate_metrics(config.metrics, problems);
  // fp8 blocks must not straddle tensor-parallel shards (each shard's width is a multiple of
  // d_model / tp): then every layout quantizes exactly as one device (kernels/cpu/fp8.h).
  const RuntimeConfig& r = config.runtime;
  const int64_t tp = config.parallel.tp, d = config.model.d_model;
  if (r.matmul_precision == "fp8" && r.fp8_block > 0 && tp > 1 && d > 0 && d % tp == 0 &&
      (d / tp) % r.fp8_block != 0)
    problems.add("runtime.fp8_block = ", r.fp8_block, " does not divide model.d_model / ",
                 "parallel.tp = ", d / tp, ": a block would straddle two tensor-parallel shards ",
                 "and the layout would quantize differently from one device");
  const ModelConfig& m = config.model;
  // Expert parallelism splits a mixture's experts over groups of data-parallel ranks.
  const ParallelConfig& par = config.parallel;
  if (par.ep > 1) {
    if (m.moe_experts == 0)
      problems.add("parallel.ep = ", par.ep,
                   " splits a mixture's experts: it needs "
                   "model.moe_experts > 0");
    else if (m.moe_experts > 0 && m.moe_experts % par.ep != 0)
      problems.add("parallel.ep = ", par.ep,
                   " does not divide model.moe_experts = ", m.moe_experts);
    if (par.dp > 0 && par.dp % par.ep != 0)
      problems.add("parallel.ep = ", par.ep, " does not divide parallel.dp = ", par.dp,
                   " (expert-parallel groups are made of data-parallel ranks)");
  }
  if (m.arch == "llama" && r.matmul_precision == "fp8" && r.fp8_block > 0 && tp > 1 &&
      m.n_heads > 0 && m.resolved_head_dim() > 0 && m.resolved_n_kv_heads() > 0) {
    const int64_t kv_width = m.resolved_n_kv_heads() * m.resolved_head_dim();
    const int64_t hidden = m.resolved_ffn_hidden();
    for (const auto& [what, width] :
         {std::pair<const char*, int64_t>{"the key/value projections' width ", kv_width},
          {"the queries' width ", m.n_heads * m.resolved_head_dim()},
          {"the SwiGLU's hidden width ", hidden}})
      if (width % tp == 0 && (width / tp) % r.fp8_block != 0)
        problems.add("runtime.fp8_block = ", r.fp8_block, " does not divide ", what, width,
                     " / parallel.tp = ", width / tp, ": a block would straddle two ",
                     "tensor-parallel shards");
  }
  problems.throw_if_any();
}

}  // namespace loom
