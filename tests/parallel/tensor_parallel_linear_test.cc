// Tensor-parallel linear layers (issue 5): a column-parallel layer followed by a row-parallel
// one (an MLP without the activation), on tp = 2 and 4 thread ranks, with and without sequence
// parallelism, computes the single-device pair: the output, the input gradient and every
// weight/bias gradient (each rank's shard against its block of the full gradient), to 1e-5 of
// the tensor's scale. Also a fused QKV weight split block by block, and the backward's overlap
// of the input gradient's collective with the weight gradient (parallel.tp_backward_overlap).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "base/error.h"
#include "harness/probing_communicator.h"
#include "harness/thread_ranks.h"
#include "nn/linear.h"
#include "parallel/tensor_parallel_linear.h"
#include "tensor/rng.h"

namespace loom {
namespace {

constexpr int64_t kRows = 8, kIn = 8, kHidden = 16;

Tensor random(const Shape& shape, const std::string& name) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  init_normal(t, 3, name, 0.0f, 1.0f);
  return t;
}

double scale_of(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(double{t.data<float>()[i]}));
  return std::max(m, 1e-12);
}

// Expects local (rows × cols) to equal ref's block at (row0, col0).
void expect_block(const Tensor& local, const Tensor& ref, int64_t row0, int64_t col0, const std::string& what) {
  const int64_t rows = local.dim(0), cols = local.numel() / rows, ref_cols = ref.numel() / ref.dim(0);
  const double tol = 1e-5 * scale_of(ref);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      ASSERT_NEAR(local.data<float>()[i * cols + j], ref.data<float>()[(row0 + i) * ref_cols + col0 + j], tol)
          << what << " (" << i << ", " << j << ")";
}

struct Reference {
  Tensor y, dx, fc_w, fc_b, proj_w, proj_b;  // output, input grad, parameter grads
};

Reference single_device(const Tensor& x, const Tensor& dy) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  ParameterStore store;
  Linear fc(store, "fc", kIn, kHidden, true, 0.02f);
  Linear proj(store, "proj", kHidden, kIn, true, 0.02f);
  store.allocate(DType::kF32, Device::cpu());
  store.initialize(5);
  // Non-zero biases, so that their handling is tested too.
  for (const char* b : {"fc.bias", "proj.bias"}) init_normal(store.get(b).value, 9, b, 0.0f, 1.0f);
  Reference r;
  r.y = proj.forward(ctx, fc.forward(ctx, x));
  r.dx = fc.backward(ctx, proj.backward(ctx, dy));
  r.fc_w = store.get("fc.weight").grad.clone();
  r.fc_b = store.get("fc.bias").grad.clone();
  r.proj_w = store.get("proj.weight").grad.clone();
  r.proj_b = store.get("proj.bias").grad.clone();
  return r;
}

class TensorParallelPair : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TensorParallelPair, EqualsTheSingleDevicePair) {
  const auto [P, sp] = GetParam();
  const Tensor x = random({kRows, kIn}, "x"), dy = random({kRows, kIn}, "dy");
  const Reference ref = single_device(x, dy);
  testing::run_on_thread_ranks(P, [&, P = P, sp = sp](Communicator& tp) {
    ThreadPool pool(1);
    Context ctx{&pool, Device::cpu(), DType::kF32};
    ParameterStore store;
    ColumnParallelLinear fc(store, "fc", kIn, kHidden, tp, true, 0.02f, sp);
    RowParallelLinear proj(store, "proj", kHidden, kIn, tp, true, 0.02f, sp);
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(5);
    // The same non-zero biases: the full ones, each rank taking its slice.
    const int64_t r = tp.rank(), h = kHidden / P, rows = kRows / P;
    Tensor fc_b_full = Tensor::empty({kHidden}, DType::kF32), proj_b = store.get("proj.bias").value;
    init_normal(fc_b_full, 9, "fc.bias", 0.0f, 1.0f);
    store.get("fc.bias").value.copy_from(fc_b_full.narrow(r * h, h));
    init_normal(proj_b, 9, "proj.bias", 0.0f, 1.0f);
    // Sequence parallelism: this rank holds rows [r·rows, (r+1)·rows) of the activations.
    const Tensor x_in = sp ? x.narrow(r * rows, rows).clone() : x;
    const Tensor dy_in = sp ? dy.narrow(r * rows, rows).clone() : dy;
    const Tensor y = proj.forward(ctx, fc.forward(ctx, x_in));
    const Tensor dx = fc.backward(ctx, proj.backward(ctx, dy_in));
    expect_block(y, ref.y, sp ? r * rows : 0, 0, "output");
    expect_block(dx, ref.dx, sp ? r * rows : 0, 0, "input gradient");
    expect_block(store.get("fc.weight").grad, ref.fc_w, r * h, 0, "fc.weight grad");
    expect_block(store.get("fc.bias").grad.reshape({h, 1}), ref.fc_b.reshape({kHidden, 1}), r * h, 0, "fc.bias grad");
    expect_block(store.get("proj.weight").grad, ref.proj_w, 0, r * h, "proj.weight grad");
    expect_block(store.get("proj.bias").grad.reshape({kIn, 1}), ref.proj_b.reshape({kIn, 1}), 0, 0, "proj.bias grad");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelPair,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
                           return "tp" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_sequence_parallel" : "");
                         });

TEST(TensorParallelLinear, FusedQkvSplitsEachBlock) {
  // QKV of 3 blocks of 8 outputs on 2 ranks: rank r's output columns are r's slice of each block.
  const Tensor x = random({4, kIn}, "x");
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  ParameterStore full_store;
  Linear qkv(full_store, "qkv", kIn, 24, true, 0.02f);
  full_store.allocate(DType::kF32, Device::cpu());
  full_store.initialize(5);
  const Tensor ref = qkv.forward(ctx, x);
  testing::run_on_thread_ranks(2, [&](Communicator& tp) {
    ThreadPool p(1);
    Context c{&p, Device::cpu(), DType::kF32};
    ParameterStore store;
    ColumnParallelLinear part(store, "qkv", kIn, 24, tp, true, 0.02f, false, {8, 8, 8});
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(5);
    const Tensor y = part.forward(c, x);  // (4, 12): q, k, v slices of 4 columns each
    ASSERT_EQ(y.dim(1), 12);
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t k = 0; k < 3; ++k)
        for (int64_t j = 0; j < 4; ++j)
          ASSERT_NEAR(y.data<float>()[i * 12 + k * 4 + j], ref.data<float>()[i * 24 + k * 8 + tp.rank() * 4 + j], 1e-6);
  });
}

TEST(TensorParallelLinear, FeaturesThatDoNotSplitAreErrors) {
  testing::run_on_thread_ranks(2, [&](Communicator& tp) {
    ParameterStore store;
    EXPECT_THROW(ColumnParallelLinear(store, "a", 4, 5, tp, false, 0.02f, false), Error);
    EXPECT_THROW(RowParallelLinear(store, "b", 5, 4, tp, false, 0.02f, false), Error);
  });
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// parallel.tp_backward_overlap (parallel/tp_backward_overlap.h), on 2 ranks: with it, the
// column-parallel layer issues its input gradient's all-reduce (reduce-scatter under sequence
// parallelism) before computing its weight gradient and waits for it after; without, the
// gradient is computed before the collective is issued. Both give the same bits — input
// gradients, weight and bias gradients —, through the GELU (backward_before_gelu) too.
class TpBackwardOverlap : public ::testing::TestWithParam<bool> {};

TEST_P(TpBackwardOverlap, WeightGradientComputesWhileTheCollectiveIsInFlightToTheSameBits) {
  const bool sp = GetParam();
  constexpr int kRanks = 2;
  const Tensor x = random({kRows, kIn}, "x");
  struct Run {
    Tensor dx, dx_gelu, weight_grad, bias_grad;
    testing::GradientProbe weight_grad_probe;  // in the first backward
  };
  std::vector<Run> runs(2 * kRanks);  // [overlap][rank]
  for (const bool overlap : {false, true}) {
    testing::run_on_thread_ranks(kRanks, [&](Communicator& inner) {
      testing::ProbingCommunicator tp(inner);
      ThreadPool pool(1);
      Context ctx{&pool, Device::cpu(), DType::kF32};
      ctx.tp_backward_overlap = overlap;
      ParameterStore store;
      ColumnParallelLinear fc(store, "fc", kIn, kHidden, tp, true, 0.02f, sp);
      store.allocate(DType::kF32, Device::cpu());
      store.initialize(5);
      const int r = tp.rank();
      Run& run = runs[static_cast<size_t>((overlap ? kRanks : 0) + r)];
      const Tensor& weight_grad = store.get("fc.weight").grad;
      run.weight_grad_probe.watch(tp, weight_grad);
      const int64_t rows = kRows / kRanks, h = kHidden / kRanks;
      const Tensor x_in = sp ? x.narrow(r * rows, rows).clone() : x;
      const std::string rank = std::to_string(r);
      (void)fc.forward(ctx, x_in);
      run.dx = fc.backward(ctx, random({kRows, h}, "dy" + rank));
      tp.on_issue = tp.on_wait = nullptr;
      (void)fc.forward(ctx, x_in);
      Tensor dgelu = random({kRows, h}, "dgelu" + rank);
      run.dx_gelu = fc.backward_before_gelu(ctx, dgelu, random({kRows, h}, "h" + rank));
      run.weight_grad = weight_grad.clone();
      run.bias_grad = store.get("fc.bias").grad.clone();
    });
  }
  for (int r = 0; r < kRanks; ++r) {
    const Run &off = runs[static_cast<size_t>(r)], &on = runs[static_cast<size_t>(kRanks + r)];
    EXPECT_EQ(off.weight_grad_probe.computed_at_issue, std::vector<bool>{true}) << "rank " << r;
    EXPECT_EQ(off.weight_grad_probe.computed_at_wait, std::vector<bool>{true}) << "rank " << r;
    EXPECT_EQ(on.weight_grad_probe.computed_at_issue, std::vector<bool>{false}) << "rank " << r;
    EXPECT_EQ(on.weight_grad_probe.computed_at_wait, std::vector<bool>{true}) << "rank " << r;
    EXPECT_TRUE(same_bits(off.dx, on.dx)) << "rank " << r;
    EXPECT_TRUE(same_bits(off.dx_gelu, on.dx_gelu)) << "rank " << r;
    EXPECT_TRUE(same_bits(off.weight_grad, on.weight_grad)) << "rank " << r;
    EXPECT_TRUE(same_bits(off.bias_grad, on.bias_grad)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TpBackwardOverlap, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "sequence_parallel" : "tp";
                         });

}  // namespace
}  // namespace loom
