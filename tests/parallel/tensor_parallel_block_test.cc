// The tensor-parallel GPT-2 block (issue 5) equals the single-device Gpt2Block split up: on
// tp = 1, 2, 4 thread ranks, with and without sequence parallelism, the output, the input
// gradient and every parameter gradient (each shard against its pieces of the full gradient;
// LayerNorm gradients all-reduced over tp under sequence parallelism) agree to 1e-5 of the
// tensor's scale. Heads that do not divide over tp are an error naming the keys.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

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
    for (Parameter* q : block.tp_summed_params()) tp.all_reduce(q->grad, ReduceOp::kSum);
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

// Activation recomputation (models/gpt2.h): on tp = 2, with and without sequence parallelism,
// full and selective give bitwise the output, input gradient and parameter gradients of none,
// and keep fewer bytes between forward and backward: exactly (floats, r = this rank's rows,
// N = B·T, P = tp, NH heads)
//   none:      x, x1 (r·C each); the two LayerNorm outputs qkv and fc read (N·C each, gathered
//              with sequence parallelism); qkv, attention, h and GELU outputs
//              (N·(3 + 1 + 4 + 4)·C/P); mean and rstd (4·r); log-sum-exp (B·NH/P·T)
//   selective: less the LayerNorm outputs and the GELU output
//   full:      x
int64_t distinct_bytes(const std::vector<Tensor*>& slots) {
  std::set<const void*> seen;  // the attention output is also its projection's input: once
  int64_t bytes = 0;
  for (const Tensor* t : slots)
    if (t->defined() && seen.insert(t->raw()).second) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

struct BlockRun {
  std::vector<float> y, dx, grads;
  int64_t cache_bytes = 0;
};

class TensorParallelBlockRecompute : public ::testing::TestWithParam<bool> {};

TEST_P(TensorParallelBlockRecompute, ModesAreBitwiseIdenticalAndKeepLessMemory) {
  const bool sp = GetParam();
  const int P = 2;
  const Gpt2Config base = config();
  const int64_t C = base.d_model, N = kB * kT;
  Tensor x = Tensor::empty({N, C}, DType::kF32), dy = Tensor::empty({N, C}, DType::kF32);
  init_normal(x, 1, "x", 0.0f, 1.0f);
  init_normal(dy, 1, "dy", 0.0f, 1.0f);
  testing::run_on_thread_ranks(P, [&](Communicator& tp) {
    const int64_t rows = sp ? N / P : N, row0 = sp ? tp.rank() * rows : 0;
    auto run = [&](Recompute mode) {
      ThreadPool p(1);
      Context c{&p, Device::cpu(), DType::kF32};
      Gpt2Config mc = base;
      mc.recompute = mode;
      ParameterStore store;
      TpGpt2Block block(store, "blocks.0", mc, tp, sp);
      store.allocate(DType::kF32, Device::cpu());
      store.initialize(4);
      BlockRun r;
      r.y = block.forward(c, x.narrow(row0, rows).clone(), kB, kT).to_vector();
      std::vector<Tensor*> slots;
      block.collect_cache(slots);
      r.cache_bytes = distinct_bytes(slots);
      r.dx = block.backward(c, dy.narrow(row0, rows).clone()).to_vector();
      for (Parameter* q : block.tp_summed_params()) tp.all_reduce(q->grad, ReduceOp::kSum);
      r.grads = store.grads().to_vector();
      return r;
    };
    const BlockRun none = run(Recompute::kNone);
    const BlockRun full = run(Recompute::kFull);
    const BlockRun selective = run(Recompute::kSelective);
    for (const auto& [name, r] : {std::pair{"full", &full}, std::pair{"selective", &selective}}) {
      SCOPED_TRACE(name);
      ASSERT_EQ(r->dx.size(), none.dx.size());
      EXPECT_EQ(std::memcmp(r->dx.data(), none.dx.data(), none.dx.size() * 4), 0);
      ASSERT_EQ(r->grads.size(), none.grads.size());
      EXPECT_EQ(std::memcmp(r->grads.data(), none.grads.data(), none.grads.size() * 4), 0);
      ASSERT_EQ(r->y.size(), none.y.size());
      EXPECT_EQ(std::memcmp(r->y.data(), none.y.data(), none.y.size() * 4), 0);
    }
    const int64_t heads = base.n_heads / P;
    const int64_t matmul_outputs = N * (3 + 1 + 4) * C / P + 4 * rows + kB * heads * kT;
    // The norms' inputs and outputs, rows each: with sequence parallelism the column-parallel
    // layers keep their inputs' rows un-gathered (gathered again in backward), as Megatron-LM.
    EXPECT_EQ(none.cache_bytes, 4 * (4 * rows * C + N * 4 * C / P + matmul_outputs));
    EXPECT_EQ(selective.cache_bytes, 4 * (2 * rows * C + matmul_outputs));
    EXPECT_EQ(full.cache_bytes, 4 * rows * C);
    EXPECT_LT(full.cache_bytes, selective.cache_bytes);
    EXPECT_LT(selective.cache_bytes, none.cache_bytes);
  });
}

INSTANTIATE_TEST_SUITE_P(Tp2, TensorParallelBlockRecompute, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "sequence_parallel" : "plain";
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
