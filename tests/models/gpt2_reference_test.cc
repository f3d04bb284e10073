// Loom's GPT-2 against PyTorch: tests/data/gpt2_reference_golden.safetensors was written by
// tools/torch_reference.py (see tools/README.md) from the same initial weights and batch, which
// Loom regenerates here from seed 1234. Loss within 1e-5 relative; every gradient within 1e-4
// relative to the largest magnitude of that gradient tensor; five AdamW steps' losses within 1e-4.
#include <gtest/gtest.h>

#include <cmath>

#include "checkpoint/safetensors.h"
#include "reference_check.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "tensor/rng.h"

namespace loom {
namespace {

constexpr const char* kGolden = LOOM_SOURCE_DIR "/tests/data/gpt2_reference_golden.safetensors";

struct Reference {
  ThreadPool pool{2};
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model{[] {
    Gpt2Config c;
    c.vocab_size = 256;
    c.max_seq_len = 32;
    c.d_model = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    return c;
  }()};
  Tensor tokens = Tensor::empty({4, 32}, DType::kI32);
  Tensor targets = Tensor::empty({4, 32}, DType::kI32);
  SafetensorsFile golden = load_safetensors(kGolden);

  Reference() {
    model.build(DType::kF32, Device::cpu(), 1234);
    // The same batch as tools/export_reference.cc: (4, 33) tokens; inputs [:, :-1], targets [:, 1:].
    testing::fill_reference_batch(tokens, targets);
  }
  double scalar(const std::string& name, int i = 0) {
    return golden.tensors.at(name).data<double>()[i];
  }
};

TEST(Gpt2Reference, InitialisationMatchesTheGoldenInputs) {
  Reference r;
  double sumsq = 0;
  for (float v : r.model.params().values().to_vector()) sumsq += double(v) * v;
  EXPECT_NEAR(sumsq, r.scalar("init_sumsq"), 1e-9 * sumsq)
      << "the initialisation changed: regenerate the golden file with tools/make_golden.sh";
}

TEST(Gpt2Reference, LossAndGradientsMatchPyTorch) {
  Reference r;
  const double loss = r.model.forward(r.ctx, r.tokens, r.targets);
  EXPECT_NEAR(loss, r.scalar("loss"), 1e-5 * r.scalar("loss"));
  r.model.backward(r.ctx);
  const int checked = testing::expect_gradients_match(r.model, r.golden, "torch");
  EXPECT_EQ(checked, 2 + 12 * 2 + 2);
}

TEST(Gpt2Reference, FiveAdamWStepsMatchPyTorch) {
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
