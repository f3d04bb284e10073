#include "checkpoint/export.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "base/error.h"
#include "base/json_number.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/hf_gemma3.h"
#include "checkpoint/hf_rope.h"
#include "checkpoint/safetensors.h"
#include "data/bpe_tokenizer.h"
#include "device/device.h"
#include "tensor/dtype.h"

namespace loom {
namespace fs = std::filesystem;

namespace {

const std::pair<const char*, const char*> kHfParts[] = {{"attn.qkv.", "attn.c_attn."},
                                                        {"attn.proj.", "attn.c_proj."},
                                                        {"mlp.fc.", "mlp.c_fc."},
                                                        {"mlp.proj.", "mlp.c_proj."},
                                                        {"ln_1.", "ln_1."},
                                                        {"ln_2.", "ln_2."}};

// A host f32 tensor of `t` (2-D) transposed.
Tensor transposed(const Tensor& t) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  Tensor out = Tensor::empty({cols, rows}, DType::kF32, Device::cpu());
  const float* src = t.data<float>();
  float* dst = out.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  return out;
}

// A host f32 tensor as it is, or rounded to bf16 (nearest, ties to even).
Tensor in_dtype(const Tensor& t, bool bf16) {
  return bf16 ? t.to(DType::kBF16) : t;
}

// `write` into a file or directory beside `out`, then renamed over it: a failed export leaves
// what was there, and removes what it had written (a model's worth of files, maybe).
template <typename Write>
void replace_atomically(const fs::path& out, bool directory, const Write& write) {
  const fs::path tmp = out.string() + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  try {
    if (directory) fs::create_directories(tmp);
    write(tmp);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  if (fs::exists(out)) fs::remove_all(out);
  fs::rename(tmp, out);
}

void write_config_json(const fs::path& dir, const nlohmann::json& config) {
  std::ofstream f(dir / "config.json");
  f << config.dump(2) << "\n";
  if (!f) fail("cannot write ", (dir / "config.json").string());
}

// transformers' GPT2LMHeadModel: every parameter under its HuggingFace name (hf_name_of), the
// Linear weights transposed to Conv1D's in × out.
HfFiles gpt2_files(const Gpt2Config& c, const std::vector<std::string>& params, bool bf16) {
  HfFiles f;
  for (const std::string& name : params) {
    const HfName hf = hf_name_of(name);
    f.tensors.push_back(
        {hf.name, name, 0, -1, hf.transposed ? HfTensor::Op::kTranspose : HfTensor::Op::kCopy});
  }
  const nlohmann::json config = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", c.vocab_size},
      {"n_positions", c.max_seq_len},
      {"n_ctx", c.max_seq_len},
      {"n_embd", c.d_model},
      {"n_layer", c.n_layers},
      {"n_head", c.n_heads},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},  // the tanh approximation, as Loom's
      {"layer_norm_epsilon", 1e-5},
      {"initializer_range", std::round(static_cast<double>(c.init_std) * 1e6) / 1e6},
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"tie_word_embeddings", c.tie_embeddings},
      {"torch_dtype", bf16 ? "bfloat16" : "float32"},
      {"exported_by", "loom export"}};
  f.config = config;
  return f;
}

// A mixture of experts' HuggingFace names: Mixtral's, or (model.qk_norm) Qwen 3's, which OLMoE
// (full-width query/key norms) shares.
struct HfMoeNames {
  const char *block, *gate, *up, *down;  // the block under a layer; an expert's three weights
  const char* model;                     // the class
};
HfMoeNames hf_moe_names(const Gpt2Config& c) {
  if (c.qk_norm)
    return {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
            c.qk_norm_full ? "OlmoeForCausalLM" : "Qwen3MoeForCausalLM"};
  return {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", "MixtralForCausalLM"};
}

// OLMo 2's form (Olmo2ForCausalLM): post-norms and query/key norms over all the heads, and no
// qkv biases, mixture, model.head_dim or window. Export and import both ask it.
bool olmo2_form(const Gpt2Config& c) {
  return c.post_norm && c.qk_norm && c.qk_norm_full && !c.qkv_bias && !c.moe() &&
         c.head_width == 0 && c.sliding_window == 0;
}

// OLMoE's form (OlmoeForCausalLM): a mixture of experts with pre-norms and query/key norms over
// all the heads, no qkv biases, model.head_dim or window.
bool olmoe_form(const Gpt2Config& c) {
  return c.moe() && c.qk_norm && c.qk_norm_full && !c.post_norm && !c.qkv_bias &&
         c.head_width == 0 && c.sliding_window == 0;
}

// transformers' LlamaForCausalLM (save_pretrained's names; nn.Linear weights are out × in as
// here). The fused qkv and gate/up weights are written as their q/k/v and gate/up row blocks;
// a tied LM head is model.embed_tokens (tie_word_embeddings), so not written; an untied one is
// lm_head.weight. With qkv biases (model.qkv_bias) a Qwen2ForCausalLM: the same names, the
// fused bias as q/k/v_proj.bias. With query/key norms (model.qk_norm) a Qwen3ForCausalLM: the same
// names and self_attn.q_norm / k_norm. With post-norms and full-width query/key norms an
// Olmo2ForCausalLM: post_attention_layernorm and post_feedforward_layernorm for ln_1 and ln_2. A
// mixture with full-width query/key norms (pre-norms) an OlmoeForCausalLM: Qwen 3 MoE's names.
HfFiles llama_files(const Gpt2Config& c, bool bf16) {
  HfFiles f;
  // put(name, source): the whole parameter; put(name, source, row, rows): a fused one's rows.
  const auto put = [&](const std::string& name, const std::string& source, int64_t row = 0,
                       int64_t rows = -1) {
    f.tensors.push_back({name, source, row, rows});
  };
  if (c.qk_norm && c.qkv_bias)
    fail("loom checkpoint export: a model with model.qk_norm is written as a Qwen3ForCausalLM, ",
         "which has a bias on its output projection wherever it has qkv biases: no HuggingFace ",
         "class holds this model");
  const bool olmoe = olmoe_form(c);
  if ((c.post_norm || c.qk_norm_full) && !olmoe && !olmo2_form(c))
    fail("loom checkpoint export: post-norms (model.norm_placement) and full-width query/key ",
         "norms (model.qk_norm_scope) are written as an Olmo2ForCausalLM, which has both, and ",
         "no qkv biases, mixture, model.head_dim or sliding window (a mixture with full-width ",
         "norms and pre-norms as an OlmoeForCausalLM): no HuggingFace class holds this model");
  const bool olmo2 = c.post_norm;
  if (c.full_attention_every > 0)
    fail("loom checkpoint export: a window in some blocks only (model.full_attention_every = ",
         c.full_attention_every, ") is not a Llama, Mistral, Mixtral or Qwen directory's: no ",
         "class Loom writes holds it");
  put("model.embed_tokens.weight", "wte.weight");
  // Q: the queries' rows (n_heads·head_dim, d_model unless model.head_dim says otherwise).
  const int64_t C = c.d_model, Q = c.attention_width(), kv = c.kv_heads() * c.head_dim(),
                H = c.ffn_hidden;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string ours = "blocks." + std::to_string(l) + ".";
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    if (!olmo2) put(hf + "input_layernorm.weight", ours + "ln_1.weight");
    const std::string qkv = ours + "attn.qkv.weight";
    put(hf + "self_attn.q_proj.weight", qkv, 0, Q);
    put(hf + "self_attn.k_proj.weight", qkv, Q, kv);
    put(hf + "self_attn.v_proj.weight", qkv, Q + kv, kv);
    if (c.qkv_bias) {
      const std::string bias = ours + "attn.qkv.bias";
      put(hf + "self_attn.q_proj.bias", bias, 0, Q);
      put(hf + "self_attn.k_proj.bias", bias, Q, kv);
      put(hf + "self_attn.v_proj.bias", bias, Q + kv, kv);
    }
    if (c.qk_norm) {
      put(hf + "self_attn.q_norm.weight", ours + "attn.q_norm.weight");
      put(hf + "self_attn.k_norm.weight", ours + "attn.k_norm.weight");
    }
    put(hf + "self_attn.o_proj.weight", ours + "attn.proj.weight");
    if (olmo2) {  // the post-norms: after the attention and after the MLP
      put(hf + "post_attention_layernorm.weight", ours + "ln_1.weight");
      put(hf + "post_feedforward_layernorm.weight", ours + "ln_2.weight");
    } else {
      put(hf + "post_attention_layernorm.weight", ours + "ln_2.weight");
    }
    if (c.moe()) {
      // Mixtral's sparse MoE block (block_sparse_moe: the router as its gate, w1 / w3 / w2
      // experts), or with qk_norm Qwen 3's (mlp: gate, gate_proj / up_proj / down_proj experts).
      const HfMoeNames names = hf_moe_names(c);
      const std::string block = hf + names.block;
      put(block + "gate.weight", ours + "mlp.router.weight");
      for (int64_t e = 0; e < c.moe_experts; ++e) {
        const std::string expert = ours + "mlp.experts." + std::to_string(e) + ".";
        const std::string theirs = block + "experts." + std::to_string(e) + ".";
        put(theirs + names.gate, expert + "fc.weight", 0, H);
        put(theirs + names.up, expert + "fc.weight", H, H);
        put(theirs + names.down, expert + "proj.weight");
      }
      continue;
    }
    put(hf + "mlp.gate_proj.weight", ours + "mlp.fc.weight", 0, H);
    put(hf + "mlp.up_proj.weight", ours + "mlp.fc.weight", H, H);
    put(hf + "mlp.down_proj.weight", ours + "mlp.proj.weight");
  }
  put("model.norm.weight", "ln_f.weight");
  if (!c.tie_embeddings) put("lm_head.weight", "lm_head.weight");
  nlohmann::json config = {
      {"architectures", {c.moe() ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", c.moe() ? "mixtral" : "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", C},
      {"intermediate_size", H},
      {"num_hidden_layers", c.n_layers},
      {"num_attention_heads", c.n_heads},
      {"num_key_value_heads", c.kv_heads()},
      {"head_dim", c.head_dim()},
      {"max_position_embeddings", c.max_seq_len},
      {"hidden_act", "silu"},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", hf_rope_scaling(c)},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"initializer_range", std::round(static_cast<double>(c.init_std) * 1e6) / 1e6},
      {"tie_word_embeddings", c.tie_embeddings},
      {"torch_dtype", bf16 ? "bfloat16" : "float32"},
      {"exported_by", "loom export"}};
  if (c.moe()) {
    // MixtralConfig's: no sliding window (Loom's attention is causal over the whole sequence);
    // its router loss is batch-wise, Loom's per sequence (docs/moe.md): the coefficient is ours.
    config["num_local_experts"] = c.moe_experts;
    config["num_experts_per_tok"] = c.moe_top_k;
    config["router_aux_loss_coef"] =
        std::round(static_cast<double>(c.moe_aux_loss_coef) * 1e6) / 1e6;
    config["output_router_logits"] = false;
    config["sliding_window"] = nullptr;
    for (const char* llama_only : {"rope_scaling", "attention_bias", "mlp_bias"})
      config.erase(llama_only);
    if (c.head_width == 0) config.erase("head_dim");  // MixtralConfig's since transformers 4.46
  }
  if (c.qkv_bias || c.qk_norm) {
    // Qwen2Config's (the biases implied) and Qwen3Config's (the norms implied, no biases): their
    // sliding window off (Loom's attention is causal over the whole sequence); head_dim Qwen 3's
    // always (its default is 128), Qwen 2's where it is not hidden_size / num_attention_heads
    // (read since transformers 4.48).
    config["architectures"] = {c.qk_norm ? "Qwen3ForCausalLM" : "Qwen2ForCausalLM"};
    config["model_type"] = c.qk_norm ? "qwen3" : "qwen2";
    config["use_sliding_window"] = false;
    config["sliding_window"] = nullptr;
    config["max_window_layers"] = c.n_layers;
    for (const char* llama_only : {"attention_bias", "mlp_bias"}) config.erase(llama_only);
    if (c.qk_norm) config["attention_bias"] = false;
    if (!c.qk_norm && c.head_width == 0) config.erase("head_dim");
  }
  if (c.sliding_window > 0) {
    // The window (nn/sliding_window.h, as transformers 4.51 counts it: the query's position and
    // the W − 1 before): a dense Llama's as a MistralForCausalLM, Mixtral's sliding_window, Qwen's
    // used from block 0 on.
    config["sliding_window"] = c.sliding_window;
    if (c.qkv_bias || c.qk_norm) {
      config["use_sliding_window"] = true;
      config["max_window_layers"] = 0;
    } else if (!c.moe()) {
      config["architectures"] = {"MistralForCausalLM"};
      config["model_type"] = "mistral";
      for (const char* llama_only : {"attention_bias", "mlp_bias"}) config.erase(llama_only);
    }
  }
  if (olmo2) {
    // Olmo2Config's: no head_dim (hidden_size / num_attention_heads), no mlp_bias.
    config["architectures"] = {"Olmo2ForCausalLM"};
    config["model_type"] = "olmo2";
    for (const char* llama_only : {"head_dim", "mlp_bias"}) config.erase(llama_only);
  }
  if (olmoe) {
    // OlmoeConfig's: its experts intermediate_size wide, every block sparse, no head_dim
    // (hidden_size / num_attention_heads), the chosen weights normalised or not (norm_topk_prob,
    // false in OLMoE), no clamping of the queries and keys (clip_qkv), its router loss batch-wise.
    config["architectures"] = {"OlmoeForCausalLM"};
    config["model_type"] = "olmoe";
    config.erase("num_local_experts");
    config.erase("sliding_window");
    config["num_experts"] = c.moe_experts;
    config["norm_topk_prob"] = c.moe_router_norm_topk_prob;
    config["clip_qkv"] = nullptr;
    config["attention_bias"] = false;
  } else if (c.moe() && c.qk_norm) {
    // Qwen3MoeConfig's: every block sparse (decoder_sparse_step 1, no mlp_only_layers), its
    // experts moe_intermediate_size wide (intermediate_size, its dense blocks', unused), the
    // chosen weights normalised or not (norm_topk_prob), its router loss batch-wise as Mixtral's.
    config["architectures"] = {"Qwen3MoeForCausalLM"};
    config["model_type"] = "qwen3_moe";
    config.erase("num_local_experts");
    config["num_experts"] = c.moe_experts;
    config["moe_intermediate_size"] = H;
    config["norm_topk_prob"] = c.moe_router_norm_topk_prob;
    config["decoder_sparse_step"] = 1;
    config["mlp_only_layers"] = nlohmann::json::array();
    config["head_dim"] = c.head_dim();
  }
  f.config = config;
  return f;
}

// The values of an exported tensor: its rows of its parameter, transformed, in the file's dtype.
// Consecutive tensors of one parameter (a fused weight's pieces) read it once.
class HfValues {
 public:
  explicit HfValues(const CheckpointReader& from) : from_(from) {}
  Shape shape(const HfTensor& t) const {
    Shape s = from_.shape(t.source);
    if (t.rows >= 0) {
      if (s.empty() || t.row < 0 || t.row + t.rows > s[0])
        fail("export: rows [", t.row, ", ", t.row + t.rows, ") of '", t.source, "' of shape ",
             shape_str(s));
      s[0] = t.rows;
    }
    if (t.op == HfTensor::Op::kTranspose) {
      LOOM_CHECK_MSG(s.size() == 2, "only matrices are transposed");
      std::swap(s[0], s[1]);
    }
    return s;
  }
  Tensor operator()(const HfTensor& t, bool bf16) {
    if (t.source != cached_name_) {
      cached_ = Tensor();  // the previous parameter's memory goes before the next is read
      cached_ = from_.read(t.source);
      cached_name_ = t.source;
    }
    Tensor v = t.rows >= 0 ? cached_.narrow(t.row, t.rows) : cached_;
    if (t.op == HfTensor::Op::kTranspose) v = transposed(v);
    if (t.op == HfTensor::Op::kGain) {
      Tensor w = Tensor::empty(v.shape(), DType::kF32, Device::cpu());
      for (int64_t i = 0; i < v.numel(); ++i) w.data<float>()[i] = v.data<float>()[i] - 1.0f;
      v = w;
    }
    return in_dtype(v, bf16);
  }

 private:
  const CheckpointReader& from_;
  std::string cached_name_;
  Tensor cached_;
};

// Writes the tensors of `files` and its config.json into `dir`, each tensor read from the
// checkpoint as it is written: model.safetensors, or when the tensors' bytes exceed
// `max_shard_bytes`, save_pretrained's split files — model-0000K-of-0000N.safetensors, each
// filled in order up to the limit (a tensor larger than it alone), and
// model.safetensors.index.json (metadata.total_size, weight_map: tensor -> file).
void write_hf_files(const fs::path& dir, const HfFiles& files, const CheckpointReader& from,
                    bool bf16, int64_t max_shard_bytes) {
  HfValues values(from);
  const DType dtype = bf16 ? DType::kBF16 : DType::kF32;
  std::vector<std::vector<SafetensorsSpec>> shards(1);
  std::vector<std::vector<const HfTensor*>> shard_tensors(1);
  int64_t total = 0, in_shard = 0;
  for (const HfTensor& t : files.tensors) {
    const Shape shape = values.shape(t);
    int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
    for (int64_t d : shape) bytes *= d;
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_tensors.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({t.name, dtype, shape});
    shard_tensors.back().push_back(&t);
    in_shard += bytes;
    total += bytes;
  }
  const size_t n = shards.size();
  const auto file_name = [&](size_t k) {
    if (n == 1) return std::string("model.safetensors");
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(name);
  };
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < n; ++k) {
    SafetensorsWriter writer((dir / file_name(k)).string(), shards[k], {{"format", "pt"}});
    for (size_t i : writer.data_order()) writer.write(values(*shard_tensors[k][i], bf16));
    writer.finish();
    for (const HfTensor* t : shard_tensors[k]) weight_map[t->name] = file_name(k);
  }
  if (n > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total}}},
                                  {"weight_map", weight_map}};
    std::ofstream f(dir / "model.safetensors.index.json");
    f << index.dump(2) << "\n";
    if (!f) fail("cannot write ", (dir / "model.safetensors.index.json").string());
  }
  write_config_json(dir, files.config);
}

// --tokenizer: the tokenizer's files beside the model, so that transformers' AutoTokenizer loads
// the directory too — tokenizer.json (a file given, or a directory's) and, from a directory, its
// tokenizer_config.json, special_tokens_map.json and tokenizer.model; without a
// tokenizer_config.json one naming PreTrainedTokenizerFast, the context and the end-of-text token.
// config.json gets that token's id (eos_token_id: generate stops at it).
void write_tokenizer(const fs::path& dir, const BpeTokenizer& tok, const std::string& given,
                     const Gpt2Config& c, nlohmann::json& config) {
  const auto copy = [&](const fs::path& from, const std::string& name) {
    std::error_code ec;
    fs::copy_file(from, dir / name, fs::copy_options::overwrite_existing, ec);
    if (ec)
      fail("export: cannot copy ", from.string(), " to ", (dir / name).string(), ": ",
           ec.message());
  };
  copy(tok.path(), "tokenizer.json");
  if (fs::is_directory(given))
    for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"})
      if (fs::exists(fs::path(given) / name)) copy(fs::path(given) / name, name);
  const std::optional<int32_t> eot = tok.end_of_text();
  if (!fs::exists(dir / "tokenizer_config.json")) {
    nlohmann::json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                         {"model_max_length", c.max_seq_len}};
    if (eot) tc["eos_token"] = tok.decode({*eot});
    std::ofstream f(dir / "tokenizer_config.json");
    f << tc.dump(2) << "\n";
    if (!f) fail("cannot write ", (dir / "tokenizer_config.json").string());
  }
  if (eot) config["eos_token_id"] = *eot;
}

// llm.c's checkpoint, one parameter read and written at a time.
void write_llmc(const CheckpointReader& from, const fs::path& file, bool bf16) {
  const Gpt2Config& c = from.model();
  int32_t header[256] = {};
  header[0] = 20240326;
  header[1] = bf16 ? 5 : 3;
  header[2] = static_cast<int32_t>(c.max_seq_len);
  header[3] = static_cast<int32_t>(c.vocab_size);
  header[4] = static_cast<int32_t>(c.n_layers);
  header[5] = static_cast<int32_t>(c.n_heads);
  header[6] = static_cast<int32_t>(c.d_model);
  header[7] = static_cast<int32_t>(c.vocab_size);  // padded vocab: Loom's rows, padded or not
  std::FILE* f = std::fopen(file.string().c_str(), "wb");
  if (f == nullptr) fail("cannot write ", file.string());
  const auto put = [&](const void* data, size_t bytes) {
    if (std::fwrite(data, 1, bytes, f) != bytes) {
      std::fclose(f);
      fail("cannot write ", file.string());
    }
  };
  put(header, sizeof header);
  const auto write_param = [&](const std::string& name) {
    const Tensor host = in_dtype(from.read(name), bf16);
    put(host.raw(), static_cast<size_t>(host.numel()) * dtype_size(host.dtype()));
  };
  write_param("wte.weight");
  write_param("wpe.weight");
  // Then each kind of layer parameter, every layer's in turn (llm.c's ParameterTensors order).
  for (const char* kind : {"ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias",
                           "attn.proj.weight", "attn.proj.bias", "ln_2.weight", "ln_2.bias",
                           "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"})
    for (int64_t l = 0; l < c.n_layers; ++l)
      write_param("blocks." + std::to_string(l) + "." + kind);
  write_param("ln_f.weight");
  write_param("ln_f.bias");
  if (std::fflush(f) != 0 || std::fclose(f) != 0) fail("cannot write ", file.string());
}

}  // namespace

HfName hf_name_of(const std::string& loom_name) {
  if (loom_name == "lm_head.weight") return {loom_name, false};  // an untied head
  if (loom_name == "wte.weight" || loom_name == "wpe.weight" || loom_name.starts_with("ln_f."))
    return {"transformer." + loom_name, false};
  const std::string prefix = "blocks.";
  if (loom_name.starts_with(prefix)) {
    const size_t dot = loom_name.find('.', prefix.size());
    if (dot != std::string::npos) {
      const std::string layer = loom_name.substr(prefix.size(), dot - prefix.size());
      const std::string rest = loom_name.substr(dot + 1);
      for (const auto& [ours, theirs] : kHfParts)
        if (rest.starts_with(ours)) {
          const std::string leaf = rest.substr(std::strlen(ours));
          // Linear weights become Conv1D weights (in × out); LayerNorm weights stay as they are.
          const bool transposed = leaf == "weight" && !rest.starts_with("ln_");
          return {"transformer.h." + layer + "." + theirs + leaf, transposed};
        }
    }
  }
  fail("parameter '", loom_name, "' has no HuggingFace GPT-2 name");
}

namespace {

// A HuggingFace directory's config.json: a JSON object (its keys' types are checked where read).
nlohmann::json read_hf_config(const fs::path& dir, const char* kind) {
  const fs::path config_path = dir / "config.json";
  std::ifstream config_file(config_path);
  if (!config_file) fail(config_path.string(), ": cannot read (a HuggingFace ", kind, " directory?)");
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(config_file);
  } catch (const nlohmann::json::exception& e) {
    fail(config_path.string(), ": not JSON: ", e.what());
  }
  if (!config.is_object())
    fail(config_path.string(), ": not a JSON object of the model's settings, but ",
         config.type_name(), " ", config.dump().substr(0, 40));
  return config;
}

// The tensors of a HuggingFace directory: model.safetensors, or the files that
// model.safetensors.index.json's weight_map names (checkpoints of several GB are split so). Every
// file's header is read and checked at once; a tensor's data when it is asked for, so that a
// model of tens of GB is never in memory whole (a Gemma 3 27B's 54 GB of bf16).
class HfTensors {
 public:
  explicit HfTensors(const fs::path& dir);
  bool contains(const std::string& name) const { return where_.contains(name); }
  // Its shape, and a host f32 copy; both fail naming the directory when there is no such tensor.
  const Shape& shape(const std::string& name) const { return file_of(name).find(name)->shape; }
  Tensor read_f32(const std::string& name) const {
    const Tensor t = file_of(name).read(name);
    return t.dtype() == DType::kF32 ? t : t.to(DType::kF32);
  }

 private:
  const SafetensorsIndex& file_of(const std::string& name) const {
    const auto it = where_.find(name);
    if (it == where_.end()) fail(dir_.string(), ": no tensor ", name);
    return files_[it->second];
  }
  fs::path dir_;
  std::vector<SafetensorsIndex> files_;
  std::map<std::string, size_t> where_;  // a tensor's file (the last to hold it)
};

HfTensors::HfTensors(const fs::path& dir) : dir_(dir) {
  const auto add = [&](const fs::path& path) {
    files_.emplace_back(path.string());
    for (const std::string& name : files_.back().names()) where_[name] = files_.size() - 1;
  };
  if (fs::exists(dir / "model.safetensors")) {
    add(dir / "model.safetensors");
    return;
  }
  const fs::path index_path = dir / "model.safetensors.index.json";
  std::ifstream index_file(index_path);
  if (!index_file)
    fail(dir.string(), ": neither model.safetensors nor model.safetensors.index.json");
  std::set<std::string> files;
  try {
    // The parsed index kept in a variable: a range-for over items() of the temporary parse()
    // returns reads a destroyed object (no files at all, or worse).
    const nlohmann::json index = nlohmann::json::parse(index_file);
    for (const auto& [name, file] : index.at("weight_map").items())
      files.insert(file.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    fail(index_path.string(), ": no weight_map of tensor names to files: ", e.what());
  }
  for (const std::string& file : files) {
    if (file.find('/') != std::string::npos || file.starts_with("."))
      fail(index_path.string(), ": '", file, "' is not a file name in ", dir.string());
    add(dir / file);
  }
}

// Checks a LlamaForCausalLM's config.json against the model; returns its vocab_size. A key of
// another type than LlamaConfig's (nlohmann's value() throws) is refused by the caller.
int64_t check_llama_config(const std::string& config_path, const nlohmann::json& config,
                           const Gpt2Config& model) {
  // A dense Llama starts from a LlamaForCausalLM (or a MistralForCausalLM: the same tensors, its
  // attention not windowed), one with qkv biases from a Qwen2ForCausalLM, one with query/key
  // norms from a Qwen3ForCausalLM, a mixture of experts from a MixtralForCausalLM (its experts and
  // top k Loom's, its attention not windowed), one with query/key norms from a
  // Qwen3MoeForCausalLM.
  const std::string model_type = config.value("model_type", std::string("(none)"));
  // Gemma 3 (Gemma3ForCausalLM, or a Gemma3ForConditionalGeneration's text model):
  // checkpoint/hf_gemma3.h.
  if (model_type == "gemma3_text" || model_type == "gemma3" || has_gemma_parts(model))
    return check_gemma3_config(config_path, config, model);
  // OLMoE (OlmoeForCausalLM): a mixture with full-width query/key norms and pre-norms.
  const bool olmoe_model = model.moe() && model.qk_norm_full && !model.post_norm;
  if (model_type == "olmoe" || olmoe_model) {
    if (model_type != "olmoe")
      fail(config_path, ": model_type = ", model_type, ", but a mixture of experts with ",
           "model.qk_norm_scope = \"full\" starts from an OlmoeForCausalLM directory");
    if (!olmoe_form(model))
      fail(config_path, ": model_type = olmoe: an OlmoeForCausalLM needs model.moe_experts, ",
           "model.qk_norm = true and model.qk_norm_scope = \"full\" with model.norm_placement = ",
           "\"pre\", without model.qkv_bias, model.head_dim or model.sliding_window");
    if (!config.value("clip_qkv", nlohmann::json()).is_null())
      fail(config_path, ": clip_qkv = ", config["clip_qkv"].dump(),
           ": Loom does not clamp the queries and keys");
  }
  // OLMo 2 (Olmo2ForCausalLM): post-norms and full-width query/key norms, nothing else of
  // Loom's variants.
  const bool olmo2_model = !olmoe_model && (model.post_norm || model.qk_norm_full);
  if (model_type == "olmo2" || olmo2_model) {
    if (model_type != "olmo2")
      fail(config_path, ": model_type = ", model_type, ", but model.norm_placement = \"",
           model.post_norm ? "post" : "pre", "\" with model.qk_norm_scope = \"",
           model.qk_norm_full ? "full" : "head", "\" starts from an Olmo2ForCausalLM directory");
    if (!olmo2_form(model))
      fail(config_path, ": model_type = olmo2: an Olmo2ForCausalLM needs model.norm_placement = ",
           "\"post\", model.qk_norm = true and model.qk_norm_scope = \"full\", without ",
           "model.qkv_bias, model.moe_experts, model.head_dim or model.sliding_window");
  }
  const char* qwen3_type = model.moe() ? "qwen3_moe" : "qwen3";
  const char* qwen3_class = model.moe() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM";
  if (model.qk_norm && !olmo2_model && !olmoe_model && (model.qkv_bias || model_type != qwen3_type))
    fail(config_path, ": model_type = ", model_type, ", but model.qk_norm = true",
         model.qkv_bias ? " with model.qkv_bias: no HuggingFace class Loom reads holds that model"
                        : detail::concat(" starts from a ", qwen3_class,
                                         " directory (a model without q_norm / k_norm)"));
  if (!model.qk_norm && (model_type == "qwen3" || model_type == "qwen3_moe"))
    fail(config_path, ": model_type = ", model_type, ": a ",
         model_type == "qwen3" ? "Qwen3ForCausalLM" : "Qwen3MoeForCausalLM",
         "'s per-head q_norm and k_norm need model.qk_norm = true");
  if (!model.moe() && model.qkv_bias && model_type != "qwen2")
    fail(config_path, ": model_type = ", model_type,
         ", but model.qkv_bias = true starts from a Qwen2ForCausalLM directory (a ", model_type,
         " has no biases on its queries, keys and values)");
  if (!model.moe() && !model.qkv_bias && !model.qk_norm && model_type != "llama" &&
      model_type != "mistral" && model_type != "phi3")
    fail(config_path, ": model_type = ", model_type,
         ", but model.arch = \"llama\" starts from a LlamaForCausalLM directory",
         model_type == "mixtral" ? " (a MixtralForCausalLM needs model.moe_experts)"
         : model_type == "qwen2" ? " (a Qwen2ForCausalLM's qkv biases need model.qkv_bias = true)"
                                 : "");
  if (model.moe() && model.qkv_bias)
    fail(config_path, ": model.qkv_bias = true with model.moe_experts: a MixtralForCausalLM has ",
         "no biases on its queries, keys and values");
  if (model.moe() && !model.qk_norm && model_type != "mixtral")
    fail(config_path, ": model_type = ", model_type,
         ", but model.moe_experts = ", model.moe_experts,
         " starts from a MixtralForCausalLM directory");
  const auto integer = [&](const char* name) -> int64_t {
    try {
      return json_integer<int64_t>(config.at(name));
    } catch (const nlohmann::json::exception&) {
      fail(config_path, ": no integer \"", name, "\" (of int64's range)");
    }
  };
  const auto expect_equal = [&](const char* name, int64_t theirs, int64_t ours, const char* key) {
    if (theirs != ours) fail(config_path, ": ", name, " = ", theirs, " but ", key, " = ", ours);
  };
  expect_equal("hidden_size", integer("hidden_size"), model.d_model, "model.d_model");
  expect_equal("num_hidden_layers", integer("num_hidden_layers"), model.n_layers, "model.n_layers");
  expect_equal("num_attention_heads", integer("num_attention_heads"), model.n_heads, "model.n_heads");
  expect_equal("num_key_value_heads",
               config.contains("num_key_value_heads") ? integer("num_key_value_heads")
                                                      : integer("num_attention_heads"),
               model.n_kv_heads, "model.n_kv_heads");
  // Phi-3 and Phi-4 (Phi3ForCausalLM): a Llama whose qkv and gate/up weights are stored fused
  // as Loom's are; the rotation over every dimension (Phi-4-mini's partial one is not built).
  if (model_type == "phi3") {
    const nlohmann::json partial = config.value("partial_rotary_factor", nlohmann::json(1.0));
    if (!partial.is_number() || partial.get<double>() != 1.0)
      fail(config_path, ": partial_rotary_factor = ", partial.dump(),
           ": Loom's rotary embedding turns every dimension of a head (1.0)");
  }
  // A Qwen 3 mixture's experts are moe_intermediate_size wide (its intermediate_size is for
  // dense blocks, which Loom's mixture has none of: every block sparse).
  const bool qwen3_moe = model_type == "qwen3_moe", olmoe = model_type == "olmoe";
  const char* const width_key = qwen3_moe ? "moe_intermediate_size" : "intermediate_size";
  expect_equal(width_key, integer(width_key), model.ffn_hidden, "model.ffn_hidden");
  if (model.moe()) {
    if (model.moe_shared_experts > 0)
      fail(config_path, ": a ", hf_moe_names(model).model,
           " has no shared experts, and model.moe_shared_experts = ", model.moe_shared_experts);
    const char* const experts_key = qwen3_moe || olmoe ? "num_experts" : "num_local_experts";
    expect_equal(experts_key, integer(experts_key), model.moe_experts, "model.moe_experts");
    expect_equal("num_experts_per_tok", integer("num_experts_per_tok"), model.moe_top_k,
                 "model.moe_top_k");
    if (qwen3_moe) {
      if (config.value("decoder_sparse_step", 1) != 1 ||
          !config.value("mlp_only_layers", nlohmann::json::array()).empty())
        fail(config_path, ": decoder_sparse_step = ", config["decoder_sparse_step"].dump(),
             ", mlp_only_layers = ", config.value("mlp_only_layers", nlohmann::json()).dump(),
             ": Loom's mixture has experts in every block (step 1, no dense layers)");
    }
    if (qwen3_moe || olmoe) {
      // Qwen3MoeConfig's and OlmoeConfig's default: false
      const bool normalised = config.value("norm_topk_prob", false);
      if (normalised != model.moe_router_norm_topk_prob)
        fail(config_path, ": norm_topk_prob = ", normalised ? "true" : "false",
             " but model.moe_router_norm_topk_prob = ",
             model.moe_router_norm_topk_prob ? "true" : "false");
    }
  }
  // The sliding window (nn/sliding_window.h): Mistral's and Mixtral's sliding_window; Qwen's only
  // with use_sliding_window, in the blocks from max_window_layers on (Loom windows every block:
  // 0 there, or none past the last block). It must be the model's — a window spanning the
  // sequences being none.
  const nlohmann::json window = config.value("sliding_window", nlohmann::json());
  const bool qwen = model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen3_moe";
  int64_t their_window = 0;
  if (!window.is_null() && config.value("use_sliding_window", !qwen)) {
    their_window = json_integer<int64_t>(window);
    const int64_t from =
        qwen ? json_integer<int64_t>(config.value("max_window_layers", nlohmann::json(28))) : 0;
    if (from >= model.n_layers)
      their_window = 0;  // no block windowed
    else if (from > 0)
      fail(config_path, ": max_window_layers = ", from, ": a window in blocks ", from,
           " on only, where Loom's sliding window (model.sliding_window) is every block's");
  }
  if (model.full_attention_every > 0)
    fail(config_path, ": model.full_attention_every = ", model.full_attention_every,
         " windows some blocks only, which no Llama, Mistral, Mixtral or Qwen directory does");
  const auto spans = [&](int64_t w) { return w <= 0 || w >= model.max_seq_len; };
  if (model.sliding_window == 0 && !spans(their_window))
    fail(config_path, ": sliding_window = ", their_window,
         " is below model.max_seq_len = ", model.max_seq_len,
         ": set model.sliding_window = ", their_window,
         " (Loom's attention would see the whole sequence)");
  if (model.sliding_window > 0 && their_window != model.sliding_window &&
      !(spans(their_window) && spans(model.sliding_window)))
    fail(config_path, ": sliding_window = ", their_window > 0 ? window.dump() : "none",
         " but model.sliding_window = ", model.sliding_window);
  if (model.moe()) {
    if (!config.value("rope_scaling", nlohmann::json()).is_null() || model.rope_scaling_factor > 0)
      fail(config_path, ": rope_scaling: transformers' MixtralForCausalLM applies none, so a ",
           "mixture of experts starts without it (model.rope_scaling = \"none\")");
  }
  // head_dim: the file's, else its class's default (Qwen3Config's 128; the others' hidden_size /
  // num_attention_heads); a null one (older files) that default too.
  const bool has_head_dim = config.contains("head_dim") && !config["head_dim"].is_null();
  const int64_t their_head_dim = has_head_dim ? integer("head_dim")
                                 : model_type == "qwen3" || qwen3_moe
                                     ? 128
                                     : model.d_model / model.n_heads;
  expect_equal("head_dim", their_head_dim, model.head_dim(),
               model.head_width > 0 ? "model.head_dim" : "model.d_model / model.n_heads");
  const double theta = config.value("rope_theta", 10000.0), eps = config.value("rms_norm_eps", 1e-6);
  if (theta != model.rope_theta)
    fail(config_path, ": rope_theta = ", theta, " but model.rope_theta = ", model.rope_theta);
  if (eps != model.norm_eps)
    fail(config_path, ": rms_norm_eps = ", eps, " but model.norm_eps = ", model.norm_eps);
  check_hf_rope_scaling(config_path, config.value("rope_scaling", nlohmann::json()), model);
  if (config.value("hidden_act", std::string("silu")) != "silu")
    fail(config_path, ": hidden_act = ", config["hidden_act"].dump(), ", Loom's SwiGLU is silu's");
  if (config.value("attention_bias", false) || config.value("mlp_bias", false))
    fail(config_path, ": attention_bias / mlp_bias: Loom's Llama has no biases");
  const bool tied = config.value("tie_word_embeddings", false);  // LlamaConfig's default
  if (tied != model.tie_embeddings)
    fail(config_path, ": tie_word_embeddings = ", tied ? "true" : "false",
         " but model.tie_embeddings = ", model.tie_embeddings ? "true" : "false");
  const int64_t vocab = integer("vocab_size");
  if (vocab > model.vocab_size)
    fail(config_path, ": vocab_size = ", vocab, " exceeds model.vocab_size = ", model.vocab_size);
  return vocab;
}

// A Llama's HuggingFace tensors (LlamaForCausalLM's names) in Loom's parameters: the fused qkv
// and gate/up weights from their row blocks; everything else one to one.
void load_hf_llama_weights(const std::string& hf_dir, const ParameterStore& layout,
                           const Gpt2Config& model, const HfParameterSink& take) {
  const fs::path dir(hf_dir);
  const std::string config_path = (dir / "config.json").string();
  const nlohmann::json config = read_hf_config(dir, "Llama");
  int64_t vocab = 0;
  try {
    vocab = check_llama_config(config_path, config, model);
  } catch (const nlohmann::json::exception& e) {
    fail(config_path, ": a key of another type than LlamaConfig's: ", e.what());
  }

  const HfTensors tensors(dir);
  const auto tensor = [&](const std::string& name, const Shape& shape) {
    if (tensors.shape(name) != shape)
      fail(hf_dir, ": ", name, " has shape ", shape_str(tensors.shape(name)), ", expected ",
           shape_str(shape));
    return tensors.read_f32(name);
  };
  const int64_t C = model.d_model, Q = model.attention_width(),
                kv = model.kv_heads() * model.head_dim(), H = model.ffn_hidden;
  const HfMoeNames moe = hf_moe_names(model);
  const std::string model_type = config.value("model_type", std::string());
  const bool gemma3 = model_type == "gemma3_text" || model_type == "gemma3";
  // Phi3ForCausalLM keeps qkv and gate/up fused, in Loom's row order.
  const bool phi3 = model_type == "phi3";
  // One parameter's value at a time, the buffer kept for the next (fresh pages cost more than
  // the copy on some machines: allocated once at the largest parameter's size).
  std::vector<float> value;
  const Gemma3Names gemma3_text =
      gemma3 ? gemma3_names([&](const std::string& name) { return tensors.contains(name); })
             : Gemma3Names{};
  for (const auto& p : layout.parameters()) {
    // Where the parameter's rows come from, in order.
    std::vector<std::pair<std::string, Shape>> sources;
    const std::string& n = p->name;
    // Gemma 3's own names (its gains Loom's less one); its projections are Llama's, under its text
    // model's prefix.
    const HfSources gemma = gemma3 ? gemma3_sources(n, model, vocab, gemma3_text) : HfSources{};
    const std::string& text = gemma3_text.text;
    if (!gemma.sources.empty())
      sources = gemma.sources;
    else if (n == "wte.weight")
      sources = {{"model.embed_tokens.weight", {vocab, C}}};
    else if (n == "lm_head.weight") sources = {{"lm_head.weight", {vocab, C}}};
    else if (n == "ln_f.weight") sources = {{"model.norm.weight", {C}}};
    else if (n.starts_with("blocks.")) {
      const size_t dot = n.find('.', 7);
      const std::string hf = text + "layers." + n.substr(7, dot - 7) + ".",
                        rest = n.substr(dot + 1);
      // OLMo 2's post-norms: after the attention (ln_1) and the MLP (ln_2).
      if (rest == "ln_1.weight")
        sources = {
            {hf + (model.post_norm ? "post_attention_layernorm.weight" : "input_layernorm.weight"),
             {C}}};
      else if (rest == "ln_2.weight")
        sources = {{hf + (model.post_norm ? "post_feedforward_layernorm.weight"
                                          : "post_attention_layernorm.weight"),
                    {C}}};
      else if (rest == "attn.qkv.weight" && phi3)
        sources = {{hf + "self_attn.qkv_proj.weight", {Q + 2 * kv, C}}};
      else if (rest == "attn.qkv.weight")
        sources = {{hf + "self_attn.q_proj.weight", {Q, C}},
                   {hf + "self_attn.k_proj.weight", {kv, C}},
                   {hf + "self_attn.v_proj.weight", {kv, C}}};
      else if (rest == "attn.qkv.bias")  // Qwen 2's
        sources = {{hf + "self_attn.q_proj.bias", {Q}},
                   {hf + "self_attn.k_proj.bias", {kv}},
                   {hf + "self_attn.v_proj.bias", {kv}}};
      else if (rest == "attn.q_norm.weight" || rest == "attn.k_norm.weight")  // Qwen 3's
        sources = {{hf + "self_attn." + rest.substr(5),
                    {!model.qk_norm_full ? model.head_dim()
                     : rest[5] == 'q'    ? Q
                                         : kv}}};
      else if (rest == "attn.proj.weight")
        sources = {{hf + "self_attn.o_proj.weight", {C, Q}}};
      else if (rest == "mlp.fc.weight" && phi3)
        sources = {{hf + "mlp.gate_up_proj.weight", {2 * H, C}}};
      else if (rest == "mlp.fc.weight")
        sources = {{hf + "mlp.gate_proj.weight", {H, C}}, {hf + "mlp.up_proj.weight", {H, C}}};
      else if (rest == "mlp.proj.weight") sources = {{hf + "mlp.down_proj.weight", {C, H}}};
      else if (rest == "mlp.router.weight")
        sources = {{hf + moe.block + "gate.weight", {model.moe_experts, C}}};
      else if (rest.starts_with("mlp.experts.")) {  // mlp.experts.<e>.fc / .proj
        const size_t end = rest.find('.', 12);
        const std::string expert = hf + moe.block + "experts." + rest.substr(12, end - 12) + ".";
        if (rest.substr(end + 1) == "fc.weight")
          sources = {{expert + moe.gate, {H, C}}, {expert + moe.up, {H, C}}};
        else if (rest.substr(end + 1) == "proj.weight")
          sources = {{expert + moe.down, {C, H}}};
      }
    }
    if (sources.empty())
      fail("parameter '", n,
           "' has no HuggingFace Llama, Mistral, Phi-3, Qwen 2, Qwen 3, OLMo 2, Gemma 3, Mixtral, "
           "Qwen 3 MoE or OLMoE name");
    value.resize(static_cast<size_t>(p->numel()));  // every element written below
    float* dst = value.data();
    int64_t written = 0;
    for (const auto& [name, shape] : sources) {
      const Tensor t = tensor(name, shape);
      std::copy(t.data<float>(), t.data<float>() + t.numel(), dst + written);
      written += t.numel();
    }
    std::fill(dst + written, dst + p->numel(), 0.0f);  // vocabulary padding rows
    if (gemma.gain)
      for (int64_t i = 0; i < p->numel(); ++i) dst[i] += 1.0f;
    take(*p, dst);
  }
}

}  // namespace

void load_hf_weights(const std::string& hf_dir, const ParameterStore& layout,
                     const Gpt2Config& model, FlatModelState& into) {
  for_each_hf_parameter(hf_dir, layout, model, [&](const Parameter& p, const float* values) {
    std::copy(values, values + p.numel(), into.values.data<float>() + p.offset);
  });
}

void for_each_hf_parameter(const std::string& hf_dir, const ParameterStore& layout,
                           const Gpt2Config& model, const HfParameterSink& take) {
  if (model.llama()) return load_hf_llama_weights(hf_dir, layout, model, take);
  if (model.embedding_multiplier != 1)
    fail("train.init_from = ", hf_dir, ": a GPT2LMHeadModel does not scale its embedding, and ",
         "model.embedding_multiplier = ", model.embedding_multiplier);
  if (!model.tie_embeddings)
    fail("train.init_from = ", hf_dir, ": GPT-2's head is tied to its token embedding, and ",
         "model.tie_embeddings = false");
  const fs::path dir(hf_dir);
  const fs::path config_path = dir / "config.json";
  const nlohmann::json config = read_hf_config(dir, "GPT-2");
  const auto key = [&](const char* name) -> int64_t {
    try {
      return json_integer<int64_t>(config.at(name));
    } catch (const nlohmann::json::exception&) {
      fail(config_path.string(), ": no integer \"", name, "\" (of int64's range)");
    }
  };
  const auto expect_equal = [&](const char* name, int64_t ours, const char* our_key) {
    if (key(name) != ours)
      fail(config_path.string(), ": ", name, " = ", key(name), " but ", our_key, " = ", ours);
  };
  expect_equal("n_embd", model.d_model, "model.d_model");
  expect_equal("n_layer", model.n_layers, "model.n_layers");
  expect_equal("n_head", model.n_heads, "model.n_heads");
  const int64_t vocab = key("vocab_size"), positions = key("n_positions");
  if (vocab > model.vocab_size)
    fail(config_path.string(), ": vocab_size = ", vocab,
         " exceeds model.vocab_size = ", model.vocab_size);
  if (positions < model.max_seq_len)
    fail(config_path.string(), ": n_positions = ", positions,
         " is below model.max_seq_len = ", model.max_seq_len);
  const SafetensorsFile file = load_safetensors((dir / "model.safetensors").string());
  std::vector<float> value;  // one parameter's, reused
  for (const auto& p : layout.parameters()) {
    const HfName hf = hf_name_of(p->name);
    auto it = file.tensors.find(hf.name);
    const std::string bare = hf.name.substr(std::strlen("transformer."));
    if (it == file.tensors.end()) it = file.tensors.find(bare);  // the Hub's own files
    if (it == file.tensors.end())
      fail(hf_dir, ": model.safetensors has no ", hf.name, " (nor ", bare, ") for ", p->name);
    Tensor t = it->second.dtype() == DType::kF32 ? it->second : it->second.to(DType::kF32);
    if (hf.transposed) t = transposed(t);
    // wte and wpe may have other row counts (vocabulary padding, a longer context).
    const bool rows_may_differ = p->name == "wte.weight" || p->name == "wpe.weight";
    const int64_t rows = p->shape[0], cols = p->shape.size() > 1 ? p->shape[1] : 1;
    const int64_t taken = p->name == "wte.weight" ? vocab : rows;
    const bool fits =
        t.shape().size() == p->shape.size() &&
        (rows_may_differ ? t.dim(0) >= taken && (p->shape.size() == 1 || t.dim(1) == cols)
                         : t.shape() == p->shape);
    if (!fits)
      fail(hf_dir, ": ", it->first, " has shape ", shape_str(it->second.shape()), ", ", p->name,
           " needs ", shape_str(p->shape),
           hf.transposed ? " (transposed: Conv1D is in × out)" : "");
    value.resize(static_cast<size_t>(rows * cols));
    std::copy(t.data<float>(), t.data<float>() + taken * cols, value.data());
    std::fill(value.begin() + taken * cols, value.end(), 0.0f);
    take(*p, value.data());
  }
}

void export_checkpoint(const std::string& checkpoint_dir, const std::string& format,
                       const std::string& out, bool bf16, int64_t max_shard_bytes,
                       const std::string& tokenizer) {
  if (format != "hf" && format != "llmc") fail("export format '", format, "': expected hf or llmc");
  if (out.empty()) fail("export: no output path");
  if (!tokenizer.empty() && format != "hf")
    fail("export: a tokenizer (--tokenizer) goes into an hf directory; llm.c's file holds none");
  if (max_shard_bytes < 1) fail("export: the largest file (max shard size) must be positive");
  const Gpt2Config mc = read_checkpoint_model(checkpoint_dir);
  // A mixture of experts is written as a MixtralForCausalLM, or with qk_norm a
  // Qwen3MoeForCausalLM: what neither computes is refused.
  const std::string moe_class = std::string("transformers' ") + hf_moe_names(mc).model;
  if (mc.moe() && mc.rope_scaling_factor > 0)
    fail("export: ", checkpoint_dir, " holds a mixture of experts with Llama 3.1's rope ",
         "scaling, which ", moe_class, " is not written with");
  if (mc.moe() && mc.moe_shared_experts > 0)
    fail("export: ", checkpoint_dir, " holds a mixture of experts with shared experts, which ",
         moe_class, " has not (model.moe_shared_experts = ", mc.moe_shared_experts, ")");
  if (mc.moe() && (mc.moe_router_groups > 1 || mc.moe_router_topk_scaling_factor != 1 ||
                   (!mc.moe_router_norm_topk_prob && !mc.qk_norm)))
    fail("export: ", checkpoint_dir, " holds a mixture of experts routed within groups ",
         "(model.moe_router_num_groups), with scaled weights ",
         "(model.moe_router_topk_scaling_factor) or with weights not normalised over the chosen ",
         "(model.moe_router_norm_topk_prob = false), which ", moe_class, " has not");
  if (mc.moe() && mc.moe_router_score != RouterScore::kSoftmax)
    fail("export: ", checkpoint_dir, " holds a mixture of experts whose router scores by ",
         "sigmoids (model.moe_router_score_function), and ", moe_class, "'s by ",
         "a softmax: its tokens would be weighed otherwise there");
  const CheckpointReader from(checkpoint_dir);  // the files' digests checked here
  const TrainingState& state = from.state();
  if (std::any_of(state.expert_bias.begin(), state.expert_bias.end(),
                  [](float b) { return b != 0.0f; }))
    fail("export: ", checkpoint_dir, " holds a mixture of experts that routes by balancing ",
         "biases (model.moe_bias_update_rate), which ", moe_class,
         " has not: ", "its tokens would go to other experts there");
  if (format == "llmc" && !mc.tie_embeddings)
    fail("export: ", checkpoint_dir, " holds a model with its own LM head ",
         "(model.tie_embeddings = false); llm.c's GPT-2 ties it: export it with --format hf");
  if (format == "hf" && mc.moe() && mc.qkv_bias)
    fail("export: ", checkpoint_dir, " holds a mixture of experts with biases on its queries, ",
         "keys and values (model.qkv_bias), which transformers' MixtralForCausalLM has not");
  if (format == "llmc" && mc.llama())
    fail("export: ", checkpoint_dir, " holds a Llama model (model.arch = \"llama\"); llm.c's ",
         "format is GPT-2's: export it with --format hf");
  if (!mc.llama() && mc.embedding_multiplier != 1)
    fail("export: ", checkpoint_dir, " holds a GPT-2 whose embedding is scaled ",
         "(model.embedding_multiplier = ", mc.embedding_multiplier, "), which neither ",
         "transformers' GPT2LMHeadModel nor llm.c's format does");
  if (format == "hf") {
    HfFiles files = has_gemma_parts(mc) ? gemma3_files(mc, bf16)
                    : mc.llama()        ? llama_files(mc, bf16)
                                        : gpt2_files(mc, from.names(), bf16);
    std::optional<BpeTokenizer> tok;
    if (!tokenizer.empty()) {  // checked before anything is written
      tok.emplace(tokenizer);
      if (tok->vocab_size() > mc.vocab_size)
        fail("export: the tokenizer ", tok->path(), " has ids up to ", tok->vocab_size() - 1,
             ", past the model's vocabulary of ", mc.vocab_size, " (model.vocab_size)");
    }
    replace_atomically(out, true, [&](const fs::path& dir) {
      if (tok) write_tokenizer(dir, *tok, tokenizer, mc, files.config);
      write_hf_files(dir, files, from, bf16, max_shard_bytes);
    });
  } else {
    replace_atomically(out, false, [&](const fs::path& file) { write_llmc(from, file, bf16); });
  }
}

}  // namespace loom
