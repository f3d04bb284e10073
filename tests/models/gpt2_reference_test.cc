// Loom's GPT-2 against PyTorch: tests/data/gpt2_reference_golden.safetensors was written by
// tools/torch_reference.py (see tools/README.md) from the same initial weights and batch, which
// Loom regenerates here from seed 1234. Loss within 1e-5 relative; every gradient within 1e-4
// relative to the largest magnitude of that gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include "reference_check.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/gpt2_reference_golden.safetensors";

TEST(Gpt2Reference, InitialisationMatchesTheGoldenInputs) {
  testing::ReferenceRun(testing::reference_gpt2(), kGolden)
      .expect_initialisation_matches("tools/make_golden.sh");
}

TEST(Gpt2Reference, LossAndGradientsMatchPyTorch) {
  testing::ReferenceRun r(testing::reference_gpt2(), kGolden);
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "torch");
  EXPECT_EQ(checked, 2 + 12 * 2 + 2);
}

TEST(Gpt2Reference, FiveAdamWStepsMatchPyTorch) {
  testing::ReferenceRun(testing::reference_gpt2(), kGolden).expect_adamw_steps_match();
}

}  // namespace
}  // namespace loom
