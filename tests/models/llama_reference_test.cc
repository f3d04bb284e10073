// Loom's Llama against HuggingFace transformers' LlamaForCausalLM:
// tests/data/llama_reference_golden.safetensors was written by tools/hf_llama_reference.py (see
// tools/README.md) from the same initial weights and batch, which Loom regenerates here from seed
// 1234: 4 query heads sharing 2 key/value heads, a SwiGLU 96 wide, rope_theta 10000, tied head.
// Loss within 1e-5 relative; every gradient within 1e-4 relative to the largest magnitude of that
// gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include <cmath>

#include "checkpoint/safetensors.h"
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
    RandomStream rng(1234, "reference.batch");  // (4, 33) tokens; inputs [:, :-1], targets [:, 1:]
    for (int64_t b = 0; b < 4; ++b)
      for (int64_t t = 0; t <= 32; ++t) {
        const int32_t v = static_cast<int32_t>(rng.next_u32() % 256);
        if (t < 32) tokens.data<int32_t>()[b * 32 + t] = v;
        if (t > 0) targets.data<int32_t>()[b * 32 + t - 1] = v;
      }
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
  int checked = 0;
  for (const auto& p : r.model.params().parameters()) {
    const Tensor& ref = r.golden.tensors.at("grad." + p->name);
    ASSERT_EQ(ref.shape(), p->shape) << p->name;
    const std::vector<float> g = p->grad.to_vector();
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      max_ref = std::max(max_ref, std::abs(ref.data<double>()[i]));
      max_diff = std::max(max_diff, std::abs(g[i] - ref.data<double>()[i]));
    }
    EXPECT_GT(max_ref, 0) << p->name;
    EXPECT_LE(max_diff, 1e-4 * max_ref) << p->name << ": max |loom - transformers| = " << max_diff
                                        << ", max |transformers| = " << max_ref;
    ++checked;
  }
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
