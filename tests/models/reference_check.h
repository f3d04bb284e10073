// What the reference tests (gpt2_reference_test.cc against PyTorch, llama_reference_test.cc
// against transformers) share: the batch tools/export_reference.cc wrote, regenerated from seed
// 1234, and the comparison of every gradient with the golden file's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "checkpoint/safetensors.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "tensor/rng.h"

namespace loom::testing {

// The models tools/export_reference.cc writes: GPT-2 (vocab 256, T 32, d 64, 2 layers, 4 heads),
// with --llama in Llama's form (2 key/value heads, SwiGLU 96 wide, rope_theta 10000), with --moe
// that Llama with 4 SwiGLU experts 48 wide per block, top 2, balance loss 0.05.
inline Gpt2Config reference_gpt2() {
  Gpt2Config c;
  c.vocab_size = 256;
  c.max_seq_len = 32;
  c.d_model = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  return c;
}
inline Gpt2Config reference_llama() {
  Gpt2Config c = reference_gpt2();
  c.arch = Arch::kLlama;
  c.n_kv_heads = 2;
  c.ffn_hidden = 96;
  c.rope_theta = 10000;
  c.norm_eps = 1e-5;
  return c;
}
// --qwen2: the Llama with qkv biases, rope_theta 1e6 and norm_eps 1e-6 (Qwen 2.5's).
inline Gpt2Config reference_qwen2() {
  Gpt2Config c = reference_llama();
  c.qkv_bias = true;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6;
  return c;
}
// --qwen3: the Llama with per-head query/key norms, heads 32 wide (queries 128 wide from 64
// channels), rope_theta 1e6 and norm_eps 1e-6 (Qwen 3's).
inline Gpt2Config reference_qwen3() {
  Gpt2Config c = reference_qwen2();
  c.qkv_bias = false;
  c.qk_norm = true;
  c.head_width = 32;
  return c;
}
// OLMo 2's form: norms after the attention and the MLP, one query and one key norm over all the
// heads; rope_theta 500000 (OLMo 2's) and epsilon 1e-6.
inline Gpt2Config reference_olmo2() {
  Gpt2Config c = reference_llama();
  c.post_norm = true;
  c.qk_norm = true;
  c.qk_norm_full = true;
  c.rope_theta = 500000;
  c.norm_eps = 1e-6;
  return c;
}
// --gemma3: the Llama as Gemma 3 — sandwich norms, GeGLU, per-head query/key norms on heads 32
// wide, the embedding times √64 = 8, a window of 8 positions (of 32) in block 0 turned by a base
// of 10 000, block 1 whole turned by 1e6 — epsilon 1e-6.
inline Gpt2Config reference_gemma3() {
  Gpt2Config c = reference_qwen3();
  c.sandwich_norm = true;
  c.ffn_activation = GatedActivation::kGeluTanh;
  c.embedding_multiplier = 8;
  c.sliding_window = 8;
  c.full_attention_every = 2;
  c.rope_local_theta = 10000;
  return c;
}
inline Gpt2Config reference_moe() {
  Gpt2Config c = reference_llama();
  c.ffn_hidden = 48;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_aux_loss_coef = 0.05f;
  return c;
}

// The (4, 33) token batch of tools/export_reference.cc: inputs [:, :-1], targets [:, 1:].
inline void fill_reference_batch(Tensor& tokens, Tensor& targets) {
  RandomStream rng(1234, "reference.batch");
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t t = 0; t <= 32; ++t) {
      const int32_t v = static_cast<int32_t>(rng.next_u32() % 256);
      if (t < 32) tokens.data<int32_t>()[b * 32 + t] = v;
      if (t > 0) targets.data<int32_t>()[b * 32 + t - 1] = v;
    }
}

// Every parameter's gradient within `rel` of the largest magnitude of the golden "grad.<name>"
// (double); returns how many were compared.
inline int expect_gradients_match(Gpt2& model, const SafetensorsFile& golden,
                                  const std::string& reference, double rel = 1e-4) {
  int checked = 0;
  for (const auto& p : model.params().parameters()) {
    const Tensor& ref = golden.tensors.at("grad." + p->name);
    EXPECT_EQ(ref.shape(), p->shape) << p->name;
    if (ref.shape() != p->shape) continue;
    const std::vector<float> g = p->grad.to_vector();
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      max_ref = std::max(max_ref, std::abs(ref.data<double>()[i]));
      max_diff = std::max(max_diff, std::abs(g[i] - ref.data<double>()[i]));
    }
    EXPECT_GT(max_ref, 0) << p->name;
    EXPECT_LE(max_diff, rel * max_ref) << p->name << ": max |loom - " << reference
                                       << "| = " << max_diff << ", max |" << reference
                                       << "| = " << max_ref;
    ++checked;
  }
  return checked;
}

// A reference model as tools/export_reference.cc builds it (seed 1234), its batch and the
// golden file its reference script wrote.
struct ReferenceRun {
  ThreadPool pool{2};
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model;
  Tensor tokens = Tensor::empty({4, 32}, DType::kI32);
  Tensor targets = Tensor::empty({4, 32}, DType::kI32);
  SafetensorsFile golden;

  ReferenceRun(const Gpt2Config& config, const std::string& golden_path)
      : model(config), golden(load_safetensors(golden_path)) {
    model.build(DType::kF32, Device::cpu(), 1234);
    fill_reference_batch(tokens, targets);
  }
  double scalar(const std::string& name, int i = 0) const {
    return golden.tensors.at(name).data<double>()[i];
  }

  // The initial weights' sum of squares is the golden file's: the same starting point.
  void expect_initialisation_matches(const std::string& regenerate) {
    double sumsq = 0;
    for (float v : model.params().values().to_vector()) sumsq += double(v) * v;
    EXPECT_NEAR(sumsq, scalar("init_sumsq"), 1e-9 * sumsq)
        << "the initialisation changed: regenerate the golden file with " << regenerate;
  }

  // Five AdamW steps (betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices, lr 1e-3) on
  // the batch: the loss after each within 1e-4 relative of the golden "adamw_losses".
  void expect_adamw_steps_match() {
    AdamWConfig cfg;
    AdamW opt(model.params(), cfg);
    for (int step = 0; step < 5; ++step) {
      model.params().zero_grads();
      model.forward(ctx, tokens, targets);
      model.backward(ctx);
      opt.step(pool, 1e-3f);
      const double loss = model.forward(ctx, tokens, targets);
      model.clear_cache();
      EXPECT_NEAR(loss, scalar("adamw_losses", step), 1e-4 * scalar("adamw_losses", step))
          << "after step " << step + 1;
    }
  }
};

}  // namespace loom::testing
