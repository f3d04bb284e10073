// `loom export`: a checkpoint's model in the formats other GPT-2 code loads, so a model trained
// with Loom can be used (and checked) elsewhere.
//
//   hf    a directory HuggingFace transformers loads with GPT2LMHeadModel.from_pretrained(DIR):
//         model.safetensors with save_pretrained's names ("transformer.h.0.attn.c_attn.weight",
//         …; the LM head is tied to transformer.wte, so not written) and config.json. GPT-2's
//         Conv1D layers store their weight as in × out, so each Linear weight (out × in here) is
//         written transposed. No tokenizer files: Loom's corpora are byte-level or pre-tokenized.
//   llmc  one file in llm.c's checkpoint format (train_gpt2.c/.cu load it): a header of 256
//         int32 — 20240326, version 3 (fp32) or 5 (bf16), max_seq_len, vocab, layers, heads,
//         channels, padded vocab — then every parameter in llm.c's order, Linear weights out × in
//         as here, the layers of each kind one after the other.
//
// Both formats are written as fp32, or bf16 (`bf16`: rounded to nearest even; halves the files).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "models/gpt2.h"
#include "optim/adamw.h"

namespace loom {

// Writes the model of a checkpoint (whole or sharded, digests checked) to `out` in `format`
// ("hf" | "llmc"), reading it one parameter at a time (CheckpointReader): the memory it takes is
// one parameter's and one written tensor's, not the model's. An hf directory's tensors go into
// model.safetensors, or — over `max_shard_bytes` (save_pretrained's max_shard_size, 5 GB by
// default) — into model-0000K-of-0000N.safetensors with model.safetensors.index.json, as
// transformers splits them. `tokenizer` (hf; "" for none): a HuggingFace tokenizer — a
// tokenizer.json, or a directory holding one (a Hub model's) — copied beside the model with its
// tokenizer_config.json and special_tokens_map.json (a minimal tokenizer_config.json without
// one), its end-of-text token config.json's eos_token_id; its ids must fit the model's
// vocabulary. Throws loom::Error naming the checkpoint, the format, the tokenizer or the output
// path on failure; an existing output is replaced only when the new one is complete (written
// beside it and renamed).
constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;
void export_checkpoint(const std::string& checkpoint_dir, const std::string& format,
                       const std::string& out, bool bf16 = false,
                       int64_t max_shard_bytes = kDefaultMaxShardBytes,
                       const std::string& tokenizer = "");

// The reverse of the hf export, for fine-tuning (train.init_from): fills into.values (host f32
// laid out as `layout`, a whole model of shape `model`) with the weights of a HuggingFace GPT-2
// directory — config.json and model.safetensors, Loom's export or a GPT-2 from the Hub
// (names with or without the "transformer." prefix; f32, bf16 or f16). config.json's n_embd,
// n_layer and n_head must equal the model's; a smaller vocabulary fills the first rows of wte
// (the rest, padding, zero), and the first model.max_seq_len rows of wpe are taken. Anything
// else that differs is an error naming the directory and the key or tensor.
// For a Llama (model.arch = "llama"): a LlamaForCausalLM directory (Loom's export, or the Hub's:
// SmolLM, TinyLlama, Llama 2 / 3.x — model.safetensors or split files with an index), its
// q/k/v_proj and gate/up_proj fused into Loom's qkv and fc rows; config.json's hidden_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, rope_theta,
// rms_norm_eps, tie_word_embeddings and rope_scaling (checkpoint/hf_rope.h) must be the model's.
// The other classes a Llama's variants start from — Mistral, Phi-3, Qwen 2 / 3, OLMo 2, Gemma 3,
// Mixtral, Qwen 3 MoE, OLMoE — are docs/models.md's table.
void load_hf_weights(const std::string& hf_dir, const ParameterStore& layout,
                     const Gpt2Config& model, FlatModelState& into);

// The same, one parameter at a time: take(p, values) for each of `layout`'s parameters with its
// whole value (p.numel() host floats, valid during the call), read from the directory's files as
// it is needed, so that no more than one parameter's value and its tensors are in memory (what
// train.init_from does for a model of tens of GB). The checks and errors are load_hf_weights's.
using HfParameterSink = std::function<void(const Parameter& p, const float* values)>;
void for_each_hf_parameter(const std::string& hf_dir, const ParameterStore& layout,
                           const Gpt2Config& model, const HfParameterSink& take);

// The HuggingFace name of a Loom parameter ("blocks.3.attn.qkv.weight" ->
// "transformer.h.3.attn.c_attn.weight"), and whether its weight is stored transposed there.
struct HfName {
  std::string name;
  bool transposed = false;
};
HfName hf_name_of(const std::string& loom_name);

}  // namespace loom
