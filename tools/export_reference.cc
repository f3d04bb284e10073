// Writes the inputs of the PyTorch reference tests: the initial weights of a small GPT-2 (vocab
// 256, T 32, d 64, 2 layers, 4 heads; seed 1234) and one batch of tokens/targets, as safetensors.
// tools/torch_reference.py reads this file, runs the same step in PyTorch and writes the golden
// file that tests/models/gpt2_reference_test.cc compares against. With --llama the same for the
// Llama form (4 query heads sharing 2 key/value heads, SwiGLU 96 wide, rope_theta 10000):
// tools/hf_llama_reference.py runs it in HuggingFace transformers' LlamaForCausalLM for
// tests/models/llama_reference_test.cc. With --moe that Llama with a mixture of 4 SwiGLU experts
// (48 wide, top 2) in each block: tools/hf_mixtral_reference.py runs it in transformers'
// MixtralForCausalLM for tests/models/moe_reference_test.cc. With --qwen2 the Llama with biases on
// its queries, keys and values (model.qkv_bias), rope_theta 1e6 and RMSNorm's epsilon 1e-6, as
// Qwen 2.5's: tools/hf_llama_reference.py runs it in transformers' Qwen2ForCausalLM for
// tests/models/qwen2_reference_test.cc. With --qwen3 the Llama with per-head query/key norms
// (model.qk_norm) and heads 32 wide (model.head_dim: queries 128 wide from 64 channels), rope_theta
// 1e6 and epsilon 1e-6, as Qwen 3's: tools/hf_llama_reference.py runs it in transformers'
// Qwen3ForCausalLM for tests/models/qwen3_reference_test.cc. With --olmo2 the Llama with OLMo 2's
// post-norms and query/key norms over all the heads, rope_theta 500000 and epsilon 1e-6:
// tools/hf_llama_reference.py runs it in transformers' Olmo2ForCausalLM for
// tests/models/olmo2_reference_test.cc. See tools/README.md.
#include <cstdio>
#include <map>
#include <string>

#include "checkpoint/safetensors.h"
#include "models/gpt2.h"
#include "tensor/rng.h"

int main(int argc, char** argv) {
  const bool moe = argc == 3 && std::string(argv[1]) == "--moe";
  const bool qwen2 = argc == 3 && std::string(argv[1]) == "--qwen2";
  const bool qwen3 = argc == 3 && std::string(argv[1]) == "--qwen3";
  const bool olmo2 = argc == 3 && std::string(argv[1]) == "--olmo2";
  const bool gemma3 = argc == 3 && std::string(argv[1]) == "--gemma3";
  const bool llama =
      moe || qwen2 || qwen3 || olmo2 || gemma3 || (argc == 3 && std::string(argv[1]) == "--llama");
  if (argc != 2 && !llama) {
    std::fprintf(stderr,
                 "usage: %s [--llama | --moe | --qwen2 | --qwen3 | --olmo2 | --gemma3] "
                 "OUT.safetensors\n",
                 argv[0]);
    return 2;
  }
  const char* out_path = argv[argc - 1];
  try {
    loom::Gpt2Config c;
    if (llama) {
      c.arch = loom::Arch::kLlama;
      c.n_kv_heads = 2;
      c.ffn_hidden = 96;
      c.rope_theta = 10000;
      c.norm_eps = 1e-5;
    }
    if (qwen2 || qwen3) {
      c.qkv_bias = qwen2;
      c.qk_norm = qwen3;
      c.head_width = qwen3 ? 32 : 0;
      c.rope_theta = 1e6;
      c.norm_eps = 1e-6;
    }
    if (olmo2) {
      c.post_norm = c.qk_norm = c.qk_norm_full = true;
      c.rope_theta = 500000;
      c.norm_eps = 1e-6;
    }
    if (gemma3) {  // tests/models/reference_check.h: reference_gemma3
      c.qk_norm = c.sandwich_norm = true;
      c.ffn_activation = loom::GatedActivation::kGeluTanh;
      c.head_width = 32;
      c.embedding_multiplier = 8;  // √64
      c.sliding_window = 8;
      c.full_attention_every = 2;
      c.rope_theta = 1e6;
      c.rope_local_theta = 10000;
      c.norm_eps = 1e-6;
    }
    if (moe) {
      c.ffn_hidden = 48;
      c.moe_experts = 4;
      c.moe_top_k = 2;
      c.moe_aux_loss_coef = 0.05f;
    }
    c.vocab_size = 256;
    c.max_seq_len = 32;
    c.d_model = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    loom::Gpt2 model(c);
    model.build(loom::DType::kF32, loom::Device::cpu(), 1234);
    std::vector<std::pair<std::string, loom::Tensor>> out;
    for (const auto& p : model.params().parameters()) out.emplace_back(p->name, p->value);
    const int64_t B = 4, T = 32;
    loom::Tensor tokens = loom::Tensor::empty({B, T + 1}, loom::DType::kI32);
    loom::RandomStream rng(1234, "reference.batch");
    for (int64_t i = 0; i < tokens.numel(); ++i)
      tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 256);
    out.emplace_back("batch.tokens", tokens);  // inputs = [:, :-1], targets = [:, 1:]
    std::map<std::string, std::string> meta = {{"seed", "1234"}, {"n_heads", "4"}};
    if (llama)
      meta.insert({{"arch", "llama"}, {"n_kv_heads", "2"}, {"ffn_hidden", "96"},
                   {"rope_theta", "10000"}, {"norm_eps", "1e-5"}});
    if (qwen2 || qwen3) {
      meta[qwen2 ? "qkv_bias" : "qk_norm"] = "1";
      if (qwen3) meta["head_dim"] = "32";
      meta["rope_theta"] = "1000000";
      meta["norm_eps"] = "1e-6";
    }
    if (olmo2) {
      meta.insert({{"qk_norm", "1"}, {"qk_norm_scope", "full"}, {"norm_placement", "post"}});
      meta["rope_theta"] = "500000";
      meta["norm_eps"] = "1e-6";
    }
    if (gemma3) {
      meta.insert({{"qk_norm", "1"},
                   {"norm_placement", "sandwich"},
                   {"head_dim", "32"},
                   {"ffn_activation", "gelu_tanh"},
                   {"sliding_window", "8"},
                   {"full_attention_every", "2"},
                   {"rope_local_theta", "10000"}});
      meta["rope_theta"] = "1000000";
      meta["norm_eps"] = "1e-6";
    }
    if (moe) {
      meta["ffn_hidden"] = "48";
      meta.insert({{"moe_experts", "4"}, {"moe_top_k", "2"}, {"moe_aux_loss_coef", "0.05"}});
    }
    loom::save_safetensors(out_path, out, meta);
    std::fprintf(stderr, "wrote %s\n", out_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
