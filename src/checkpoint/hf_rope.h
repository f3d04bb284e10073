// transformers' rope_scaling of a model's config.json (LlamaConfig's key, Qwen's and Gemma 3's
// alike): none (null), Llama 3.1's "llama3" frequency scaling or "linear" (every frequency over
// the factor; Gemma 3 4B+'s). Loom's are Gpt2Config's rope_scaling_factor (0: none),
// rope_scaling_linear and Llama 3.1's frequency factors (kernels/cpu/rope.h).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "models/gpt2.h"

namespace loom {

// The model's rope_scaling as transformers writes it.
nlohmann::json hf_rope_scaling(const Gpt2Config& c);

// train.init_from: fails naming `config_path` unless `scaling` (config.json's rope_scaling, null
// where absent) is the model's, field by field (the Hub's files carry other keys beside them).
void check_hf_rope_scaling(const std::string& config_path, const nlohmann::json& scaling,
                           const Gpt2Config& model);

}  // namespace loom
