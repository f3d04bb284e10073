// Loom's Llama with Qwen 3's per-head query/key norms (model.qk_norm) and heads wider than their
// share of d_model (model.head_dim) against HuggingFace transformers' Qwen3ForCausalLM:
// tests/data/qwen3_reference_golden.safetensors was written by tools/hf_llama_reference.py
// (tools/make_golden.sh qwen3, transformers 4.51.3) from the same initial weights and batch, which
// Loom regenerates here from seed 1234: the reference Llama (4 query heads sharing 2 key/value
// heads, each 32 wide, so the queries are 128 wide from 64 channels and the output projection maps
// 128 back to 64; a SwiGLU 96 wide, tied head) with the norms, rope_theta 1e6 and epsilon 1e-6.
// The norms' gains start at one (as transformers initialises them): their gradients are checked
// at the first step, the gains away from one by the AdamW steps after. Same tolerances as
// llama_reference_test.cc.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/qwen3_reference_golden.safetensors";

TEST(Qwen3Reference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_qwen3(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh qwen3");
}

TEST(Qwen3Reference, LossAndGradientsMatchTransformers) {
  testing::ReferenceRun r(testing::reference_qwen3(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  // wte, eight per block (q_norm's and k_norm's among them), ln_f.
  EXPECT_EQ(checked, 1 + 8 * 2 + 1);
}

TEST(Qwen3Reference, FiveAdamWStepsMatchTransformers) {
  testing::ReferenceRun(testing::reference_qwen3(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
