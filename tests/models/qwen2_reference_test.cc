// Loom's Llama with biases on its queries, keys and values (model.qkv_bias) against HuggingFace
// transformers' Qwen2ForCausalLM: tests/data/qwen2_reference_golden.safetensors was written by
// tools/hf_llama_reference.py (tools/make_golden.sh qwen2) from the same initial weights and batch,
// which Loom regenerates here from seed 1234: the reference Llama (4 query heads sharing 2
// key/value heads, a SwiGLU 96 wide, tied head) with the biases, rope_theta 1e6 and RMSNorm's
// epsilon 1e-6, as Qwen 2.5's. The biases start at zero (as transformers initialises them), so
// their gradients are checked at the first step and the biased forward by the AdamW steps after.
// Same tolerances as llama_reference_test.cc.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/qwen2_reference_golden.safetensors";

TEST(Qwen2Reference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_qwen2(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh qwen2");
}

TEST(Qwen2Reference, LossAndGradientsMatchTransformers) {
  testing::ReferenceRun r(testing::reference_qwen2(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  // wte, seven per block (qkv's bias among them, its golden gradient not zero), ln_f.
  EXPECT_EQ(checked, 1 + 7 * 2 + 1);
}

TEST(Qwen2Reference, FiveAdamWStepsMatchTransformers) {
  testing::ReferenceRun(testing::reference_qwen2(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
