// Loom's Llama with Gemma 3's parts — sandwich norms (model.norm_placement = "sandwich"), GeGLU
// (model.ffn_activation = "gelu_tanh"), per-head query/key norms on heads 32 wide, the embedding
// times √64 (model.embedding_multiplier), a window of 8 positions in block 0 turned by a rotary
// base of 10 000 (model.rope_local_theta) and block 1 whole turned by 1e6 — against HuggingFace
// transformers' Gemma3ForCausalLM: tests/data/gemma3_reference_golden.safetensors was written by
// tools/hf_llama_reference.py (tools/make_golden.sh gemma3, transformers 4.51.3) from the same
// initial weights and batch, which Loom regenerates here from seed 1234 (its gains of one loaded
// there as Gemma's w = 0: Gemma's RMSNorm scales by 1 + w, so the gradients are the same and so
// are AdamW's steps). Same tolerances as llama_reference_test.cc.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/gemma3_reference_golden.safetensors";

TEST(Gemma3Reference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_gemma3(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh gemma3");
}

TEST(Gemma3Reference, LossAndGradientsMatchTransformers) {
  testing::ReferenceRun r(testing::reference_gemma3(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  // wte; ten per block (four norms, q_norm and k_norm among them); ln_f.
  EXPECT_EQ(checked, 1 + 10 * 2 + 1);
}

TEST(Gemma3Reference, FiveAdamWStepsMatchTransformers) {
  testing::ReferenceRun(testing::reference_gemma3(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
