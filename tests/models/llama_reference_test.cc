// Loom's Llama against HuggingFace transformers' LlamaForCausalLM:
// tests/data/llama_reference_golden.safetensors was written by tools/hf_llama_reference.py (see
// tools/README.md) from the same initial weights and batch, which Loom regenerates here from seed
// 1234: 4 query heads sharing 2 key/value heads, a SwiGLU 96 wide, rope_theta 10000, tied head.
// Loss within 1e-5 relative; every gradient within 1e-4 relative to the largest magnitude of that
// gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include <cmath>

#include "checkpoint/safetensors.h"
#include "reference_check.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "tensor/rng.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/llama_reference_golden.safetensors";

Gpt2Config reference_llama() {  // tools/export_reference.cc --llama
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 256;
  c.max_seq_len = 32;
  c.d_model = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 96;
  c.rope_theta = 10000;
  c.norm_eps = 1e-5;
  return c;
}

struct Reference {
  ThreadPool pool{2};
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model{reference_llama()};
  Tensor tokens = Tensor::empty({4, 32}, DType::kI32);
  Tensor targets = Tensor::empty({4, 32}, DType::kI32);
  SafetensorsFile golden = load_safetensors(kGolden);

  Reference() {
    model.build(DType::kF32, Device::cpu(), 1234);
    testing::fill_reference_batch(tokens, targets);
  }
  double scalar(const std::string& name, int i = 0) {
    return golden.tensors.at(name).data<double>()[i];
  }
};

TEST(LlamaReference, InitialisationMatchesTheGoldenInputs) {
  Reference r;
  double sumsq = 0;
  for (float v : r.model.params().values().to_vector()) sumsq += double(v) * v;
  EXPECT_NEAR(sumsq, r.scalar("init_sumsq"), 1e-9 * sumsq)
      << "the initialisation changed: regenerate the golden file with tools/make_golden.sh llama";
}

TEST(LlamaReference, LossAndGradientsMatchTransformers) {
  Reference r;
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  EXPECT_EQ(checked, 1 + 6 * 2 + 1);  // wte, six per block, ln_f
}

TEST(LlamaReference, FiveAdamWStepsMatchTransformers) {
  Reference r;
  AdamWConfig cfg;  // betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices
  AdamW opt(r.model.params(), cfg);
  for (int step = 0; step < 5; ++step) {
    r.model.params().zero_grads();
    r.model.forward(r.ctx, r.tokens, r.targets);
    r.model.backward(r.ctx);
    opt.step(r.pool, 1e-3f);
    const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
    r.model.clear_cache();
    EXPECT_NEAR(loss, r.scalar("adamw_losses", step), 1e-4 * r.scalar("adamw_losses", step))
        << "after step " << step + 1;
  }
}

}  // namespace
}  // namespace loom
