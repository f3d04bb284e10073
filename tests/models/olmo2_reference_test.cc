// Loom's Llama with OLMo 2's reordered norms (model.norm_placement = "post": each block's two
// RMSNorms on the attention's and the MLP's outputs, before the skip connections add them) and
// its query/key norms over all the heads (model.qk_norm = true, model.qk_norm_scope = "full")
// against HuggingFace transformers' Olmo2ForCausalLM: tests/data/olmo2_reference_golden.safetensors
// was written by tools/hf_llama_reference.py (tools/make_golden.sh olmo2, transformers 4.51.3)
// from the same initial weights and batch, which Loom regenerates here from seed 1234: the
// reference Llama (4 query heads sharing 2 key/value heads of 16, a SwiGLU 96 wide, tied head) with
// those norms — q_norm 64 wide, k_norm 32 —, rope_theta 500000 and epsilon 1e-6. The gains start
// at one (as transformers initialises them): their gradients are checked at the first step, the
// gains away from one by the AdamW steps after. Same tolerances as llama_reference_test.cc.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/olmo2_reference_golden.safetensors";

TEST(Olmo2Reference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_olmo2(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh olmo2");
}

TEST(Olmo2Reference, LossAndGradientsMatchTransformers) {
  testing::ReferenceRun r(testing::reference_olmo2(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  // wte, eight per block (the post-norms' and the q_norm's and k_norm's among them), ln_f.
  EXPECT_EQ(checked, 1 + 8 * 2 + 1);
}

TEST(Olmo2Reference, FiveAdamWStepsMatchTransformers) {
  testing::ReferenceRun(testing::reference_olmo2(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
