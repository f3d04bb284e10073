// The single-device equivalence on a GPU: a small GPT-2 trained for a few steps (forward,
// backward, clipping, AdamW) on GPU 0 computes the CPU's run — the same initial weights bit for
// bit, the same first gradients to fp32 rounding, the same losses step after step — and a second
// GPU run repeats the first bit for bit. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../kernels/kernel_test_util.h"
#include "base/error.h"
#include "base/thread_pool.h"
#include "harness/devices.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/ops.h"
#include "models/gpt2.h"
#include "nn/causal_self_attention.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/rms_norm.h"
#include "nn/rounded_weights.h"
#include "nn/swiglu_mlp.h"
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

// Llama's form (RMSNorm, rotary attention, SwiGLU, no biases, no position table) with
// grouped-query attention: 4 query heads sharing 2 key/value heads, of `head_dim` each (16: the
// attention's GEMM path; 64: at bf16 the flash kernels).
Gpt2Config small_llama(int64_t head_dim, bool tie_embeddings = true) {
  Gpt2Config c = small_config(4);
  c.arch = Arch::kLlama;
  c.d_model = 4 * head_dim;
  c.n_kv_heads = 2;
  c.ffn_hidden = 3 * c.d_model / 2 + 8;  // a multiple of 8 apart from 4·d_model
  c.rope_theta = 500.0;                  // turns that differ visibly over 32 positions
  c.tie_embeddings = tie_embeddings;
  return c;
}

// A tensor of `shape` on `device`, uniform in [-scale, scale) from stream `seed`.
Tensor uniform_on(Device device, const Shape& shape, uint64_t seed, float scale) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  RandomStream rng(seed, "gpt2_cuda_test");
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] = (rng.next_uniform() * 2.0f - 1.0f) * scale;
  return t.to(device);
}

struct TrainRun {
  std::vector<float> initial_values;
  std::vector<float> first_grads;
  std::vector<double> losses;
  std::vector<float> final_values;
};

TrainRun train(Device device, int steps, const Gpt2Config& config) {
  constexpr int64_t B = 4, T = 32;
  ThreadPool pool(2);
  Context ctx{&pool, device, DType::kF32};
  Gpt2 model(config);
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

TrainRun train(Device device, int steps, int64_t n_heads = 4) {
  return train(device, steps, small_config(n_heads));
}

// The fp32 GPU run against the CPU's: the same initial weights bit for bit, the first gradients
// to fp32 rounding, the losses step after step, the weights within Adam's sign-flip bound.
void expect_gpu_run_matches_cpu(const Gpt2Config& config, int steps) {
  const TrainRun on_cpu = train(Device::cpu(), steps, config);
  const TrainRun on_gpu = train(Device::cuda(0), steps, config);
  EXPECT_TRUE(cpu::ktest::bitwise_equal(on_gpu.initial_values, on_cpu.initial_values))
      << "a parameter initialised differently on the GPU";
  cpu::ktest::expect_close("first gradients", on_gpu.first_grads, on_cpu.first_grads, 1e-5);
  ASSERT_EQ(on_gpu.losses.size(), on_cpu.losses.size());
  for (size_t s = 0; s < on_cpu.losses.size(); ++s)
    EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-5 * std::abs(on_cpu.losses[s]))
        << "step " << s;
  // The run trained (a model whose backward did nothing would match too): Adam moved the
  // weights by ~lr a step.
  double moved = 0;
  for (size_t i = 0; i < on_gpu.final_values.size(); ++i)
    moved = std::max(moved, std::abs(static_cast<double>(on_gpu.final_values[i]) -
                                     on_gpu.initial_values[i]));
  EXPECT_GT(moved, 0.5e-3 * steps);
  cpu::ktest::expect_close("weights after training", on_gpu.final_values, on_cpu.final_values,
                           2e-3 * steps);
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

// At bf16 / fp16 matmul precision a Linear on a GPU keeps its input as the GEMMs read it, rounded
// once to 16 bits (half the bytes, no second cast in the backward): its output and gradients are
// bit for bit what the plain matmul ops give with the fp32 input rounded inside each GEMM. At
// fp32 the input is kept as it came; a precision changed between forward and backward is refused.
// A LayerNorm before it may write that rounded input itself.
// Where the flash kernels read it (bf16, head size 64) the attention's qkv projection writes
// and keeps qkv in bf16, and in the backward the attention projection writes dO in bf16: forward
// and backward compute what the ops do from those roundings; with heads of 32, or at fp16, qkv
// stays fp32.
TEST(Gpt2Cuda, AttentionKeepsQkvInBf16WhereTheFlashKernelsReadIt) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  const Device gpu = Device::cuda(0);
  constexpr int64_t B = 2, T = 9;
  ThreadPool pool(1);
  Context ctx{&pool, gpu, DType::kF32};
  struct Case {
    const char* precision;
    int64_t C, NH;
    DType qkv;
  };
  for (const Case& k : {Case{"bf16", 128, 2, DType::kBF16}, Case{"bf16", 96, 3, DType::kF32},
                        Case{"fp16", 128, 2, DType::kF32}}) {
    SCOPED_TRACE(std::string(k.precision) + " C=" + std::to_string(k.C));
    ops::set_matmul_precision(k.precision);
    ParameterStore store;
    CausalSelfAttention attn(store, "attn", k.C, k.NH, 0.3f, 0.3f);
    store.allocate(DType::kF32, gpu);
    store.initialize(6);
    const Tensor x = uniform_on(gpu, {B, T, k.C}, 3, 1.0f);
    const Tensor y = attn.forward(ctx, x);
    std::vector<Tensor*> cache;
    attn.collect_cache(cache);
    // qkv's and proj's inputs, qkv, the gathered keys and values (context parallelism; none
    // here), the attention output, lse, the documents (document masking; none here)
    ASSERT_EQ(cache.size(), 7u);
    EXPECT_FALSE(cache[3]->defined());
    EXPECT_FALSE(cache[6]->defined());
    EXPECT_EQ(cache[2]->dtype(), k.qkv);
    if (k.qkv != DType::kBF16) continue;
    // The ops: the qkv projection rounded to bf16 (bias too), the attention on it, proj.
    const Exec ex = ctx.exec();
    const Parameter& wq = *store.find("attn.qkv.weight");
    const Parameter& bq = *store.find("attn.qkv.bias");
    const Parameter& wp = *store.find("attn.proj.weight");
    const Parameter& bp = *store.find("attn.proj.bias");
    const int64_t N = B * T;
    Tensor x16 = Tensor::empty({N, k.C}, DType::kBF16, gpu),
           qkv = Tensor::empty({N, 3 * k.C}, DType::kBF16, gpu),
           att = Tensor::empty({N, k.C}, DType::kBF16, gpu),
           lse = Tensor::empty({B, k.NH, T}, DType::kF32, gpu),
           y_ops = Tensor::empty({N, k.C}, DType::kF32, gpu);
    ops::matmul_forward_rounded_output(ex, qkv.raw(), DType::kBF16, x.raw(), DType::kF32, x16.raw(),
                                       wq.value.data<float>(), bq.value.data<float>(), N, k.C,
                                       3 * k.C);
    ops::attention_forward_rounded(ex, att.raw(), DType::kBF16, lse.data<float>(), qkv.raw(),
                                   DType::kBF16, B, T, k.C, k.NH);
    ops::matmul_forward_from_rounded_input(ex, y_ops.data<float>(), att.raw(), DType::kBF16,
                                           wp.value.data<float>(), bp.value.data<float>(), N, k.C,
                                           k.C);
    EXPECT_TRUE(cpu::ktest::bitwise_equal(y.to_vector(), y_ops.to_vector())) << "out";

    // The backward: proj writes dO in bf16, which the flash kernels read as they read qkv.
    const Tensor dy = uniform_on(gpu, {B, T, k.C}, 4, 1.0f);
    store.zero_grads();
    const Tensor dx = attn.backward(ctx, dy);
    const std::vector<float> grads[] = {wq.grad.to_vector(), bq.grad.to_vector(),
                                        wp.grad.to_vector(), bp.grad.to_vector()};
    store.zero_grads();
    Tensor datt = Tensor::empty({N, k.C}, DType::kBF16, gpu),
           dqkv = Tensor::empty({N, 3 * k.C}, DType::kBF16, gpu),
           dx_ops = Tensor::empty({N, k.C}, DType::kF32, gpu);
    ops::matmul_backward_rounded_dinp(ex, datt.raw(), DType::kBF16, wp.grad.data<float>(),
                                      bp.grad.data<float>(), dy.data<float>(), att.raw(),
                                      DType::kBF16, wp.value.data<float>(), N, k.C, k.C);
    ops::attention_backward_rounded(ex, dqkv.raw(), datt.raw(), DType::kBF16, qkv.raw(),
                                    DType::kBF16, att.raw(), DType::kBF16, lse.data<float>(), B, T,
                                    k.C, k.NH);
    ops::matmul_backward_from_rounded(ex, dx_ops.data<float>(), wq.grad.data<float>(),
                                      bq.grad.data<float>(), dqkv.raw(), DType::kBF16, x16.raw(),
                                      DType::kBF16, wq.value.data<float>(), N, k.C, 3 * k.C);
    using cpu::ktest::bitwise_equal;
    EXPECT_TRUE(bitwise_equal(dx.to_vector(), dx_ops.to_vector())) << "dinp";
    EXPECT_TRUE(bitwise_equal(grads[0], wq.grad.to_vector())) << "qkv.weight";
    EXPECT_TRUE(bitwise_equal(grads[1], bq.grad.to_vector())) << "qkv.bias";
    EXPECT_TRUE(bitwise_equal(grads[2], wp.grad.to_vector())) << "proj.weight";
    EXPECT_TRUE(bitwise_equal(grads[3], bp.grad.to_vector())) << "proj.bias";
  }
}

TEST(Gpt2Cuda, LinearKeepsItsInputRoundedAndComputesWhatTheOpsDo) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  const Device gpu = Device::cuda(0);
  constexpr int64_t N = 24, C = 40, OC = 56;
  ThreadPool pool(1);
  Context ctx{&pool, gpu, DType::kF32};
  ParameterStore store;
  Linear linear(store, "lin", C, OC, true, 0.3f);
  LayerNorm norm(store, "norm", C);
  store.allocate(DType::kF32, gpu);
  store.initialize(5);
  const Tensor x = uniform_on(gpu, {N, C}, 1, 1.0f);
  const Tensor dy = uniform_on(gpu, {N, OC}, 2, 1.0f);
  const Parameter& w = *linear.weight();
  const Parameter& b = *linear.bias();
  const Exec ex = ctx.exec();
  for (const char* precision : {"bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    ops::set_matmul_precision(precision);
    store.zero_grads();
    const Tensor y = linear.forward(ctx, x);
    std::vector<Tensor*> cache;
    linear.collect_cache(cache);
    ASSERT_EQ(cache.size(), 1u);
    EXPECT_EQ(cache[0]->dtype(), std::string(precision) == "bf16" ? DType::kBF16 : DType::kF16);
    EXPECT_EQ(cache[0]->numel(), N * C);
    const Tensor dx = linear.backward(ctx, dy);
    const std::vector<float> dw = w.grad.to_vector(), db = b.grad.to_vector();

    // The plain ops on the fp32 input.
    store.zero_grads();
    Tensor y_ops = Tensor::empty({N, OC}, DType::kF32, gpu),
           dx_ops = Tensor::empty({N, C}, DType::kF32, gpu);
    ops::matmul_forward<float>(ex, y_ops.data<float>(), x.data<float>(), w.value.data<float>(),
                               b.value.data<float>(), N, C, OC);
    ops::matmul_backward<float>(ex, dx_ops.data<float>(), w.grad.data<float>(),
                                b.grad.data<float>(), dy.data<float>(), x.data<float>(),
                                w.value.data<float>(), N, C, OC);
    using cpu::ktest::bitwise_equal;
    EXPECT_TRUE(bitwise_equal(y.to_vector(), y_ops.to_vector())) << "out";
    EXPECT_TRUE(bitwise_equal(dx.to_vector(), dx_ops.to_vector())) << "dinp";
    EXPECT_TRUE(bitwise_equal(dw, w.grad.to_vector())) << "dweight";
    EXPECT_TRUE(bitwise_equal(db, b.grad.to_vector())) << "dbias";
  }
  // Given its input already rounded by the LayerNorm before it (forward_for_matmul): the same
  // as given that LayerNorm's fp32 output.
  ops::set_matmul_precision("bf16");
  store.zero_grads();
  const Tensor y_a = linear.forward(ctx, norm.forward(ctx, x));
  const Tensor dx_a = linear.backward(ctx, dy);
  const std::vector<float> dw_a = w.grad.to_vector();
  store.zero_grads();
  const Tensor normed = norm.forward_for_matmul(ctx, x);
  EXPECT_EQ(normed.dtype(), DType::kBF16);
  const Tensor y_b = linear.forward(ctx, normed);
  const Tensor dx_b = linear.backward(ctx, dy);
  EXPECT_TRUE(cpu::ktest::bitwise_equal(y_a.to_vector(), y_b.to_vector())) << "out";
  EXPECT_TRUE(cpu::ktest::bitwise_equal(dx_a.to_vector(), dx_b.to_vector())) << "dinp";
  EXPECT_TRUE(cpu::ktest::bitwise_equal(dw_a, w.grad.to_vector())) << "dweight";

  (void)linear.forward(ctx, x);
  ops::set_matmul_precision("fp16");
  try {
    (void)linear.backward(ctx, dy);
    FAIL() << "an input rounded to bf16 was used at fp16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was rounded for bf16"), std::string::npos) << e.what();
  }
  ops::set_matmul_precision("fp32");
  (void)linear.forward(ctx, x);
  std::vector<Tensor*> cache;
  linear.collect_cache(cache);
  EXPECT_EQ(cache[0]->raw(), x.raw()) << "kept as it came at fp32";
}

// The MLP computes what its ops do one after another, bit for bit, at every matmul precision,
// also with the GELU output dropped and rebuilt (selective recomputation). At fp32 / TF32 its
// backward folds the GELU's into fc's (Linear::backward_before_gelu); at bf16 / fp16 the GELU runs
// in the GEMMs' epilogues (Linear::forward_gelu, backward_into_gelu: ops::matmul_forward_gelu,
// matmul_backward_into_gelu), with the GELU's input kept in 16 bits, and the rebuilt GELU output
// is the GELU of that 16-bit input (ops::gelu_forward_of_rounded).
TEST(Gpt2Cuda, MlpComputesWhatItsOpsDoAtEveryPrecision) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  const Device gpu = Device::cuda(0);
  constexpr int64_t N = 40, C = 24, H = 4 * C;
  ThreadPool pool(1);
  Context ctx{&pool, gpu, DType::kF32};
  ParameterStore store;
  Mlp mlp(store, "mlp", C, 0.3f, 0.2f);
  store.allocate(DType::kF32, gpu);
  store.initialize(6);
  const Tensor x = uniform_on(gpu, {N, C}, 3, 2.0f);
  const Tensor dy = uniform_on(gpu, {N, C}, 4, 2.0f);
  const Parameter& fc_w = store.get("mlp.fc.weight");
  const Parameter& fc_b = store.get("mlp.fc.bias");
  const Parameter& proj_w = store.get("mlp.proj.weight");
  const Parameter& proj_b = store.get("mlp.proj.bias");
  const Exec ex = ctx.exec();
  using cpu::ktest::bitwise_equal;
  for (const char* precision : {"fp32", "tf32", "bf16", "fp16"}) {
    for (const bool recompute : {false, true}) {
      SCOPED_TRACE(std::string(precision) + (recompute ? ", GELU output rebuilt" : ""));
      ops::set_matmul_precision(precision);
      store.zero_grads();
      const Tensor y = mlp.forward(ctx, x);
      if (recompute) {
        mlp.drop_recomputable();
        mlp.restore_input(x);
      }
      const Tensor dx = mlp.backward(ctx, dy);
      const std::vector<float> grads[] = {fc_w.grad.to_vector(), fc_b.grad.to_vector(),
                                          proj_w.grad.to_vector(), proj_b.grad.to_vector()};

      store.zero_grads();
      Tensor y_ops = Tensor::empty({N, C}, DType::kF32, gpu),
             dx_ops = Tensor::empty({N, C}, DType::kF32, gpu);
      const DType half = ops::matmul_input_dtype(ex, DType::kF32);
      if (half == DType::kF32) {
        Tensor h = Tensor::empty({N, H}, DType::kF32, gpu),
               g = Tensor::empty({N, H}, DType::kF32, gpu),
               dg = Tensor::empty({N, H}, DType::kF32, gpu);
        ops::matmul_forward<float>(ex, h.data<float>(), x.data<float>(), fc_w.value.data<float>(),
                                   fc_b.value.data<float>(), N, C, H);
        ops::gelu_forward<float>(ex, g.data<float>(), h.data<float>(), N * H);
        ops::matmul_forward<float>(ex, y_ops.data<float>(), g.data<float>(),
                                   proj_w.value.data<float>(), proj_b.value.data<float>(), N, H, C);
        ops::matmul_backward<float>(ex, dg.data<float>(), proj_w.grad.data<float>(),
                                    proj_b.grad.data<float>(), dy.data<float>(), g.data<float>(),
                                    proj_w.value.data<float>(), N, H, C);
        ops::gelu_backward<float>(ex, dg.data<float>(), h.data<float>(), dg.data<float>(), N * H);
        ops::matmul_backward<float>(ex, dx_ops.data<float>(), fc_w.grad.data<float>(),
                                    fc_b.grad.data<float>(), dg.data<float>(), x.data<float>(),
                                    fc_w.value.data<float>(), N, C, H);
      } else {
        Tensor x16 = Tensor::empty({N, C}, half, gpu), pre = Tensor::empty({N, H}, half, gpu),
               g = Tensor::empty({N, H}, half, gpu), dpre = Tensor::empty({N, H}, half, gpu);
        ops::matmul_forward_gelu(ex, g.raw(), pre.raw(), half, x.raw(), DType::kF32, x16.raw(),
                                 fc_w.value.data<float>(), fc_b.value.data<float>(), N, C, H);
        ops::matmul_forward_from_rounded_input(ex, y_ops.data<float>(), g.raw(), half,
                                               proj_w.value.data<float>(),
                                               proj_b.value.data<float>(), N, H, C);
        if (recompute) ops::gelu_forward_of_rounded(ex, g.raw(), pre.raw(), half, N * H);
        ops::matmul_backward_into_gelu(ex, dpre.raw(), half, proj_w.grad.data<float>(),
                                       proj_b.grad.data<float>(), dy.data<float>(), g.raw(),
                                       proj_w.value.data<float>(), pre.raw(), N, H, C);
        // A recomputation restored fc's input as it came (f32); else fc kept its rounding.
        ops::matmul_backward_from_rounded(
            ex, dx_ops.data<float>(), fc_w.grad.data<float>(), fc_b.grad.data<float>(), dpre.raw(),
            half, recompute ? x.raw() : x16.raw(), recompute ? DType::kF32 : half,
            fc_w.value.data<float>(), N, C, H);
      }
      EXPECT_TRUE(bitwise_equal(y.to_vector(), y_ops.to_vector())) << "out";
      EXPECT_TRUE(bitwise_equal(dx.to_vector(), dx_ops.to_vector())) << "dinp";
      EXPECT_TRUE(bitwise_equal(grads[0], fc_w.grad.to_vector())) << "fc.weight";
      EXPECT_TRUE(bitwise_equal(grads[1], fc_b.grad.to_vector())) << "fc.bias";
      EXPECT_TRUE(bitwise_equal(grads[2], proj_w.grad.to_vector())) << "proj.weight";
      EXPECT_TRUE(bitwise_equal(grads[3], proj_b.grad.to_vector())) << "proj.bias";
    }
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

// The weights' 16-bit copies (nn/rounded_weights.h): steps of two micro-batches each, the
// GEMMs reading each weight four times a step, train the same bits as GEMMs that cast the fp32
// weights themselves — GPT-2 on the flash kernels (qkv written in bf16), a Llama with its own LM
// head at fp16 on the attention's GEMM path — each weight copied once a step; and copies not made
// again after the optimizer step (stale) train something else, which this comparison would see.
TEST(Gpt2Cuda, WeightCopiesAreMadeOnceAStepAndChangeNoBit) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  enum class Copies { kNone, kFresh, kStale };
  constexpr int kSteps = 2, kMicroBatches = 2;
  constexpr int64_t B = 2, T = 32;
  struct Result {
    std::vector<double> losses;
    std::vector<float> final_values;
    int64_t roundings = 0, copied_values = 0, bytes = 0;
  };
  const auto run = [&](const Gpt2Config& config, Copies copies) {
    const Device device = Device::cuda(0);
    ThreadPool pool(2);
    Context ctx{&pool, device, DType::kF32};
    Gpt2 model(config);
    model.build(DType::kF32, device, 11);
    AdamW opt(model.params(), AdamWConfig{});
    RoundedWeights rounded(model.params(), ctx.exec());
    EXPECT_TRUE(rounded.active());
    if (copies != Copies::kNone) ctx.rounded_weights = &rounded;
    Result r;
    for (const auto& p : model.params().parameters())
      if (p->gemm_operand) r.copied_values += p->numel();
    for (int step = 0; step < kSteps; ++step) {
      model.params().zero_grads();
      for (int m = 0; m < kMicroBatches; ++m) {
        Tensor tokens = Tensor::empty({B, T}, DType::kI32),
               targets = Tensor::empty({B, T}, DType::kI32);
        RandomStream rng(200 + static_cast<uint64_t>(step * kMicroBatches + m), "copies.batch");
        for (int64_t i = 0; i < B * T; ++i) {
          tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 97);
          targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 97);
        }
        r.losses.push_back(model.forward(ctx, tokens.to(device), targets.to(device)));
        model.backward(ctx, 1.0 / kMicroBatches);
      }
      const float scale = clip_coefficient(grad_norm(pool, model.params()), 1.0);
      opt.step(pool, 1e-3f, scale);
      if (copies == Copies::kFresh) rounded.invalidate();
    }
    r.final_values = model.params().values().to_vector();
    r.roundings = rounded.roundings();
    r.bytes = rounded.bytes();
    return r;
  };
  struct Case {
    const char* name;
    Gpt2Config config;
    const char* precision;
  };
  Gpt2Config flash = small_config(1);  // one head of 64: the flash kernels at bf16
  for (const Case& c : {Case{"gpt2, flash attention", flash, "bf16"},
                        Case{"llama, own head, GEMM attention", small_llama(16, false), "fp16"}}) {
    SCOPED_TRACE(c.name);
    ops::MatmulPrecisionScope scope(c.precision);
    const Result cast = run(c.config, Copies::kNone);
    const Result copied = run(c.config, Copies::kFresh);
    const Result stale = run(c.config, Copies::kStale);
    EXPECT_EQ(cast.roundings, 0);
    ASSERT_EQ(copied.losses.size(), cast.losses.size());
    for (size_t i = 0; i < cast.losses.size(); ++i)
      EXPECT_EQ(std::memcmp(&copied.losses[i], &cast.losses[i], sizeof(double)), 0)
          << "micro-batch " << i << ": " << copied.losses[i] << " vs " << cast.losses[i];
    EXPECT_TRUE(cpu::ktest::bitwise_equal(copied.final_values, cast.final_values));
    // Every Linear's weight and the head's, once a step: 4 Linears a block (qkv, the attention's
    // projection, the MLP's two: a Llama's gate and up are one fused fc) and the head.
    const int64_t weights = 4 * c.config.n_layers + 1;
    EXPECT_EQ(copied.roundings, kSteps * weights);
    EXPECT_GE(copied.bytes, 2 * copied.copied_values);
    EXPECT_LT(copied.bytes, 2 * (copied.copied_values + 8 * weights));
    // Made once and never again: the later steps' GEMMs read the first step's weights.
    EXPECT_EQ(stale.roundings, weights);
    EXPECT_FALSE(cpu::ktest::bitwise_equal(stale.final_values, cast.final_values));
  }
}

// fp8 GEMM operands (runtime.matmul_precision = "fp8", blocks of 32): the GPU quantizes every
// Linear's operands as the CPU does and multiplies them exactly on the bf16 GEMM, so a few steps
// of GPT-2 and of a Llama train the CPU's fp8 run to fp32 rounding (a value on a rounding
// boundary may quantize the other way: 1e-3), and not the GPU's bf16 run.
TEST(Gpt2Cuda, Fp8TrainsTheCpusFp8Run) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  if (!cpu::has_avx512f()) GTEST_SKIP() << "fp8 needs AVX-512 on the CPU side";
  constexpr int kSteps = 3;
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "Llama" : "GPT-2");
    const Gpt2Config config = llama ? small_llama(16) : small_config(4);
    TrainRun on_cpu, on_gpu, bf16;
    {
      ops::MatmulPrecisionScope fp8("fp8", 32);
      on_cpu = train(Device::cpu(), kSteps, config);
      on_gpu = train(Device::cuda(0), kSteps, config);
    }
    {
      ops::MatmulPrecisionScope scope("bf16");
      bf16 = train(Device::cuda(0), kSteps, config);
    }
    ASSERT_EQ(on_gpu.losses.size(), on_cpu.losses.size());
    double from_bf16 = 0;
    for (size_t s = 0; s < on_cpu.losses.size(); ++s) {
      EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-3 * std::abs(on_cpu.losses[s]))
          << "step " << s;
      from_bf16 = std::max(from_bf16, std::abs(on_gpu.losses[s] - bf16.losses[s]));
    }
    cpu::ktest::expect_close("first gradients", on_gpu.first_grads, on_cpu.first_grads, 1e-3);
    EXPECT_FALSE(cpu::ktest::bitwise_equal(on_gpu.first_grads, bf16.first_grads))
        << "fp8 computed the bf16 run";
    EXPECT_GT(from_bf16, 0.0);
  }
}

// Llama on the GPU: RMSNorm, the rotary table uploaded and applied with the shared key/value
// heads repeated (and their gradients summed back), SwiGLU, no biases (or Qwen 2's on qkv), no
// position table; the LM head tied to the token embedding, or a weight of its own.
TEST(LlamaCuda, TrainingOnTheGpuMatchesTheCpu) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied head" : "untied head (lm_head.weight)");
    expect_gpu_run_matches_cpu(small_llama(16, tied), 5);
  }
  {
    SCOPED_TRACE("qkv biases");
    Gpt2Config biased = small_llama(16);
    biased.qkv_bias = true;
    expect_gpu_run_matches_cpu(biased, 5);
  }
  // Qwen 3's per-head query/key norms on heads of 24 from 64 channels (nn/qk_norm.h: the heads
  // gathered by copy_columns, RmsNorm's kernels, scattered back on the GPU).
  {
    SCOPED_TRACE("qk norms, wide heads");
    Gpt2Config normed = small_llama(16);
    normed.qk_norm = true;
    normed.head_width = 24;
    expect_gpu_run_matches_cpu(normed, 5);
  }
  // OLMo 2's norms: on the attention's and the MLP's outputs, and over all the query heads and
  // all the key heads.
  {
    SCOPED_TRACE("post-norms, full-width qk norms");
    Gpt2Config olmo2 = small_llama(16);
    olmo2.post_norm = true;
    olmo2.qk_norm = true;
    olmo2.qk_norm_full = true;
    expect_gpu_run_matches_cpu(olmo2, 5);
  }
  // Gemma 3's parts: sandwich norms, GeGLU, per-head query/key norms on heads of 24, the embedding
  // times 8 (and its gradient), a window of 7 in every other block turned by its own base, the
  // others' frequencies divided by 4 (linear scaling) and the scores scaled by 1/√40 (27B's
  // query_pre_attn_scalar: the query norm's output scaled on the GPU).
  {
    SCOPED_TRACE("gemma 3");
    Gpt2Config gemma = small_llama(16);
    gemma.qk_norm = gemma.sandwich_norm = true;
    gemma.head_width = 24;
    gemma.ffn_activation = GatedActivation::kGeluTanh;
    gemma.embedding_multiplier = 8;
    gemma.sliding_window = 7;
    gemma.full_attention_every = 2;
    gemma.rope_local_theta = 100;
    gemma.rope_scaling_factor = 4;
    gemma.rope_scaling_linear = true;
    gemma.query_pre_attn_scalar = 40;
    expect_gpu_run_matches_cpu(gemma, 5);
  }
  // Mistral's sliding window (nn/sliding_window.h): the window's table on the GPU, each query's
  // 7 latest keys of the 32.
  SCOPED_TRACE("sliding window");
  Gpt2Config windowed = small_llama(16);
  windowed.sliding_window = 7;
  expect_gpu_run_matches_cpu(windowed, 5);
}

// A mixture of 4 experts, top 2, in each block (nn/moe_mlp.h): the routing on the GPU, its
// choices laid out on the host, the experts' rows gathered and scattered back there; the same
// run as the CPU's, the balance loss, the router z-loss and a shared expert included. At bf16 the
// experts' gathered inputs stay 16-bit and the losses stay within 1% of the CPU's.
TEST(LlamaCuda, MixtureOfExpertsTrainingOnTheGpuMatchesTheCpu) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  Gpt2Config c = small_llama(16);
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_aux_loss_coef = 0.1f;
  c.moe_router_z_loss_coef = 0.01f;
  c.moe_shared_experts = 1;
  expect_gpu_run_matches_cpu(c, 4);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  const TrainRun on_cpu = train(Device::cpu(), 3, c);
  ops::set_matmul_precision("bf16");
  const TrainRun on_gpu = train(Device::cuda(0), 3, c);
  ops::set_matmul_precision("fp32");
  for (size_t s = 0; s < on_cpu.losses.size(); ++s)
    EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-2 * std::abs(on_cpu.losses[s]))
        << "bf16, step " << s;
  EXPECT_FALSE(cpu::ktest::bitwise_equal(on_gpu.final_values, on_cpu.final_values));
}

// bf16 GEMM inputs: the losses stay within 1% of the fp32 CPU run's. Heads of 16 take the
// attention's GEMM path; heads of 64 the fused flash kernels, on the rotated q and k (with Qwen
// 2's qkv biases: added in the 16-bit qkv's epilogue); Qwen 3's normed heads of 128 the flash
// kernels on the fp32 qkv, with a sliding window of 9 — and OLMo 2's post-norms and full-width
// norms there (the Linears rounding the fp32 residual stream as they read it).
TEST(LlamaCuda, Bf16MatmulsStayNearTheCpuRun) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  constexpr int kSteps = 3;
  for (int64_t head_dim : {16, 64, 128}) {
    // 128: Qwen 3's head norms on heads of 128 from 64·4 channels, the fp32 attention path.
    Gpt2Config config = small_llama(head_dim == 128 ? 64 : head_dim, head_dim == 16);
    config.qkv_bias = head_dim == 64;
    config.qk_norm = head_dim == 128;
    config.head_width = head_dim == 128 ? 128 : 0;
    config.sliding_window = head_dim == 128 ? 9 : 0;  // the flash kernels' walk from the window
    config.post_norm = config.qk_norm_full = head_dim == 128;
    const TrainRun on_cpu = train(Device::cpu(), kSteps, config);
    ops::set_matmul_precision("bf16");
    const TrainRun on_gpu = train(Device::cuda(0), kSteps, config);
    ops::set_matmul_precision("fp32");
    ASSERT_EQ(on_gpu.losses.size(), on_cpu.losses.size());
    for (size_t s = 0; s < on_cpu.losses.size(); ++s)
      EXPECT_NEAR(on_gpu.losses[s], on_cpu.losses[s], 1e-2 * std::abs(on_cpu.losses[s]))
          << "heads of " << head_dim << ", step " << s;
    // bf16 did round something: the GPU run is not the fp32 one bit for bit.
    EXPECT_FALSE(cpu::ktest::bitwise_equal(on_gpu.final_values, on_cpu.final_values))
        << "heads of " << head_dim;
  }
}

// One layer's forward and backward on GPU 0 at a matmul precision: its output, input gradient
// and parameter gradients, and the types of what its forward kept for the backward.
struct LayerRun {
  std::vector<float> y, dx, grads;
  std::vector<DType> kept;
};

// The values of a tensor of any float type on any device, as floats.
std::vector<float> values_of(const Tensor& t) {
  return t.to(Device::cpu()).to(DType::kF32).to_vector();
}

// make(store) builds the layer; run(layer, ctx, x, dy, result) runs it on x (B, T, C) and dy.
template <typename Make, typename Run>
LayerRun run_layer(const char* precision, int64_t C, Make make, Run run) {
  const Device gpu = Device::cuda(0);
  ops::set_matmul_precision(precision);
  ParameterStore store;
  auto layer = make(store);
  store.allocate(DType::kF32, gpu);
  store.initialize(6);
  store.zero_grads();
  ThreadPool pool(1);
  Context ctx{&pool, gpu, DType::kF32};
  LayerRun result;
  run(*layer, ctx, uniform_on(gpu, {2, 9, C}, 3, 1.0f), uniform_on(gpu, {2, 9, C}, 4, 1.0f),
      result);
  result.grads = store.grads().to_vector();
  ops::set_matmul_precision("fp32");
  return result;
}

template <typename Layer>
std::vector<DType> kept_types(Layer& layer) {
  std::vector<Tensor*> cache;
  layer.collect_cache(cache);
  std::vector<DType> types;
  for (const Tensor* t : cache)
    if (t->defined()) types.push_back(t->dtype());
  return types;
}

// The bf16 run within bf16's rounding of the fp32 one on the same GPU, and not bit for bit it.
void expect_bf16_near_fp32(const LayerRun& bf16, const LayerRun& fp32) {
  cpu::ktest::expect_close("output", bf16.y, fp32.y, 2e-2);
  cpu::ktest::expect_close("input gradient", bf16.dx, fp32.dx, 3e-2);
  cpu::ktest::expect_close("parameter gradients", bf16.grads, fp32.grads, 3e-2);
  EXPECT_FALSE(cpu::ktest::bitwise_equal(bf16.y, fp32.y)) << "nothing was rounded";
}

// At bf16 matmul precision Llama's layers keep their activations in 16 bits, as the GEMMs read
// them, and compute what they compute at fp32 to bf16's rounding: the RMSNorm writes the next
// Linear's rounded input; the rotary attention keeps its output in bf16, and qkv too (turned in
// place in bf16) where the flash kernels read it (head size 64 or 128; with heads of 16 qkv stays
// fp32); the SwiGLU MLP keeps the fc's output h, the SwiGLU output and both their gradients in
// bf16. A 16-bit path that skipped a step (the rotation, a shared head's gradient) would be far
// from the fp32 run.
TEST(LlamaCuda, Bf16LayersKeepSixteenBitActivationsAndComputeTheFp32Layers) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  for (const int64_t hd : {16, 64, 128}) {
    SCOPED_TRACE("heads of " + std::to_string(hd));
    const Gpt2Config config = small_llama(hd);
    const int64_t C = config.d_model;
    // Weights scaled with the width, so that scores and activations have the same size at every
    // head size (wider, bf16's rounding of larger scores would blur a peaked softmax more).
    const float std = 0.3f * std::sqrt(64.0f / static_cast<float>(C));
    const auto make_attention = [&](ParameterStore& store) {
      return std::make_unique<CausalSelfAttention>(
          store, "attn", C, config.n_heads, std, std,
          Rotary{config.n_kv_heads, config.rope_frequencies()});
    };
    const auto run_attention = [](CausalSelfAttention& attn, Context& ctx, const Tensor& x,
                                  const Tensor& dy, LayerRun& r) {
      r.y = values_of(attn.forward(ctx, x));
      r.kept = kept_types(attn);
      r.dx = values_of(attn.backward(ctx, dy));
    };
    const LayerRun att16 = run_layer("bf16", C, make_attention, run_attention);
    const LayerRun att32 = run_layer("fp32", C, make_attention, run_attention);
    {
      SCOPED_TRACE("attention");
      expect_bf16_near_fp32(att16, att32);
      // qkv's and proj's inputs, qkv, the attention output, lse.
      const DType qkv = hd == 16 ? DType::kF32 : DType::kBF16;  // flash at 64 and 128
      EXPECT_EQ(att16.kept, (std::vector<DType>{DType::kBF16, DType::kBF16, qkv, DType::kBF16,
                                                DType::kF32}));
      EXPECT_EQ(att32.kept, std::vector<DType>(5, DType::kF32));
    }
    const auto make_mlp = [&](ParameterStore& store) {
      return std::make_unique<SwiGluMlp>(store, "mlp", C, config.ffn_hidden, std, std);
    };
    const auto run_mlp = [](SwiGluMlp& mlp, Context& ctx, const Tensor& x, const Tensor& dy,
                            LayerRun& r) {
      r.y = values_of(mlp.forward(ctx, x));
      r.kept = kept_types(mlp);
      r.dx = values_of(mlp.backward(ctx, dy));
    };
    const LayerRun mlp16 = run_layer("bf16", C, make_mlp, run_mlp);
    const LayerRun mlp32 = run_layer("fp32", C, make_mlp, run_mlp);
    {
      SCOPED_TRACE("SwiGLU MLP");
      expect_bf16_near_fp32(mlp16, mlp32);
      // fc's input, proj's input (the SwiGLU output), h.
      EXPECT_EQ(mlp16.kept, std::vector<DType>(3, DType::kBF16));
      EXPECT_EQ(mlp32.kept, std::vector<DType>(3, DType::kF32));
    }
    const auto make_norm = [&](ParameterStore& store) {
      return std::make_unique<RmsNorm>(store, "norm", C, 1e-5);
    };
    const auto run_norm = [](RmsNorm& norm, Context& ctx, const Tensor& x, const Tensor& dy,
                             LayerRun& r) {
      const Tensor y = norm.forward_for_matmul(ctx, x);
      r.kept = {y.dtype()};  // here: the output's type
      r.y = values_of(y);
      std::vector<float> exact = values_of(norm.recompute_output(ctx));
      for (float& v : exact) v = bf16_to_float(float_to_bf16(v));
      if (y.dtype() == DType::kBF16) {
        EXPECT_TRUE(cpu::ktest::bitwise_equal(r.y, exact)) << "not the fp32 output rounded";
      }
      r.dx = values_of(norm.backward(ctx, dy));
    };
    const LayerRun norm16 = run_layer("bf16", C, make_norm, run_norm);
    const LayerRun norm32 = run_layer("fp32", C, make_norm, run_norm);
    {
      SCOPED_TRACE("RMSNorm");
      EXPECT_EQ(norm16.kept, std::vector<DType>{DType::kBF16});
      EXPECT_EQ(norm32.kept, std::vector<DType>{DType::kF32});
      cpu::ktest::expect_close("output", norm16.y, norm32.y, 1e-2);
      EXPECT_TRUE(cpu::ktest::bitwise_equal(norm16.dx, norm32.dx)) << "the backward is fp32";
    }
  }
}

// A small Llama at bf16 (its activations in 16 bits): selective and full recomputation rebuild
// them bit for bit, so the runs are the stored run's; a second run repeats it. Also OLMo 2's
// post-norms (heads of 64), whose selective recomputation drops the SwiGLU output alone, and
// Gemma's sandwich norms with its GeGLU.
TEST(LlamaCuda, Bf16RecomputationAndRepeatsAreBitwiseTheStoredRun) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  ops::set_matmul_precision("bf16");
  struct Case {
    int64_t hd;
    const char* norms;
  };
  for (const Case k : {Case{16, "pre"}, Case{64, "pre"}, Case{64, "post"}, Case{64, "sandwich"}}) {
    SCOPED_TRACE("heads of " + std::to_string(k.hd) + ", " + k.norms + "-norms");
    Gpt2Config config = small_llama(k.hd);
    config.post_norm = std::string(k.norms) == "post";
    config.sandwich_norm = std::string(k.norms) == "sandwich";
    if (config.sandwich_norm) config.ffn_activation = GatedActivation::kGeluTanh;
    const TrainRun stored = train(Device::cuda(0), 2, config);
    for (const Recompute mode : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
      SCOPED_TRACE(recompute_name(mode));
      config.recompute = mode;
      const TrainRun run = train(Device::cuda(0), 2, config);
      ASSERT_EQ(run.losses.size(), stored.losses.size());
      for (size_t s = 0; s < run.losses.size(); ++s)
        EXPECT_EQ(std::memcmp(&run.losses[s], &stored.losses[s], sizeof(double)), 0)
            << "step " << s;
      EXPECT_TRUE(cpu::ktest::bitwise_equal(run.first_grads, stored.first_grads));
      EXPECT_TRUE(cpu::ktest::bitwise_equal(run.final_values, stored.final_values));
    }
  }
}

// OLMo 2's post-norm block at bf16: its Linears keep the residual stream as they read it,
// rounded to 16 bits, so selective recomputation drops the SwiGLU output alone — it once dropped
// those copies and kept x and x1 in fp32 to restore them, 4·N·C bytes more than it saves.
TEST(LlamaCuda, PostNormSelectiveRecomputationDropsTheSwigluOutputAlone) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  struct Restore {
    ~Restore() { ops::set_matmul_precision("fp32"); }
  } restore;
  ops::set_matmul_precision("bf16");
  const Device gpu = Device::cuda(0);
  constexpr int64_t B = 2, T = 9;
  const auto kept_bytes = [&](Recompute mode) {
    Gpt2Config config = small_llama(64);
    config.post_norm = true;
    config.recompute = mode;
    ParameterStore store;
    Gpt2Block block(store, "blocks.0", config);
    store.allocate(DType::kF32, gpu);
    store.initialize(6);
    ThreadPool pool(1);
    Context ctx{&pool, gpu, DType::kF32};
    block.forward(ctx, uniform_on(gpu, {B, T, config.d_model}, 3, 1.0f));
    std::vector<Tensor*> cache;
    block.collect_cache(cache);
    std::vector<const void*> seen;
    int64_t bytes = 0;
    for (const Tensor* t : cache) {
      if (!t->defined() || std::find(seen.begin(), seen.end(), t->raw()) != seen.end()) continue;
      seen.push_back(t->raw());
      bytes += static_cast<int64_t>(t->nbytes());
    }
    return bytes;
  };
  const int64_t hidden = small_llama(64).ffn_hidden;
  EXPECT_EQ(kept_bytes(Recompute::kNone) - kept_bytes(Recompute::kSelective),
            B * T * hidden * 2);  // the bf16 SwiGLU output
}

TEST(LlamaCuda, TwoGpuRunsAreBitwiseIdentical) {
  LOOM_SKIP_UNLESS_CUDA_DEVICES(1);
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied head" : "untied head");
    const TrainRun a = train(Device::cuda(0), 3, small_llama(16, tied));
    const TrainRun b = train(Device::cuda(0), 3, small_llama(16, tied));
    ASSERT_EQ(a.losses.size(), b.losses.size());
    for (size_t s = 0; s < a.losses.size(); ++s)
      EXPECT_EQ(std::memcmp(&a.losses[s], &b.losses[s], sizeof(double)), 0) << "step " << s;
    EXPECT_TRUE(cpu::ktest::bitwise_equal(a.first_grads, b.first_grads));
    EXPECT_TRUE(cpu::ktest::bitwise_equal(a.final_values, b.final_values));
  }
}

}  // namespace
}  // namespace loom
