// The single-device equivalence on a GPU: a small GPT-2 trained for a few steps (forward,
// backward, clipping, AdamW) on GPU 0 computes the CPU's run — the same initial weights bit for
// bit, the same first gradients to fp32 rounding, the same losses step after step — and a second
// GPU run repeats the first bit for bit. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels/kernel_test_util.h"
#include "base/thread_pool.h"
#include "harness/devices.h"
#include "kernels/ops.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "tensor/rng.h"

namespace loom {
namespace {

Gpt2Config small_config(int64_t n_heads) {
  Gpt2Config c;
  c.vocab_size = 97;
  c.max_seq_len = 32;
  c.d_model = 64;
  c.n_layers = 2;
  c.n_heads = n_heads;
  c.init_std = 0.05f;
  return c;
}

struct TrainRun {
  std::vector<float> initial_values;
  std::vector<float> first_grads;
  std::vector<double> losses;
  std::vector<float> final_values;
};

TrainRun train(Device device, int steps, int64_t n_heads = 4) {
  constexpr int64_t B = 4, T = 32;
  ThreadPool pool(2);
  Context ctx{&pool, device, DType::kF32};
  Gpt2 model(small_config(n_heads));
  model.build(DType::kF32, device, 11);
  AdamW opt(model.params(), AdamWConfig{});
  TrainRun run;
  run.initial_values = model.params().values().to_vector();
  for (int step = 0; step < steps; ++step) {
    Tensor tokens = Tensor::empty({B, T}, DType::kI32),
           targets = Tensor::empty({B, T}, DType::kI32);
    RandomStream rng(100 + static_cast<uint64_t>(step), "gpt2_cuda_test.batch");
    for (int64_t i = 0; i < B * T; ++i) {
      tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 97);
      targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 97);
    }
    model.params().zero_grads();
    run.losses.push_back(model.forward(ctx, tokens.to(device), targets.to(device)));
    model.backward(ctx);
    if (step == 0) run.first_grads = model.params().grads().to_vector();
    const float scale = clip_coefficient(grad_norm(pool, model.params()), 1.0);
    opt.step(pool, 1e-3f, scale);
  }
  run.final_values = model.params().values().to_vector();
  return run;
}

TEST(Gpt2Cuda, TrainingOnTheGpuMatchesTheCpu) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  constexpr int kSteps = 5;
  const TrainRun on_cpu = train(Device::cpu(), kSteps);
  const TrainRun on_gpu = train(Device::cuda(0), kSteps);

  EXPECT_TRUE(cpu::ktest::bitwise_equal(on_gpu.initial_values, on_cpu.initial_values))
      << "a parameter initialised differently on the GPU";
  cpu::ktest::expect_close("first gradients", on_gpu.first_grads, on_cpu.first_grads, 1e-5);
  ASSERT_EQ(on_gpu.losses.size(), on_cpu.losses.size());
  for (size_t s = 0; s < on_cpu.losses.size(); ++s)
    EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-5 * std::abs(on_cpu.losses[s]))
        << "step " << s;
  // Adam's update is ~lr·sign(g) for small g, so a gradient that rounds to another sign moves a
  // weight by up to 2·lr per step: compare the weights to that bound, the losses above closely.
  cpu::ktest::expect_close("weights after training", on_gpu.final_values, on_cpu.final_values,
                           2e-3 * kSteps);
}

// bf16 GEMM inputs (fp32 weights, accumulation and everything else): the losses stay within 1%
// of the fp32 CPU run's over a few steps. With 4 heads of 16 attention goes through the GEMM
// path; with 1 head of 64 through the fused flash-attention kernels.
TEST(Gpt2Cuda, Bf16MatmulsStayNearTheCpuRun) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  constexpr int kSteps = 3;
  for (int64_t heads : {4, 1}) {
    const TrainRun on_cpu = train(Device::cpu(), kSteps, heads);
    ops::set_matmul_precision("bf16");
    const TrainRun on_gpu = train(Device::cuda(0), kSteps, heads);
    ops::set_matmul_precision("fp32");
    for (size_t s = 0; s < on_cpu.losses.size(); ++s)
      EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-2 * std::abs(on_cpu.losses[s]))
          << heads << " head(s), step " << s;
  }
}

TEST(Gpt2Cuda, TwoGpuRunsAreBitwiseIdentical) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  const TrainRun a = train(Device::cuda(0), 3);
  const TrainRun b = train(Device::cuda(0), 3);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s)
    EXPECT_EQ(std::memcmp(&a.losses[s], &b.losses[s], sizeof(double)), 0) << "step " << s;
  EXPECT_TRUE(cpu::ktest::bitwise_equal(a.final_values, b.final_values));
}

}  // namespace
}  // namespace loom
