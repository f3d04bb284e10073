// The tensor-parallel GPT-2 block (issue 5) equals the single-device Gpt2Block split up: on
// tp = 1, 2, 4 thread ranks, with and without sequence parallelism, the output, the input
// gradient and every parameter gradient (each shard against its pieces of the full gradient;
// LayerNorm gradients all-reduced over tp under sequence parallelism) agree to 1e-5 of the
// tensor's scale. Heads that do not divide over tp are an error naming the keys.
#include <gtest/gtest.h>

#include <cmath>

#include "base/error.h"
#include "harness/thread_ranks.h"
#include "parallel/tensor_parallel_block.h"
#include "tensor/rng.h"

namespace loom {
namespace {

constexpr int64_t kB = 2, kT = 8;

Gpt2Config config() {
  Gpt2Config c;
  c.vocab_size = 32;
  c.max_seq_len = kT;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  return c;
}

double scale_of(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(double{t.data<float>()[i]}));
  return std::max(m, 1e-12);
}

// local rows [row0, row0 + local.dim(0)) against ref rows starting at ref_row, columns at col0.
void expect_rows(const Tensor& local, const Tensor& ref, int64_t local_row, int64_t rows,
                 int64_t ref_row, int64_t col0, double tol, const std::string& what) {
  const int64_t cols = local.numel() / local.dim(0), ref_cols = ref.numel() / ref.dim(0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      ASSERT_NEAR(local.data<float>()[(local_row + i) * cols + j],
                  ref.data<float>()[(ref_row + i) * ref_cols + col0 + j], tol)
          << what << " (" << i << ", " << j << ")";
}

class TensorParallelBlock : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TensorParallelBlock, EqualsTheSingleDeviceBlock) {
  const auto [P, sp] = GetParam();
  const Gpt2Config mc = config();
  const int64_t C = mc.d_model, N = kB * kT;
  Tensor x = Tensor::empty({kB, kT, C}, DType::kF32), dy = Tensor::empty({kB, kT, C}, DType::kF32);
  init_normal(x, 1, "x", 0.0f, 1.0f);
  init_normal(dy, 1, "dy", 0.0f, 1.0f);
  // The single-device block.
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  ParameterStore ref_store;
  Gpt2Block ref_block(ref_store, "blocks.0", mc);
  ref_store.allocate(DType::kF32, Device::cpu());
  ref_store.initialize(4);
  const Tensor ref_y = ref_block.forward(ctx, x).reshape({N, C});
  const Tensor ref_dx = ref_block.backward(ctx, dy).reshape({N, C});

  testing::run_on_thread_ranks(P, [&, P = P, sp = sp](Communicator& tp) {
    ThreadPool p(1);
    Context c{&p, Device::cpu(), DType::kF32};
    ParameterStore store;
    TpGpt2Block block(store, "blocks.0", mc, tp, sp);
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(4);
    const int64_t rows = sp ? N / P : N, row0 = sp ? tp.rank() * rows : 0;
    const Tensor y = block.forward(c, x.reshape({N, C}).narrow(row0, rows).clone(), kB, kT);
    const Tensor dx = block.backward(c, dy.reshape({N, C}).narrow(row0, rows).clone());
    for (Parameter* q : block.sequence_parallel_params()) tp.all_reduce(q->grad, ReduceOp::kSum);
    expect_rows(y, ref_y, 0, rows, row0, 0, 1e-5 * scale_of(ref_y), "output");
    expect_rows(dx, ref_dx, 0, rows, row0, 0, 1e-5 * scale_of(ref_dx), "input gradient");
    for (const auto& q : store.parameters()) {
      const Parameter& r = ref_store.get(q->name);
      const double tol = 1e-5 * scale_of(r.grad);
      const Tensor local = q->grad.ndim() == 1 ? q->grad.reshape({q->numel(), 1}) : q->grad;
      const Tensor full = r.grad.ndim() == 1 ? r.grad.reshape({r.numel(), 1}) : r.grad;
      if (q->pieces.empty()) {
        expect_rows(local, full, 0, local.dim(0), 0, 0, tol, q->name);
      } else {
        for (const ShardPiece& piece : q->pieces)
          expect_rows(local, full, piece.local_row, piece.rows, piece.region.offset[0],
                      piece.region.offset.size() > 1 ? piece.region.offset[1] : 0, tol, q->name);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelBlock,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
                           return "tp" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_sequence_parallel" : "");
                         });

TEST(TensorParallelBlockConfig, HeadsThatDoNotSplitAreAnError) {
  Gpt2Config mc = config();
  mc.n_heads = 2;
  testing::run_on_thread_ranks(4, [&](Communicator& tp) {
    ParameterStore store;
    try {
      TpGpt2Block block(store, "blocks.0", mc, tp, false);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.tp = 4 does not divide model.n_heads = 2"),
                std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace loom
