// Loom's mixture of experts against HuggingFace transformers' MixtralForCausalLM:
// tests/data/moe_reference_golden.safetensors was written by tools/hf_mixtral_reference.py (see
// tools/README.md) from the same initial weights and batch, which Loom regenerates here from seed
// 1234: the reference Llama (4 query heads sharing 2 key/value heads, tied head) with 4 SwiGLU
// experts 48 wide in each block, top 2, and the sequence-wise balance loss at 0.05 (computed by
// the script from Mixtral's router logits, autograd giving its gradient). Cross-entropy within
// 1e-5 relative, the balance loss within 1e-6; every gradient (of both) within 1e-4 relative to
// the largest magnitude of that gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include <cmath>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/moe_reference_golden.safetensors";

TEST(MoeReference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_moe(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh moe");
}

TEST(MoeReference, LossBalanceLossAndGradientsMatchTransformersMixtral) {
  testing::ReferenceRun r(testing::reference_moe(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  EXPECT_NEAR(r.model.aux_loss(), r.scalar("aux_loss"), 1e-6);
  EXPECT_GT(r.model.aux_loss(), 0.05 * 2);  // 2 blocks, each at least 1 × the coefficient
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "transformers");
  EXPECT_EQ(checked,
            1 + (5 + 2 * 4) * 2 + 1);  // wte; norms, qkv, proj, router, 4 experts' two; ln_f
}

TEST(MoeReference, FiveAdamWStepsMatchTransformersMixtral) {
  testing::ReferenceRun(testing::reference_moe(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
