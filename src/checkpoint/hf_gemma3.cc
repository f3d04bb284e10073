#include "checkpoint/hf_gemma3.h"

#include <cmath>

#include "base/error.h"
#include "base/json_number.h"
#include "checkpoint/hf_rope.h"

namespace loom {

namespace {
// Gemma's embedding scale: √hidden_size as a float32 tensor (transformers'
// Gemma3TextScaledWordEmbedding), so the float nearest the root.
float gemma_embedding_scale(int64_t d_model) {
  return static_cast<float>(std::sqrt(static_cast<double>(d_model)));
}

// What of `c` no Gemma 3 holds, or "" (export and import name it).
std::string not_gemma3(const Gpt2Config& c) {
  if (!c.llama()) return "model.arch = \"gpt2\"";
  if (!c.sandwich_norm) return "no sandwich norms (model.norm_placement = \"sandwich\")";
  if (c.ffn_activation != GatedActivation::kGeluTanh)
    return "no GeGLU (model.ffn_activation = \"gelu_tanh\")";
  if (!c.qk_norm || c.qk_norm_full)
    return "no per-head query/key norms (model.qk_norm = true, model.qk_norm_scope = \"head\")";
  if (c.qkv_bias) return "qkv biases (model.qkv_bias)";
  if (c.moe()) return "a mixture of experts (model.moe_experts)";
  if (c.sliding_window == 0 || c.full_attention_every == 0)
    return "no sliding window in all but every N-th block (model.sliding_window, "
           "model.full_attention_every)";
  if (c.rope_scaling_factor > 0 && !c.rope_scaling_linear)
    return "Llama 3.1's rope scaling (model.rope_scaling = \"llama3\"; Gemma's is \"linear\")";
  if (c.embedding_multiplier != gemma_embedding_scale(c.d_model))
    return detail::concat("model.embedding_multiplier = ", c.embedding_multiplier, ", not √",
                          c.d_model, " = ", gemma_embedding_scale(c.d_model));
  return "";
}

// The scores' scale's square root as Gemma writes it: model.query_pre_attn_scalar, else head_dim.
int64_t query_pre_attn_scalar(const Gpt2Config& c) {
  return c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : c.head_dim();
}
}  // namespace

bool has_gemma_parts(const Gpt2Config& c) {
  return c.sandwich_norm || c.ffn_activation != GatedActivation::kSilu ||
         c.embedding_multiplier != 1.0f || c.rope_local_theta > 0 ||
         (c.query_pre_attn_scalar > 0 && c.query_pre_attn_scalar != c.head_dim());
}

HfFiles gemma3_files(const Gpt2Config& c, bool bf16) {
  const std::string missing = not_gemma3(c);
  if (!missing.empty())
    fail("loom checkpoint export: a model with Gemma's parts is written as a Gemma3ForCausalLM, ",
         "which this one is not: ", missing);
  HfFiles f;
  const auto put = [&](const std::string& name, const std::string& source, int64_t row = 0,
                       int64_t rows = -1) {
    f.tensors.push_back({name, source, row, rows});
  };
  const auto gain = [&](const std::string& name, const std::string& source) {
    f.tensors.push_back({name, source, 0, -1, HfTensor::Op::kGain});
  };
  const int64_t Q = c.attention_width(), kv = c.kv_heads() * c.head_dim(), H = c.ffn_hidden;
  put("model.embed_tokens.weight", "wte.weight");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string ours = "blocks." + std::to_string(l) + ".";
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    put(hf + "self_attn.q_proj.weight", ours + "attn.qkv.weight", 0, Q);
    put(hf + "self_attn.k_proj.weight", ours + "attn.qkv.weight", Q, kv);
    put(hf + "self_attn.v_proj.weight", ours + "attn.qkv.weight", Q + kv, kv);
    put(hf + "self_attn.o_proj.weight", ours + "attn.proj.weight");
    gain(hf + "self_attn.q_norm.weight", ours + "attn.q_norm.weight");
    gain(hf + "self_attn.k_norm.weight", ours + "attn.k_norm.weight");
    put(hf + "mlp.gate_proj.weight", ours + "mlp.fc.weight", 0, H);
    put(hf + "mlp.up_proj.weight", ours + "mlp.fc.weight", H, H);
    put(hf + "mlp.down_proj.weight", ours + "mlp.proj.weight");
    gain(hf + "input_layernorm.weight", ours + "ln_1.weight");
    gain(hf + "post_attention_layernorm.weight", ours + "attn_out_norm.weight");
    gain(hf + "pre_feedforward_layernorm.weight", ours + "ln_2.weight");
    gain(hf + "post_feedforward_layernorm.weight", ours + "mlp_out_norm.weight");
  }
  gain("model.norm.weight", "ln_f.weight");
  if (!c.tie_embeddings) put("lm_head.weight", "lm_head.weight");
  // Gemma3TextConfig's keys (transformers 4.51's sliding_window_pattern, and the layer_types
  // later versions read instead).
  nlohmann::json layer_types = nlohmann::json::array();
  for (int64_t l = 0; l < c.n_layers; ++l)
    layer_types.push_back(c.window_of(l) > 0 ? "sliding_attention" : "full_attention");
  f.config = {{"architectures", {"Gemma3ForCausalLM"}},
              {"model_type", "gemma3_text"},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.d_model},
              {"intermediate_size", H},
              {"num_hidden_layers", c.n_layers},
              {"num_attention_heads", c.n_heads},
              {"num_key_value_heads", c.kv_heads()},
              {"head_dim", c.head_dim()},
              {"query_pre_attn_scalar", query_pre_attn_scalar(c)},
              {"hidden_activation", "gelu_pytorch_tanh"},
              {"max_position_embeddings", c.max_seq_len},
              {"rms_norm_eps", c.norm_eps},
              {"rope_theta", c.rope_theta},
              {"rope_local_base_freq", c.rope_local_theta > 0 ? c.rope_local_theta : c.rope_theta},
              {"rope_scaling", hf_rope_scaling(c)},
              {"sliding_window", c.sliding_window},
              {"sliding_window_pattern", c.full_attention_every},
              {"layer_types", layer_types},
              {"final_logit_softcapping", nullptr},
              {"attn_logit_softcapping", nullptr},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"initializer_range", std::round(static_cast<double>(c.init_std) * 1e6) / 1e6},
              {"tie_word_embeddings", c.tie_embeddings},
              {"torch_dtype", bf16 ? "bfloat16" : "float32"},
              {"exported_by", "loom export"}};
  return f;
}

int64_t check_gemma3_config(const std::string& config_path, const nlohmann::json& outer,
                            const Gpt2Config& model) {
  const std::string model_type = outer.value("model_type", std::string("(none)"));
  if (model_type != "gemma3_text" && model_type != "gemma3")
    fail(config_path, ": model_type = ", model_type, ", but the model has Gemma's parts ",
         "(sandwich norms, GeGLU, model.embedding_multiplier, model.rope_local_theta or ",
         "model.query_pre_attn_scalar): it ",
         "starts from a Gemma3ForCausalLM directory (model_type gemma3_text) or a ",
         "Gemma3ForConditionalGeneration's (gemma3)");
  const std::string missing = not_gemma3(model);
  if (!missing.empty())
    fail(config_path, ": model_type = ", model_type, ", but the model has ", missing);
  // Gemma3ForConditionalGeneration (4B and up): the text model's keys under text_config (absent:
  // Gemma3TextConfig's defaults, as transformers reads it), named so in the messages below.
  const bool nested = model_type == "gemma3";
  const nlohmann::json& config =
      nested && outer.contains("text_config") ? outer.at("text_config") : outer;
  if (nested && !config.is_object())
    fail(config_path, ": text_config is ", config.type_name(), ", not the text model's settings");
  const std::string in = config_path + (nested ? ": text_config" : "");
  const auto integer = [&](const char* name, int64_t fallback) -> int64_t {
    if (!config.contains(name)) return fallback;
    try {
      return json_integer<int64_t>(config.at(name));
    } catch (const nlohmann::json::exception&) {
      fail(in, ": \"", name, "\" is no integer (of int64's range)");
    }
  };
  const auto expect = [&](const char* name, int64_t theirs, int64_t ours, const char* key) {
    if (theirs != ours) fail(in, ": ", name, " = ", theirs, " but ", key, " = ", ours);
  };
  // Gemma3TextConfig's defaults where a key is absent.
  expect("hidden_size", integer("hidden_size", 2304), model.d_model, "model.d_model");
  expect("num_hidden_layers", integer("num_hidden_layers", 26), model.n_layers, "model.n_layers");
  expect("num_attention_heads", integer("num_attention_heads", 8), model.n_heads, "model.n_heads");
  expect("num_key_value_heads", integer("num_key_value_heads", 4), model.kv_heads(),
         "model.n_kv_heads");
  expect("head_dim", integer("head_dim", 256), model.head_dim(), "model.head_dim");
  expect("intermediate_size", integer("intermediate_size", 9216), model.ffn_hidden,
         "model.ffn_hidden");
  // The scores' scale: 1/√head_dim in 1B to 12B, 1/√168 in 27B (heads of 128).
  expect("query_pre_attn_scalar", integer("query_pre_attn_scalar", 256),
         query_pre_attn_scalar(model),
         model.query_pre_attn_scalar > 0 ? "model.query_pre_attn_scalar"
                                         : "model.head_dim (model.query_pre_attn_scalar unset)");
  expect("sliding_window", integer("sliding_window", 4096), model.sliding_window,
         "model.sliding_window");
  expect("sliding_window_pattern", integer("sliding_window_pattern", 6), model.full_attention_every,
         "model.full_attention_every");
  const double theta = config.value("rope_theta", 1e6);
  const double local = config.value("rope_local_base_freq", 10000.0);
  if (theta != model.rope_theta)
    fail(in, ": rope_theta = ", theta, " but model.rope_theta = ", model.rope_theta);
  const double our_local = model.rope_local_theta > 0 ? model.rope_local_theta : model.rope_theta;
  if (local != our_local)
    fail(in, ": rope_local_base_freq = ", local, " but the windowed blocks' base is ", our_local,
         " (model.rope_local_theta)");
  const double eps = config.value("rms_norm_eps", 1e-6);
  if (eps != model.norm_eps)
    fail(in, ": rms_norm_eps = ", eps, " but model.norm_eps = ", model.norm_eps);
  // Gemma 3 4B+'s linear scaling (its whole-sequence blocks'; Gpt2Config::block leaves the
  // windowed ones unscaled, as transformers' rotary_emb_local).
  check_hf_rope_scaling(in, config.value("rope_scaling", nlohmann::json()), model);
  for (const char* absent : {"final_logit_softcapping", "attn_logit_softcapping"})
    if (!config.value(absent, nlohmann::json()).is_null())
      fail(in, ": ", absent, " = ", config[absent].dump(),
           ": Loom's Gemma 3 has none (nor has Gemma 3)");
  if (config.value("hidden_activation", std::string("gelu_pytorch_tanh")) != "gelu_pytorch_tanh")
    fail(in, ": hidden_activation = ", config["hidden_activation"].dump(),
         ", Loom's GeGLU is gelu_pytorch_tanh's");
  if (config.value("attention_bias", false))
    fail(in, ": attention_bias: Loom's Gemma 3 has no biases");
  const bool tied = config.value("tie_word_embeddings", true);  // Gemma3TextConfig's default
  if (tied != model.tie_embeddings)
    fail(in, ": tie_word_embeddings = ", tied ? "true" : "false",
         " but model.tie_embeddings = ", model.tie_embeddings ? "true" : "false");
  const int64_t vocab = integer("vocab_size", 262208);
  if (vocab > model.vocab_size)
    fail(in, ": vocab_size = ", vocab, " exceeds model.vocab_size = ", model.vocab_size);
  return vocab;
}

Gemma3Names gemma3_names(const std::function<bool(const std::string&)>& has) {
  if (has("language_model.model.embed_tokens.weight"))  // transformers 4.50-4.51
    return {"language_model.model.", "language_model.lm_head.weight"};
  if (has("model.language_model.embed_tokens.weight"))  // 4.52 on
    return {"model.language_model.", "lm_head.weight"};
  return {};
}

HfSources gemma3_sources(const std::string& n, const Gpt2Config& model, int64_t vocab,
                         const Gemma3Names& names) {
  const int64_t C = model.d_model;
  if (n == "wte.weight") return {{{names.text + "embed_tokens.weight", {vocab, C}}}};
  if (n == "lm_head.weight") return {{{names.head, {vocab, C}}}};
  if (n == "ln_f.weight") return {{{names.text + "norm.weight", {C}}}, true};
  if (!n.starts_with("blocks.")) return {};
  const size_t dot = n.find('.', 7);
  const std::string hf = names.text + "layers." + n.substr(7, dot - 7) + ".",
                    rest = n.substr(dot + 1);
  if (rest == "ln_1.weight") return {{{hf + "input_layernorm.weight", {C}}}, true};
  if (rest == "attn_out_norm.weight")
    return {{{hf + "post_attention_layernorm.weight", {C}}}, true};
  if (rest == "ln_2.weight") return {{{hf + "pre_feedforward_layernorm.weight", {C}}}, true};
  if (rest == "mlp_out_norm.weight")
    return {{{hf + "post_feedforward_layernorm.weight", {C}}}, true};
  if (rest == "attn.q_norm.weight")
    return {{{hf + "self_attn.q_norm.weight", {model.head_dim()}}}, true};
  if (rest == "attn.k_norm.weight")
    return {{{hf + "self_attn.k_norm.weight", {model.head_dim()}}}, true};
  return {};  // the projections: Llama's names (checkpoint/export.cc)
}

}  // namespace loom
