// Loom's Llama against HuggingFace transformers' LlamaForCausalLM:
// tests/data/llama_reference_golden.safetensors was written by tools/hf_llama_reference.py (see
// tools/README.md) from the same initial weights and batch, which Loom regenerates here from seed
// 1234: 4 query heads sharing 2 key/value heads, a SwiGLU 96 wide, rope_theta 10000, tied head.
// Loss within 1e-5 relative; every gradient within 1e-4 relative to the largest magnitude of that
// gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/llama_reference_golden.safetensors";

TEST(LlamaReference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_llama(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh llama");
}

TEST(LlamaReference, LossAndGradientsMatchTransformers) {
  testing::ReferenceRun r(testing::reference_llama(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  EXPECT_EQ(checked, 1 + 6 * 2 + 1);  // wte, six per block, ln_f
}

TEST(LlamaReference, FiveAdamWStepsMatchTransformers) {
  testing::ReferenceRun(testing::reference_llama(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
