// Fuzzes train.init_from's reader of a HuggingFace model directory (config.json and
// model.safetensors) for GPT-2, Llama, Mixtral (a mixture of experts), Qwen 2 (a Llama with
// qkv biases), Qwen 3 (a Llama with query/key norms on heads wider than their share), Mistral
// (a Llama with a sliding window), OLMoE (a mixture with full-width query/key norms) and Gemma 3
// (its parts, linear rope scaling and a query_pre_attn_scalar): the directories of eight small
// models' exports are made once; each input replaces one file — byte 0: bit 0 picks config.json
// or model.safetensors, the rest (mod 8) the model — with the rest. Properties: a refusal
// is a loom::Error; the unchanged directory loads (checked once), and an accepted one sets every
// parameter's values from the file (none left from before).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "fuzz_common.h"

namespace {
namespace fs = std::filesystem;
using namespace loom;

struct HfDir {
  Gpt2Config config;
  std::unique_ptr<Gpt2> model;
  fs::path dir;
  std::string files[2];
};
const char* const kFiles[2] = {"config.json", "model.safetensors"};

enum Kind { kGpt2, kLlama, kMixtral, kQwen2, kQwen3, kMistral, kOlmoe, kGemma3, kKinds };
const char* const kKindNames[kKinds] = {"gpt2",  "llama",   "mixtral", "qwen2",
                                        "qwen3", "mistral", "olmoe",   "gemma3"};

HfDir make(Kind kind) {
  HfDir h;
  h.config.vocab_size = 8;
  h.config.max_seq_len = 4;
  h.config.d_model = 8;
  h.config.n_layers = 1;
  h.config.n_heads = 2;
  if (kind != kGpt2) {
    h.config.arch = Arch::kLlama;
    h.config.n_kv_heads = 1;
    h.config.ffn_hidden = 12;
  }
  if (kind == kMixtral || kind == kOlmoe) {
    h.config.moe_experts = 3;
    h.config.moe_top_k = 2;
  }
  if (kind == kOlmoe) {
    h.config.qk_norm_full = true;
    h.config.moe_router_norm_topk_prob = false;
  }
  if (kind == kGemma3) {
    h.config.sandwich_norm = true;
    h.config.ffn_activation = GatedActivation::kGeluTanh;
    h.config.embedding_multiplier = static_cast<float>(std::sqrt(8.0));
    h.config.sliding_window = 3;
    h.config.full_attention_every = 2;
    h.config.rope_local_theta = 100;
    h.config.rope_scaling_factor = 8;
    h.config.rope_scaling_linear = true;
    h.config.query_pre_attn_scalar = 6;
  }
  h.config.qkv_bias = kind == kQwen2;
  h.config.qk_norm = kind == kQwen3 || kind == kOlmoe || kind == kGemma3;
  h.config.head_width = kind == kQwen3 ? 6 : 0;
  if (kind == kMistral) h.config.sliding_window = 3;
  h.model = std::make_unique<Gpt2>(h.config);
  h.model->build(DType::kF32, Device::cpu(), 5);
  const fs::path base = fuzz::scratch_dir() / kKindNames[kind];
  const std::string ckpt = save_checkpoint((base / "checkpoints").string(), *h.model, nullptr, {});
  h.dir = base / "hf";
  export_checkpoint(ckpt, "hf", h.dir.string());
  for (int i = 0; i < 2; ++i) {
    h.files[i] = fuzz::read_file(h.dir / kFiles[i]);
    fuzz::seed(std::string(kKindNames[kind]) + "_" + kFiles[i],
               static_cast<char>(i | (kind << 1)) + h.files[i]);
  }
  return h;
}

FlatModelState load(HfDir& h) {
  const int64_t n = h.model->params().numel();
  FlatModelState into{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                      Tensor::zeros({n}, DType::kF32)};
  float* v = into.values.data<float>();
  std::fill(v, v + n, -1234.5f);
  load_hf_weights(h.dir.string(), h.model->params(), h.config, into);
  return into;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static HfDir dirs[kKinds] = {make(kGpt2),  make(kLlama),   make(kMixtral), make(kQwen2),
                               make(kQwen3), make(kMistral), make(kOlmoe),   make(kGemma3)};
  static const bool unchanged_loads = [] {
    for (HfDir& h : dirs) load(h);  // throws (and so fails) if the exports do not load
    return true;
  }();
  fuzz::require(unchanged_loads, "the unchanged directories load");
  if (size == 0) return 0;
  HfDir& h = dirs[(data[0] >> 1) % kKinds];
  const int which = data[0] & 1;
  const std::string_view content(reinterpret_cast<const char*>(data) + 1, size - 1);
  for (int i = 0; i < 2; ++i)
    fuzz::write_file(h.dir / kFiles[i], i == which ? content : h.files[i]);
  FlatModelState into;
  if (!fuzz::accepts([&] { into = load(h); })) return 0;
  // Padding between parameters stays as filled; every parameter's own values were written.
  for (const auto& p : h.model->params().parameters()) {
    const float* v = into.values.data<float>() + p->offset;
    for (int64_t i = 0; i < p->value.numel(); ++i)
      fuzz::require(v[i] != -1234.5f, "every parameter is set from the file");
  }
  return 0;
}
