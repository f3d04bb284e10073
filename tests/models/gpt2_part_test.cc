// Model parts (pipeline stages): a GPT-2 cut into parts and run part after part computes the
// whole model's loss bit for bit and its gradients to rounding (micro-batches accumulate in
// another order), also with two micro-batches in flight (stash/unstash), which is how pipeline
// schedules run it.
#include <gtest/gtest.h>

#include <cmath>

#include "models/gpt2.h"
#include "tensor/rng.h"

namespace loom {
namespace {

Gpt2Config config() {
  Gpt2Config c;
  c.vocab_size = 64;
  c.max_seq_len = 8;
  c.d_model = 16;
  c.n_layers = 3;
  c.n_heads = 2;
  return c;
}

Tensor random_tokens(uint64_t seed) {
  Tensor t = Tensor::empty({2, 8}, DType::kI32);
  RandomStream rng(seed, "tokens");
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 64);
  return t;
}

void expect_same_grads(Gpt2& whole, const std::vector<Gpt2*>& parts) {
  for (const auto& p : whole.params().parameters()) {
    // wte lives in the first and the last part: the whole model's gradient is their sum.
    std::vector<float> sum(static_cast<size_t>(p->numel()), 0.0f);
    int found = 0;
    for (Gpt2* part : parts) {
      Parameter* q = part->params().find(p->name);
      if (q == nullptr) continue;
      ++found;
      for (int64_t i = 0; i < p->numel(); ++i) sum[static_cast<size_t>(i)] += q->grad.data<float>()[i];
    }
    ASSERT_GE(found, 1) << p->name;
    double scale = 0;
    for (int64_t i = 0; i < p->numel(); ++i) scale = std::max(scale, std::abs(double{p->grad.data<float>()[i]}));
    for (int64_t i = 0; i < p->numel(); ++i)
      ASSERT_NEAR(sum[static_cast<size_t>(i)], p->grad.data<float>()[i], 1e-5 * scale)
          << p->name << "[" << i << "]";
  }
}

TEST(Gpt2Part, PartsChainedEqualTheWholeModelWithMicroBatchesInFlight) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 whole(config());
  whole.build(DType::kF32, Device::cpu(), 3);
  Gpt2 first(config(), Gpt2Part{0, 1, true, false});
  Gpt2 middle(config(), Gpt2Part{1, 2, false, false});
  Gpt2 last(config(), Gpt2Part{2, 3, false, true});
  for (Gpt2* part : {&first, &middle, &last}) part->build(DType::kF32, Device::cpu(), 3);
  EXPECT_EQ(first.params().find("ln_f.weight"), nullptr);
  EXPECT_NE(last.params().find("wte.weight"), nullptr);
  EXPECT_EQ(last.params().find("wpe.weight"), nullptr);

  const Tensor tokens[2] = {random_tokens(1), random_tokens(2)};
  const Tensor targets[2] = {random_tokens(3), random_tokens(4)};
  double whole_loss[2];
  for (int m = 0; m < 2; ++m) {
    whole_loss[m] = whole.forward(ctx, tokens[m], targets[m]);
    whole.backward(ctx, 0.5);
  }
  // Both micro-batches forward, then both backward (GPipe order), stashing activations.
  std::vector<Tensor> stash[3][2];
  for (int m = 0; m < 2; ++m) {
    double loss = 0;
    Tensor x = first.forward_part(ctx, tokens[m], Tensor(), nullptr);
    stash[0][m] = first.stash_activations();
    x = middle.forward_part(ctx, x, Tensor(), nullptr);
    stash[1][m] = middle.stash_activations();
    EXPECT_FALSE(last.forward_part(ctx, x, targets[m], &loss).defined());
    stash[2][m] = last.stash_activations();
    EXPECT_EQ(loss, whole_loss[m]);
  }
  for (int m = 1; m >= 0; --m) {
    last.unstash_activations(std::move(stash[2][m]));
    Tensor dx = last.backward_part(ctx, Tensor(), 0.5);
    middle.unstash_activations(std::move(stash[1][m]));
    dx = middle.backward_part(ctx, dx, 0.5);
    first.unstash_activations(std::move(stash[0][m]));
    EXPECT_FALSE(first.backward_part(ctx, dx, 0.5).defined());
  }
  expect_same_grads(whole, {&first, &middle, &last});
}

}  // namespace
}  // namespace loom
