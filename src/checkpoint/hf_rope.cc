#include "checkpoint/hf_rope.h"

#include "base/error.h"
#include "base/json_number.h"

namespace loom {

nlohmann::json hf_rope_scaling(const Gpt2Config& c) {
  if (c.rope_scaling_factor <= 0) return nullptr;
  if (c.rope_scaling_linear) return {{"rope_type", "linear"}, {"factor", c.rope_scaling_factor}};
  return {{"rope_type", "llama3"},
          {"factor", c.rope_scaling_factor},
          {"low_freq_factor", c.rope_low_freq_factor},
          {"high_freq_factor", c.rope_high_freq_factor},
          {"original_max_position_embeddings", c.rope_original_max_seq_len}};
}

void check_hf_rope_scaling(const std::string& config_path, const nlohmann::json& scaling,
                           const Gpt2Config& model) {
  const char* const ours = model.rope_scaling_factor <= 0 ? "none"
                           : model.rope_scaling_linear    ? "linear"
                                                          : "llama3";
  if (scaling.is_null()) {
    if (model.rope_scaling_factor > 0)
      fail(config_path, ": rope_scaling is null but model.rope_scaling = \"", ours, "\"");
    return;
  }
  // Older files say "type".
  const std::string type = scaling.value("rope_type", scaling.value("type", std::string()));
  if (type != "llama3" && type != "linear")
    fail(config_path, ": rope_scaling = ", scaling.dump(), ": Loom builds Llama 3.1's \"llama3\" ",
         "frequency scaling and \"linear\" (model.rope_scaling), not \"", type, "\"");
  // Field by field: the Hub's files carry other keys beside them ("type", ...).
  bool same = type == ours && scaling.value("factor", 0.0) == model.rope_scaling_factor;
  if (same && type == "llama3")
    same =
        scaling.value("low_freq_factor", 0.0) == model.rope_low_freq_factor &&
        scaling.value("high_freq_factor", 0.0) == model.rope_high_freq_factor &&
        json_integer<int64_t>(scaling.value("original_max_position_embeddings",
                                            nlohmann::json(0))) == model.rope_original_max_seq_len;
  if (!same)
    fail(config_path, ": rope_scaling = ", scaling.dump(), " but the model's is ",
         hf_rope_scaling(model).dump(), " (model.rope_scaling = \"", ours,
         "\", rope_scaling_factor",
         type == "llama3" || std::string(ours) == "llama3"
             ? ", rope_low_freq_factor, rope_high_freq_factor, "
               "rope_original_max_seq_len)"
             : ")");
}

}  // namespace loom
