#include "models/gpt2.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "../nn/gradcheck.h"
#include "base/error.h"

namespace loom {
namespace {

Gpt2Config tiny_config() {
  Gpt2Config c;
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.init_std = 0.3f;  // large enough that every path carries gradient
  return c;
}

void fill_batch(Tensor& tokens, Tensor& targets, int64_t vocab, uint64_t seed) {
  RandomStream rng(seed, "test.batch");
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
  }
}

TEST(Gpt2, WholeModelGradCheckInDouble) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  Gpt2 model(tiny_config());
  model.build(DType::kF64, Device::cpu(), 3);
  for (const auto& p : model.params().parameters()) {  // non-trivial LayerNorm gains and biases
    Tensor r = testing::random_f64(p->shape, p->name + ".perturb", 0.2);
    for (int64_t i = 0; i < p->numel(); ++i) p->value.data<double>()[i] += r.data<double>()[i];
  }
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32), targets = Tensor::empty({2, 5}, DType::kI32);
  fill_batch(tokens, targets, 11, 1);
  testing::GradCheck gc{[&] { return model.forward(ctx, tokens, targets); },
                        [&] { model.backward(ctx); return Tensor(); },
                        [&] { model.clear_cache(); }};
  gc.run(model.params(), nullptr);
}

TEST(Gpt2, InitialLossIsNearLogVocab) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_config();
  c.vocab_size = 256;
  c.d_model = 32;
  c.init_std = 0.02f;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 1);
  Tensor tokens = Tensor::empty({4, 6}, DType::kI32), targets = Tensor::empty({4, 6}, DType::kI32);
  fill_batch(tokens, targets, 256, 2);
  EXPECT_NEAR(model.forward(ctx, tokens, targets), std::log(256.0), 0.05);
}

// Runs forward+backward and returns a copy of the flat gradient buffer.
std::vector<float> gradients(bool recompute, int threads) {
  ThreadPool pool(threads);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_config();
  c.recompute = recompute;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  Tensor tokens = Tensor::empty({3, 6}, DType::kI32), targets = Tensor::empty({3, 6}, DType::kI32);
  fill_batch(tokens, targets, 11, 3);
  model.forward(ctx, tokens, targets);
  model.backward(ctx);
  return model.params().grads().to_vector();
}

TEST(Gpt2, RecomputationGivesBitwiseIdenticalGradients) {
  const std::vector<float> plain = gradients(false, 2);
  const std::vector<float> recomputed = gradients(true, 2);
  ASSERT_EQ(plain.size(), recomputed.size());
  EXPECT_EQ(std::memcmp(plain.data(), recomputed.data(), plain.size() * 4), 0);
}

TEST(Gpt2, RunsAreBitwiseRepeatable) {
  const std::vector<float> a = gradients(false, 3);
  const std::vector<float> b = gradients(false, 3);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

TEST(Gpt2, ParameterNamesAndCount) {
  Gpt2 model(tiny_config());
  const auto& ps = model.params().parameters();
  int64_t total = 0;
  for (const auto& p : ps) total += p->numel();
  EXPECT_EQ(total, tiny_config().num_parameters());
  EXPECT_NE(model.params().find("blocks.1.attn.qkv.weight"), nullptr);
  EXPECT_NE(model.params().find("blocks.0.mlp.proj.bias"), nullptr);
  EXPECT_NE(model.params().find("ln_f.weight"), nullptr);
  EXPECT_EQ(model.params().find("lm_head.weight"), nullptr);  // tied to wte.weight
}

TEST(Gpt2, ConfigErrorsNameTheField) {
  Gpt2Config c = tiny_config();
  c.n_heads = 3;
  try {
    Gpt2 model(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_heads = 3 does not divide model.d_model = 8"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace loom
