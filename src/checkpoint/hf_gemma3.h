// Gemma 3's text model as transformers writes it (Gemma3ForCausalLM, model_type "gemma3_text"; or
// within a Gemma3ForConditionalGeneration, model_type "gemma3", as the 4B, 12B and 27B are saved):
// Loom's Llama with Gemma's parts — sandwich norms (model.norm_placement = "sandwich"), GeGLU
// (model.ffn_activation = "gelu_tanh"), per-head query/key norms, heads of their own width, the
// embedding times √hidden_size (model.embedding_multiplier), a sliding window in all but every
// sliding_window_pattern-th block (model.full_attention_every) whose rotary base is
// rope_local_base_freq (model.rope_local_theta) and the others' by rope_theta, linearly scaled in
// 4B and up (model.rope_scaling = "linear"), tied or untied head. A model is written as a
// Gemma3ForCausalLM (the text model alone, which transformers loads as it is). Gemma's RMSNorms
// scale by (1 + w) with w initialised to zero; Loom's gains are the scale itself: 1 is added on
// import and taken away on export (every gain: the blocks' four, the query/key norms', the final
// norm's). checkpoint/export.cc calls these for `loom checkpoint export` and `train.init_from`.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/hf_files.h"
#include "models/gpt2.h"

namespace loom {

// Whether `c` has any of Gemma's parts (then only a Gemma 3 directory holds it).
bool has_gemma_parts(const Gpt2Config& c);

// A Gemma3ForCausalLM's tensors (HuggingFace names, each from its Loom parameter, the gains as
// Gemma's w) and its config.json (`bf16`: its torch_dtype). Fails naming the first of the
// model's parts that no Gemma 3 has.
HfFiles gemma3_files(const Gpt2Config& c, bool bf16);

// train.init_from: config.json (`config`, read from `config_path`; a
// Gemma3ForConditionalGeneration's text_config) checked against the model, every difference named;
// returns its vocab_size.
int64_t check_gemma3_config(const std::string& config_path, const nlohmann::json& config,
                            const Gpt2Config& model);

// Where a Gemma 3 directory keeps its text model: a Gemma3ForCausalLM's model.* and lm_head, or a
// Gemma3ForConditionalGeneration's (4B and up: the text model beside a vision tower, whose
// tensors Loom leaves) language_model.model.* and language_model.lm_head as transformers 4.50 and
// 4.51 write them, model.language_model.* and lm_head as later versions do. From the tensors'
// names (`has`: whether the directory holds a tensor of that name).
struct Gemma3Names {
  std::string text = "model.";          // before embed_tokens, layers.N and norm
  std::string head = "lm_head.weight";  // an untied head
};
Gemma3Names gemma3_names(const std::function<bool(const std::string&)>& has);

// Where Loom parameter `name`'s rows come from in a Gemma 3 directory, in order, and whether it is
// a gain (Loom's = 1 + Gemma's), for the names that are Gemma's own: the embedding, the head and
// every norm. Empty sources: one of the projections, whose names are Llama's under names.text.
struct HfSources {
  std::vector<std::pair<std::string, Shape>> sources;
  bool gain = false;
};
HfSources gemma3_sources(const std::string& name, const Gpt2Config& model, int64_t vocab,
                         const Gemma3Names& names);

}  // namespace loom
