// Llama's form of the model (Gpt2Config::arch = kLlama): RMSNorm, rotary attention with
// grouped-query heads, SwiGLU, no biases, no position table. The gradient of every parameter
// against finite differences in double, with shared and with unshared key/value heads; the
// parameter inventory; recomputation modes bit for bit; the cache of a block counted exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../nn/gradcheck.h"
#include "base/error.h"
#include "models/gpt2.h"
#include "tensor/rng.h"

namespace loom {
namespace {

Gpt2Config tiny_llama(int64_t kv_heads = 1) {
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;  // head size 4: two rotated pairs
  c.n_kv_heads = kv_heads;
  c.ffn_hidden = 12;
  c.rope_theta = 10.0;  // turns that differ a lot between positions 0..5
  c.init_std = 0.3f;
  return c;
}

void fill_batch(Tensor& tokens, Tensor& targets, int64_t vocab, uint64_t seed) {
  RandomStream rng(seed, "test.batch");
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
  }
}

void grad_check(const Gpt2Config& c) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  Gpt2 model(c);
  model.build(DType::kF64, Device::cpu(), 3);
  for (const auto& p : model.params().parameters()) {  // RMSNorm gains away from one
    Tensor r = testing::random_f64(p->shape, p->name + ".perturb", 0.2);
    for (int64_t i = 0; i < p->numel(); ++i) p->value.data<double>()[i] += r.data<double>()[i];
  }
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32), targets = Tensor::empty({2, 5}, DType::kI32);
  fill_batch(tokens, targets, c.vocab_size, 1);
  // With a mixture of experts the loss backward differentiates has the balance losses too.
  testing::GradCheck gc{[&] { return model.forward(ctx, tokens, targets) + model.aux_loss(); },
                        [&] {
                          model.backward(ctx);
                          return Tensor();
                        },
                        [&] { model.clear_cache(); }};
  gc.run(model.params(), nullptr);
}

// The loss in double of a model of `c` (weights seeded 5) on a fixed batch.
double loss_of(const Gpt2Config& c) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  Gpt2 model(c);
  model.build(DType::kF64, Device::cpu(), 5);
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32), targets = Tensor::empty({2, 5}, DType::kI32);
  fill_batch(tokens, targets, c.vocab_size, 2);
  return model.forward(ctx, tokens, targets);
}

TEST(Llama, WholeModelGradCheckInDoubleWithSharedKeyValueHeads) { grad_check(tiny_llama(1)); }

// c with a mixture of 4 experts 6 wide, top 2 (nn/moe_mlp.h), and a large balance loss.
Gpt2Config with_mixture(Gpt2Config c) {
  c.ffn_hidden = 6;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_aux_loss_coef = 0.25f;
  return c;
}

// The routing weights' and the balance loss's gradients reach the router through every block.
TEST(Llama, WholeModelGradCheckInDoubleWithAMixtureOfExperts) {
  grad_check(with_mixture(tiny_llama(1)));
}

TEST(Llama, WholeModelGradCheckInDoubleWithAKeyValueHeadPerQueryHead) {
  grad_check(tiny_llama(2));
}

TEST(Llama, WholeModelGradCheckInDoubleWithAnUntiedHead) {
  Gpt2Config c = tiny_llama(1);
  c.tie_embeddings = false;
  grad_check(c);
}

TEST(Llama, AnUntiedHeadHasItsOwnWeightAndIsCounted) {
  Gpt2Config c = tiny_llama(1);
  c.tie_embeddings = false;
  Gpt2 model(c);
  int64_t total = 0;
  for (const auto& p : model.params().parameters()) total += p->numel();
  EXPECT_EQ(total, c.num_parameters());
  EXPECT_EQ(c.num_parameters(), tiny_llama(1).num_parameters() + 11 * 8);
  EXPECT_EQ(model.params().get("lm_head.weight").shape, (Shape{11, 8}));
  EXPECT_EQ(model.head_weight(), &model.params().get("lm_head.weight"));
  EXPECT_EQ(model.tied_head_copy(), nullptr);
  // The head is multiplied, the embedding looked up: 6 per head weight, none per wte row.
  EXPECT_EQ(c.flops_per_token(6) - tiny_llama(1).flops_per_token(6), 0.0);
}

// Qwen 3's block: per-head query/key norms (model.qk_norm) on heads wider than their share of
// d_model (model.head_dim = 6: 2 query heads of 6 from 8 channels, proj 12 -> 8), checked by
// finite differences in double, and its parameters those of HuggingFace's Qwen 3 and counted.
Gpt2Config tiny_qwen3() {
  Gpt2Config c = tiny_llama(1);
  c.qk_norm = true;
  c.head_width = 6;
  return c;
}

TEST(Llama, WholeModelGradCheckInDoubleWithQwen3sNormsAndWideHeads) {
  grad_check(tiny_qwen3());
}

// OLMo 2's block: norms on the attention's and the MLP's outputs (model.norm_placement = "post")
// and one query norm and one key norm over all the heads (model.qk_norm_scope = "full"), with a
// shared key/value head and with one per query head: finite differences in double, its
// parameters counted (q_norm 8 wide, k_norm 4 or 8).
Gpt2Config tiny_olmo2(int64_t kv_heads) {
  Gpt2Config c = tiny_llama(kv_heads);
  c.post_norm = true;
  c.qk_norm = true;
  c.qk_norm_full = true;
  return c;
}

TEST(Llama, WholeModelGradCheckInDoubleWithOlmo2sPostNormsAndFullQkNorms) {
  grad_check(tiny_olmo2(1));
  grad_check(tiny_olmo2(2));
}

// Gemma 3 27B's scores scaled by 1/√query_pre_attn_scalar, not 1/√head_dim (the query norm's
// output times √(head_dim / scalar)): finite differences in double, per-head and full norms; the
// loss moves with the scalar and is the plain model's at scalar = head_dim, bit for bit.
TEST(Llama, QueryPreAttnScalarGradCheckInDoubleAndItScalesTheScores) {
  Gpt2Config c = tiny_qwen3();
  c.query_pre_attn_scalar = 3 * c.head_dim();
  grad_check(c);
  Gpt2Config full = tiny_olmo2(1);
  full.query_pre_attn_scalar = 5;
  grad_check(full);
  Gpt2Config same = c;
  same.query_pre_attn_scalar = c.head_dim();
  EXPECT_EQ(loss_of(same), loss_of(tiny_qwen3()));
  EXPECT_GT(std::abs(loss_of(c) - loss_of(tiny_qwen3())), 1e-6);
}

TEST(Llama, Olmo2sNormsAreItsParametersAndCounted) {
  for (const int64_t kv : {1, 2}) {
    const Gpt2Config c = tiny_olmo2(kv);
    Gpt2 model(c);
    int64_t total = 0;
    for (const auto& p : model.params().parameters()) total += p->numel();
    EXPECT_EQ(total, c.num_parameters());
    EXPECT_EQ(model.params().get("blocks.1.attn.q_norm.weight").shape, (Shape{8}));
    EXPECT_EQ(model.params().get("blocks.1.attn.k_norm.weight").shape, (Shape{4 * kv}));
  }
  // OLMo 2 1B (allenai/OLMo-2-0425-1B, configs/olmo2-1b.toml): 16 blocks of 2048 channels, 16
  // heads, a SwiGLU 8192 wide, 100352 tokens, untied: 1,484,916,736 parameters (1.48 B).
  Gpt2Config olmo2 = tiny_olmo2(1);
  olmo2.vocab_size = 100352;
  olmo2.d_model = 2048;
  olmo2.n_layers = 16;
  olmo2.n_heads = 16;
  olmo2.n_kv_heads = 16;
  olmo2.ffn_hidden = 8192;
  olmo2.tie_embeddings = false;
  EXPECT_EQ(olmo2.num_parameters(), 1484916736);
  // OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924, configs/olmoe-1b-7b.toml): pre-norms, the same
  // full-width query/key norms, 64 experts 1024 wide in each block, 50304 tokens, untied:
  // 6,919,161,856 parameters.
  Gpt2Config olmoe = olmo2;
  olmoe.post_norm = false;
  olmoe.vocab_size = 50304;
  olmoe.ffn_hidden = 1024;
  olmoe.moe_experts = 64;
  olmoe.moe_top_k = 8;
  EXPECT_EQ(olmoe.num_parameters(), 6919161856);
}

// A Hub model's sizes on c.
struct HubShape {
  int64_t vocab, d_model, layers, heads, kv_heads, head_dim, ffn_hidden;
};
Gpt2Config with_shape(Gpt2Config c, const HubShape& s) {
  c.vocab_size = s.vocab;
  c.d_model = s.d_model;
  c.n_layers = s.layers;
  c.n_heads = s.heads;
  c.n_kv_heads = s.kv_heads;
  c.head_width = s.head_dim;
  c.ffn_hidden = s.ffn_hidden;
  return c;
}

// Gemma's sandwich norms (model.norm_placement = "sandwich"): the pre-norm block's two and one on
// each branch's output before the skip connection adds it — finite differences in double (with a
// mixture of experts too), the two more gains a block counted, and recomputation bit for bit.
Gpt2Config tiny_sandwich(int64_t kv_heads) {
  Gpt2Config c = tiny_llama(kv_heads);
  c.sandwich_norm = true;
  return c;
}

TEST(Llama, WholeModelGradCheckInDoubleWithSandwichNorms) {
  grad_check(tiny_sandwich(1));
  grad_check(tiny_sandwich(2));
  grad_check(with_mixture(tiny_sandwich(1)));
}

// Gemma's GeGLU (model.ffn_activation = "gelu_tanh"): the gated MLP with the tanh GELU on its
// gate, with and without the sandwich norms — finite differences in double, the same parameters
// as the SwiGLU's and a loss of its own.
TEST(Llama, WholeModelGradCheckInDoubleWithGeGlu) {
  for (Gpt2Config c : {tiny_llama(1), tiny_sandwich(2)}) {
    c.ffn_activation = GatedActivation::kGeluTanh;
    grad_check(c);
  }
}

TEST(Llama, GeGluHasTheSwiGlusParametersAndItsOwnLoss) {
  Gpt2Config geglu = tiny_llama(1);
  geglu.ffn_activation = GatedActivation::kGeluTanh;
  EXPECT_EQ(geglu.num_parameters(), tiny_llama(1).num_parameters());
  EXPECT_GT(std::abs(loss_of(geglu) - loss_of(tiny_llama(1))), 1e-6);
}

TEST(Llama, SandwichNormsAreItsParametersAndCounted) {
  // Gemma 3 1B (google/gemma-3-1b-pt, configs/gemma3-1b.toml): 26 blocks of 1152 channels, 4
  // query heads of 256 sharing 1, GeGLU 6912 wide, 262144 tokens, tied: 999,885,952 parameters.
  Gpt2Config gemma = tiny_sandwich(1);
  gemma.qk_norm = true;
  EXPECT_EQ(with_shape(gemma, {262144, 1152, 26, 4, 1, 256, 6912}).num_parameters(), 999885952);
  // 4B, 12B and 27B (configs/gemma3-{4b,12b,27b}.toml): their language models, 262208 tokens.
  EXPECT_EQ(with_shape(gemma, {262208, 2560, 34, 8, 4, 256, 10240}).num_parameters(), 3880263168);
  EXPECT_EQ(with_shape(gemma, {262208, 3840, 48, 16, 8, 256, 15360}).num_parameters(), 11766034176);
  EXPECT_EQ(with_shape(gemma, {262208, 5376, 62, 32, 16, 128, 21504}).num_parameters(),
            27009346304);
  const Gpt2Config c = tiny_sandwich(1);
  Gpt2 model(c);
  int64_t total = 0;
  for (const auto& p : model.params().parameters()) total += p->numel();
  EXPECT_EQ(total, c.num_parameters());
  EXPECT_EQ(c.num_parameters(), tiny_llama(1).num_parameters() + 2 * 2 * 8);
  for (const char* name : {"blocks.1.ln_1.weight", "blocks.1.attn_out_norm.weight",
                           "blocks.1.ln_2.weight", "blocks.1.mlp_out_norm.weight"})
    EXPECT_EQ(model.params().get(name).shape, (Shape{8})) << name;
}

// Where the output norms sit: right on the branches' outputs, so scaling a branch's output
// projection leaves the loss as it was (with an eps too small to tell) — it moves the pre-norm
// model's.
TEST(Llama, SandwichNormsNormaliseTheBranchesOutputs) {
  const auto loss_with_proj_scaled = [](const Gpt2Config& c, double scale) {
    ThreadPool pool(1);
    Context ctx{&pool, Device::cpu(), DType::kF64};
    Gpt2 model(c);
    model.build(DType::kF64, Device::cpu(), 5);
    for (const char* name : {"blocks.0.attn.proj.weight", "blocks.1.mlp.proj.weight"}) {
      Parameter& p = model.params().get(name);
      for (int64_t i = 0; i < p.numel(); ++i) p.value.data<double>()[i] *= scale;
    }
    Tensor tokens = Tensor::empty({2, 5}, DType::kI32),
           targets = Tensor::empty({2, 5}, DType::kI32);
    fill_batch(tokens, targets, c.vocab_size, 2);
    return model.forward(ctx, tokens, targets);
  };
  Gpt2Config sandwich = tiny_sandwich(1), pre = tiny_llama(1);
  sandwich.norm_eps = pre.norm_eps = 1e-14;
  EXPECT_NEAR(loss_with_proj_scaled(sandwich, 7.0), loss_with_proj_scaled(sandwich, 1.0), 1e-12);
  EXPECT_GT(std::abs(loss_with_proj_scaled(pre, 7.0) - loss_with_proj_scaled(pre, 1.0)), 1e-2);
}

TEST(Llama, Qwen3sNormsAndWideHeadsAreItsParametersAndCounted) {
  const Gpt2Config c = tiny_qwen3();
  Gpt2 model(c);
  int64_t total = 0;
  for (const auto& p : model.params().parameters()) total += p->numel();
  EXPECT_EQ(total, c.num_parameters());
  // qkv: 2 query heads and 1 shared key and value head of 6 → (12 + 2·6) × 8; proj 12 → 8.
  EXPECT_EQ(model.params().get("blocks.1.attn.qkv.weight").shape, (Shape{24, 8}));
  EXPECT_EQ(model.params().get("blocks.1.attn.proj.weight").shape, (Shape{8, 12}));
  EXPECT_EQ(model.params().get("blocks.0.attn.q_norm.weight").shape, (Shape{6}));
  EXPECT_EQ(model.params().get("blocks.0.attn.k_norm.weight").shape, (Shape{6}));
  // Qwen 3 0.6B (Hugging Face's Qwen/Qwen3-0.6B): 596,049,920 parameters, its head tied.
  const Gpt2Config qwen3 = with_shape(c, {151936, 1024, 28, 16, 8, 128, 3072});
  EXPECT_EQ(qwen3.num_parameters(), 596049920);
  // Qwen 3 30B-A3B (Qwen/Qwen3-30B-A3B): 128 experts 768 wide per block, 8 per token, 32 query
  // heads of 128 from 2048 channels sharing 4, 48 blocks, untied: 30,532,122,624 parameters.
  Gpt2Config moe = qwen3;
  moe.d_model = 2048;
  moe.n_layers = 48;
  moe.n_heads = 32;
  moe.n_kv_heads = 4;
  moe.ffn_hidden = 768;
  moe.moe_experts = 128;
  moe.moe_top_k = 8;
  moe.tie_embeddings = false;
  EXPECT_EQ(moe.num_parameters(), 30532122624);
  // A sliding window counts its W positions of the sequence's T in the attention's flops.
  Gpt2Config windowed = qwen3;
  windowed.sliding_window = 1000;
  EXPECT_DOUBLE_EQ(qwen3.flops_per_token(4096) - windowed.flops_per_token(4096),
                   12.0 * 28 * 2048 * (4096 - 1000));
  EXPECT_DOUBLE_EQ(windowed.flops_per_token(512), qwen3.flops_per_token(512));
  // Every 4th block whole: 7 of the 28 see the sequence's T, 21 the window's W.
  Gpt2Config some = windowed;
  some.full_attention_every = 4;
  EXPECT_DOUBLE_EQ(some.flops_per_token(4096) - windowed.flops_per_token(4096),
                   12.0 * 7 * 2048 * (4096 - 1000));
  EXPECT_EQ(some.window_of(2), 1000);
  EXPECT_EQ(some.window_of(3), 0);
  EXPECT_EQ(some.block(7).sliding_window, 0);
  EXPECT_EQ(some.block(8).sliding_window, 1000);
  // Mistral 7B v0.1 (configs/mistral-7b.toml): 7,241,732,096 parameters, as the Hub's.
  Gpt2Config mistral = tiny_llama(8);
  mistral.vocab_size = 32000;
  mistral.d_model = 4096;
  mistral.n_layers = 32;
  mistral.n_heads = 32;
  mistral.ffn_hidden = 14336;
  mistral.sliding_window = 4096;
  mistral.tie_embeddings = false;
  EXPECT_EQ(mistral.num_parameters(), 7241732096);
  // Phi-4 (configs/phi4-14b.toml): 40 blocks of 5120, 40 heads sharing 10, a SwiGLU 17920 wide,
  // 100352 tokens, untied: 14,659,507,200 parameters, as the Hub's.
  Gpt2Config phi4 = with_shape(tiny_llama(), {100352, 5120, 40, 40, 10, 128, 17920});
  phi4.tie_embeddings = false;
  EXPECT_EQ(phi4.num_parameters(), 14659507200);
  // The attention's flops grow with the heads' width: 12 · n_layers · n_heads·head_dim · T.
  Gpt2Config narrow = qwen3;
  narrow.head_width = 0;  // 16 heads of 64
  EXPECT_DOUBLE_EQ(qwen3.flops_per_token(1) - narrow.flops_per_token(1),
                   6.0 * static_cast<double>(qwen3.num_parameters() - narrow.num_parameters()) +
                       12.0 * 28 * (2048 - 1024));
}

TEST(Llama, ParametersAreLlamasAndTheirCountIsTheConfigs) {
  const Gpt2Config c = tiny_llama(1);
  Gpt2 model(c);
  int64_t total = 0;
  for (const auto& p : model.params().parameters()) {
    total += p->numel();
    EXPECT_FALSE(p->name.ends_with(".bias")) << p->name << ": Llama has no biases";
  }
  EXPECT_EQ(total, c.num_parameters());
  EXPECT_EQ(model.params().find("wpe.weight"), nullptr);  // positions enter by rotation
  // qkv: 2 query heads and 1 shared key and value head of size 4 → (8 + 2·4) × 8.
  EXPECT_EQ(model.params().get("blocks.1.attn.qkv.weight").shape, (Shape{16, 8}));
  EXPECT_EQ(model.params().get("blocks.0.mlp.fc.weight").shape, (Shape{24, 8}));  // gate | up
  EXPECT_EQ(model.params().get("blocks.0.mlp.proj.weight").shape, (Shape{8, 12}));
  EXPECT_EQ(model.params().get("ln_f.weight").shape, (Shape{8}));
  EXPECT_EQ(model.params().find("ln_f.bias"), nullptr);  // RMSNorm: a gain only
}

TEST(Llama, InitialLossIsNearLogVocabAndTrainingLowersIt) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_llama(2);
  c.vocab_size = 64;
  c.d_model = 32;
  c.n_heads = 4;
  c.ffn_hidden = 64;
  c.init_std = 0.02f;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  Tensor tokens = Tensor::empty({2, 6}, DType::kI32), targets = Tensor::empty({2, 6}, DType::kI32);
  fill_batch(tokens, targets, c.vocab_size, 2);
  const double first = model.forward(ctx, tokens, targets);
  EXPECT_NEAR(first, std::log(64.0), 0.05);
  model.backward(ctx);
  // Plain gradient descent on one batch: the loss must fall.
  for (int step = 0; step < 20; ++step) {
    for (const auto& p : model.params().parameters())
      for (int64_t i = 0; i < p->numel(); ++i) p->value.data<float>()[i] -= 0.5f * p->grad.data<float>()[i];
    model.params().zero_grads();
    model.forward(ctx, tokens, targets);
    model.backward(ctx);
  }
  EXPECT_LT(model.forward(ctx, tokens, targets), 0.5 * first);
}

// The blocks share the rotary cos/sin tables (nn/causal_self_attention.h, RotaryTables): one
// (T, head_dim) table for the model, not one per block — two with Gemma's local base in the
// windowed blocks — made again at another T. (That they hold each block's values: every Llama,
// Gemma 3 and Qwen model against transformers' logits, tests/checkpoint/export_test.cc.)
TEST(Llama, TheBlocksShareOneRotaryTable) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_llama(1);
  c.n_layers = 6;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  Tensor tokens = Tensor::empty({2, 6}, DType::kI32), targets = Tensor::empty({2, 6}, DType::kI32);
  fill_batch(tokens, targets, c.vocab_size, 4);
  const double loss = model.forward(ctx, tokens, targets);
  model.backward(ctx);
  EXPECT_EQ(model.rotary_tables().count(), 1);
  EXPECT_EQ(model.rotary_tables().bytes(), 6 * 4 * int64_t{sizeof(float)});  // T × head_dim
  Tensor shorter = Tensor::empty({1, 3}, DType::kI32);
  for (int i = 0; i < 3; ++i) shorter.data<int32_t>()[i] = i + 1;
  (void)model.logits(ctx, shorter);
  EXPECT_EQ(model.rotary_tables().bytes(), 3 * 4 * int64_t{sizeof(float)});
  EXPECT_TRUE(std::isfinite(loss));

  Gpt2Config windowed = c;  // Gemma's pattern: a local base in all but every 3rd block
  windowed.sliding_window = 3;
  windowed.full_attention_every = 3;
  windowed.rope_local_theta = 100;
  Gpt2 gemma_like(windowed);
  gemma_like.build(DType::kF32, Device::cpu(), 5);
  gemma_like.forward(ctx, tokens, targets);
  EXPECT_EQ(gemma_like.rotary_tables().count(), 2);
}

TEST(Llama, PositionsMatterThroughTheRotation) {
  // Without a position table, only the rotation tells positions apart: the same token at two
  // positions after the same prefix token gets different logits.
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model(tiny_llama(1));
  model.build(DType::kF32, Device::cpu(), 7);
  Tensor tokens = Tensor::empty({1, 4}, DType::kI32);
  for (int i = 0; i < 4; ++i) tokens.data<int32_t>()[i] = i % 2 == 0 ? 3 : 5;  // 3 5 3 5
  Tensor logits = model.logits(ctx, tokens);
  const float* l = logits.data<float>();
  const int64_t V = 11;
  double diff = 0;  // position 1 and 3 both read "3 5", but at other distances from the start
  for (int64_t v = 0; v < V; ++v) diff += std::abs(l[1 * V + v] - l[3 * V + v]);
  EXPECT_GT(diff, 1e-4);
}

struct LlamaRun {
  std::vector<double> losses;
  std::vector<float> grads;
};

LlamaRun run_mode(Recompute mode, Gpt2Config c = tiny_llama(1)) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  c.init_std = 0.02f;
  c.recompute = mode;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 9);
  LlamaRun run;
  for (int m = 0; m < 2; ++m) {
    Tensor tokens = Tensor::empty({3, 6}, DType::kI32), targets = Tensor::empty({3, 6}, DType::kI32);
    fill_batch(tokens, targets, c.vocab_size, 10 + m);
    run.losses.push_back(model.forward(ctx, tokens, targets));
    run.losses.push_back(model.aux_loss());  // a mixture of experts' balance loss, or 0
    model.unstash_activations(model.stash_activations());  // as a pipeline schedule does
    model.backward(ctx, 0.5);
  }
  run.grads = model.params().grads().to_vector();
  return run;
}

void expect_recomputation_modes_bitwise_equal(const Gpt2Config& c) {
  const LlamaRun none = run_mode(Recompute::kNone, c);
  for (Recompute mode : {Recompute::kFull, Recompute::kSelective}) {
    SCOPED_TRACE(recompute_name(mode));
    const LlamaRun run = run_mode(mode, c);
    ASSERT_EQ(run.losses.size(), none.losses.size());
    for (size_t m = 0; m < run.losses.size(); ++m)
      EXPECT_EQ(std::memcmp(&run.losses[m], &none.losses[m], sizeof(double)), 0);
    ASSERT_EQ(run.grads.size(), none.grads.size());
    EXPECT_EQ(std::memcmp(run.grads.data(), none.grads.data(), none.grads.size() * 4), 0);
  }
}

TEST(Llama, RecomputationModesGiveBitwiseIdenticalLossAndGradients) {
  expect_recomputation_modes_bitwise_equal(tiny_llama(1));
  Gpt2Config gemma = tiny_sandwich(1);  // Gemma's block: sandwich norms and GeGLU
  gemma.ffn_activation = GatedActivation::kGeluTanh;
  expect_recomputation_modes_bitwise_equal(gemma);
}

// A mixture of experts (nn/moe_mlp.h): selective recomputation drops the router's and the
// experts' inputs and gathers them again from the rebuilt norm output, the routing kept.
TEST(Llama, MixtureOfExpertsRecomputationModesGiveBitwiseIdenticalLossesAndGradients) {
  Gpt2Config c = tiny_llama(1);
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_aux_loss_coef = 0.25f;
  expect_recomputation_modes_bitwise_equal(c);
}

int64_t distinct_bytes(const std::vector<Tensor*>& slots) {
  std::vector<const void*> seen;
  int64_t bytes = 0;
  for (const Tensor* t : slots) {
    if (!t->defined()) continue;
    bool dup = false;
    for (const void* p : seen) dup = dup || p == t->raw();
    if (dup) continue;
    seen.push_back(t->raw());
    bytes += t->numel() * static_cast<int64_t>(dtype_size(t->dtype()));
  }
  return bytes;
}

// The bytes one block keeps after a forward of a (B, T) batch under `mode`.
int64_t block_cache_bytes(Gpt2Config c, Recompute mode, int64_t B, int64_t T) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  c.recompute = mode;
  ParameterStore store;
  Gpt2Block block(store, "blocks.0", c);
  store.allocate(DType::kF32, Device::cpu());
  store.initialize(4);
  Tensor x = Tensor::empty({B, T, c.d_model}, DType::kF32);
  init_normal(x, 1, "x", 0.0f, 1.0f);
  block.forward(ctx, x);
  std::vector<Tensor*> slots;
  block.collect_cache(slots);
  return distinct_bytes(slots);
}

// One Llama block's cache, exactly: N = B·T rows, C channels, Q = (NH + 2·KV)·hd the compact
// qkv's width (the shared key/value heads not repeated), H the SwiGLU's width; in floats.
//   none:      x, ln_1 out, qkv turned (Q), attention out, x1, ln_2 out, h (gate | up, 2H),
//              SwiGLU out (H) = 5·N·C + N·Q + 3·N·H, + both rstd (2·N) + the attention's
//              log-sum-exp (B·NH·T)
//   selective: less both RMSNorm outputs and the SwiGLU output = 3·N·C + N·Q + 2·N·H + 2·N + B·NH·T
//   full:      the input, N·C
TEST(LlamaBlock, CacheBytesPerRecomputationMode) {
  const Gpt2Config c = tiny_llama(1);
  const int64_t B = 3, T = 6, N = B * T, C = c.d_model, H = c.ffn_hidden, NH = c.n_heads;
  const int64_t Q = c.qkv_width();
  ASSERT_EQ(Q, 2 * C);  // 2 query heads and 1 shared key/value head of 4: 8 + 2·4
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective}) {
    SCOPED_TRACE(recompute_name(mode));
    const int64_t expected =
        mode == Recompute::kNone   ? 5 * N * C + N * Q + 3 * N * H + 2 * N + B * NH * T
        : mode == Recompute::kFull ? N * C
                                   : 3 * N * C + N * Q + 2 * N * H + 2 * N + B * NH * T;
    EXPECT_EQ(block_cache_bytes(c, mode, B, T), 4 * expected);
    // Sandwich norms: the output norms keep their inputs and rstd, 2·N·C + 2·N more (unless
    // full recomputation keeps the input alone).
    const int64_t sandwich = mode == Recompute::kFull ? N * C : expected + 2 * N * C + 2 * N;
    EXPECT_EQ(block_cache_bytes(tiny_sandwich(1), mode, B, T), 4 * sandwich) << "sandwich";
  }
}

// A mixture-of-experts block's cache, exactly: the dense MLP's ln_2 output (fc's input) and
// h and SwiGLU output (3·N·H) give way to the router's input (N·C), its probabilities (N·E), each
// token's choices and weights (2·N·k, the choices int32), each expert's rows and slots (2·N·k
// int32 over the experts) and outputs (N·k·C), each token's router log-sum-exp (N, the router
// z-loss's), the experts' places in the rows and each sequence's count of each (E + 1 + B·E
// int32, on the host), and the experts' gathered inputs
// (N·k·C), h (2·N·k·H) and SwiGLU outputs (N·k·H): whatever the routing, N·k rows in all.
//   none:      4·N·C + N·Q + 2·N + B·NH·T  +  N·C + N·E + 4·N·k + R + 2·N·k·C + 3·N·k·H
//   selective: 3·N·C + N·Q + 2·N + B·NH·T  +  N·E + 4·N·k + R + N·k·C + 2·N·k·H (the router's and
//              experts' inputs and the SwiGLU outputs dropped, rebuilt before backward)
// with R = N + E + 1 + B·E; and S shared experts (one SwiGLU S·H wide) keep 3·N·S·H (its input
// is the router's), under selective 2·N·S·H.
//   full:      the input, N·C
TEST(LlamaBlock, MixtureOfExpertsCacheBytesPerRecomputationMode) {
  Gpt2Config c = tiny_llama(1);
  c.moe_experts = 5;
  c.moe_top_k = 2;
  c.moe_shared_experts = 2;  // S: one more SwiGLU, S·H wide, on every token
  const int64_t B = 3, T = 6, N = B * T, C = c.d_model, H = c.ffn_hidden, NH = c.n_heads;
  const int64_t Q = c.qkv_width(), E = c.moe_experts, k = c.moe_top_k, R = N + E + 1 + B * E;
  const int64_t SH = c.moe_shared_experts * H;
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective}) {
    SCOPED_TRACE(recompute_name(mode));
    const int64_t attention = N * Q + 2 * N + B * NH * T;
    const int64_t expected =
        mode == Recompute::kNone ? 4 * N * C + attention + N * C + N * E + 4 * N * k + R +
                                       2 * N * k * C + 3 * N * k * H + 3 * N * SH
        : mode == Recompute::kFull ? N * C
                                   : 3 * N * C + attention + N * E + 4 * N * k + R + N * k * C +
                                         2 * N * k * H + 2 * N * SH;
    EXPECT_EQ(block_cache_bytes(c, mode, B, T), 4 * expected);
  }
}

TEST(Llama, ArchNamesRoundTripAndBadValuesAreErrors) {
  EXPECT_EQ(parse_arch("llama"), Arch::kLlama);
  EXPECT_EQ(parse_arch("gpt2"), Arch::kGpt2);
  EXPECT_THROW(parse_arch("mamba"), Error);
  Gpt2Config c = tiny_llama(1);
  c.n_kv_heads = 3;  // does not divide 2 query heads
  try {
    Gpt2 model(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_kv_heads = 3 does not divide model.n_heads = 2"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom
