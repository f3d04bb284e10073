// Vocabulary-parallel embedding, tied LM head and cross-entropy (issue 5), against the
// single-device embedding + head + cross-entropy, with a vocabulary of 257 (padded on tp = 2
// and 4): the embedding output, the loss, the gradient of the head's input and the wte/wpe
// gradients (each rank's real rows; padding rows stay zero) agree to 1e-5 of their scale, with
// and without sequence parallelism. The head's backward computes its weight gradient while the
// all-reduce of its input gradient is in flight (parallel.tp_backward_overlap), to the same bits.
#include "parallel/tensor_parallel_vocab.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "harness/probing_communicator.h"
#include "harness/thread_ranks.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/gemm.h"
#include "kernels/targets.h"
#include "nn/embedding.h"
#include "tensor/rng.h"

namespace loom {
namespace {

constexpr int64_t kV = 257, kC = 8, kB = 2, kT = 4, kN = kB * kT;

double scale_of(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(double{t.data<float>()[i]}));
  return std::max(m, 1e-12);
}

struct Reference {
  Tensor embedded, dfinal, dwte, dwpe;
  double loss = 0;
};

Reference single_device(const Tensor& tokens, const Tensor& final, const Tensor& targets,
                        const Tensor& dy, float z_loss) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  ParameterStore store;
  Embedding emb(store, kV, kT, kC, 0.02f);
  store.allocate(DType::kF32, Device::cpu());
  store.initialize(6);
  Reference r;
  r.embedded = emb.forward(ctx, tokens).reshape({kN, kC}).clone();
  emb.backward(ctx, dy.reshape({kB, kT, kC}));
  Tensor logits = Tensor::empty({kN, kV}, DType::kF32), losses = Tensor::empty({kN}, DType::kF32),
         lse = Tensor::empty({kN}, DType::kF32);
  cpu::matmul_forward<float>(pool, logits.data<float>(), final.data<float>(), emb.wte()->value.data<float>(), nullptr, kN, kC, kV);
  cpu::cross_entropy_forward<float>(pool, losses.data<float>(), lse.data<float>(), logits.data<float>(), targets.data<int32_t>(), kN, kV);
  for (int64_t i = 0; i < kN; ++i) r.loss += losses.data<float>()[i];
  r.loss /= kN;
  cpu::cross_entropy_backward<float>(pool, logits.data<float>(), logits.data<float>(),
                                     lse.data<float>(), targets.data<int32_t>(), 1.0f / kN, kN, kV,
                                     z_loss);
  r.dfinal = Tensor::empty({kN, kC}, DType::kF32);
  cpu::matmul_backward<float>(pool, r.dfinal.data<float>(), emb.wte()->grad.data<float>(), nullptr, logits.data<float>(), final.data<float>(), emb.wte()->value.data<float>(), kN, kC, kV);
  r.dwte = emb.wte()->grad.clone();
  r.dwpe = emb.wpe()->grad.clone();
  return r;
}

class VocabParallel : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(VocabParallel, EqualsTheSingleDeviceEmbeddingAndLoss) {
  const auto [P, sp] = GetParam();
  Tensor tokens = Tensor::empty({kB, kT}, DType::kI32), targets = Tensor::empty({kN}, DType::kI32);
  RandomStream rng(3, "tokens");
  for (int64_t i = 0; i < kN; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % kV);
  for (int64_t i = 0; i < kN; ++i) targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % kV);
  targets.data<int32_t>()[0] = kV - 1;  // the last real row, next to the padding
  // Ignored rows (data.eod_mask_loss): no loss and no gradient on any rank, as on one device.
  targets.data<int32_t>()[3] = kIgnoredTarget;
  targets.data<int32_t>()[kN - 1] = kIgnoredTarget;
  Tensor final = Tensor::empty({kN, kC}, DType::kF32), dy = Tensor::empty({kN, kC}, DType::kF32);
  init_normal(final, 2, "final", 0.0f, 1.0f);
  init_normal(dy, 2, "dy", 0.0f, 1.0f);
  // Without and with the z-loss (train.z_loss), whose gradient the shards take from the group's
  // lse.
  for (const float z_loss : {0.0f, 0.05f}) {
    SCOPED_TRACE("z_loss " + std::to_string(z_loss));
    const Reference ref = single_device(tokens, final, targets, dy, z_loss);

    testing::run_on_thread_ranks(P, [&, P = P, sp = sp, z_loss = z_loss](Communicator& tp) {
      ThreadPool pool(1);
      Context ctx{&pool, Device::cpu(), DType::kF32};
      ctx.z_loss = z_loss;
      ParameterStore store;
      VocabParallelEmbedding vocab(store, kV, kT, kC, 0.02f, tp, sp);
      store.allocate(DType::kF32, Device::cpu());
      store.initialize(6);
      const int64_t rows = sp ? kN / P : kN, row0 = sp ? tp.rank() * rows : 0;
      const Tensor e = vocab.forward(ctx, tokens);
      for (int64_t i = 0; i < rows * kC; ++i)
        ASSERT_NEAR(e.data<float>()[i], ref.embedded.data<float>()[row0 * kC + i], 1e-6)
            << "embedding " << i;
      vocab.backward(ctx, dy.narrow(row0, rows).clone());
      double loss = 0;
      vocab.head_forward(ctx, final, targets, &loss);
      EXPECT_NEAR(loss, ref.loss, 1e-5 * ref.loss);
      const Tensor dfinal = vocab.head_backward(ctx, 1.0);
      for (int64_t i = 0; i < rows * kC; ++i)
        ASSERT_NEAR(dfinal.data<float>()[i], ref.dfinal.data<float>()[row0 * kC + i],
                    1e-5 * scale_of(ref.dfinal))
            << "dfinal " << i;
      const int64_t first = tp.rank() * vocab.local_vocab();
      for (int64_t row = 0; row < vocab.local_vocab(); ++row)
        for (int64_t c = 0; c < kC; ++c) {
          const float got = vocab.wte()->grad.data<float>()[row * kC + c];
          if (row < vocab.real_rows())
            ASSERT_NEAR(got, ref.dwte.data<float>()[(first + row) * kC + c],
                        1e-5 * scale_of(ref.dwte))
                << "wte row " << first + row;
          else
            ASSERT_EQ(got, 0.0f) << "padding row " << row << " got a gradient";
        }
      for (int64_t i = 0; i < ref.dwpe.numel(); ++i)
        ASSERT_NEAR(vocab.wpe()->grad.data<float>()[i], ref.dwpe.data<float>()[i],
                    1e-5 * scale_of(ref.dwpe));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, VocabParallel,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
                           return "tp" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_sequence_parallel" : "");
                         });

// parallel.tp_backward_overlap at the head, on 2 ranks: with it, head_backward issues dfinal's
// all-reduce (reduce-scatter under sequence parallelism) before its shard's weight gradient — the
// largest GEMM of a model — and waits for it after; without, the gradient comes first. The same
// bits either way.
class HeadBackwardOverlap : public ::testing::TestWithParam<bool> {};

TEST_P(HeadBackwardOverlap, WeightGradientComputesWhileTheCollectiveIsInFlightToTheSameBits) {
  const bool sp = GetParam();
  constexpr int kRanks = 2;
  Tensor targets = Tensor::empty({kN}, DType::kI32);
  RandomStream rng(4, "targets");
  for (int64_t i = 0; i < kN; ++i)
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % kV);
  Tensor final = Tensor::empty({kN, kC}, DType::kF32);
  init_normal(final, 2, "final", 0.0f, 1.0f);
  struct Run {
    Tensor dfinal, dwte;
    testing::GradientProbe dwte_probe;  // the wte shard's gradient
  };
  std::vector<Run> runs(2 * kRanks);  // [overlap][rank]
  for (const bool overlap : {false, true}) {
    testing::run_on_thread_ranks(kRanks, [&](Communicator& inner) {
      testing::ProbingCommunicator tp(inner);
      ThreadPool pool(1);
      Context ctx{&pool, Device::cpu(), DType::kF32};
      ctx.tp_backward_overlap = overlap;
      ParameterStore store;
      VocabParallelEmbedding vocab(store, kV, kT, kC, 0.02f, tp, sp);
      store.allocate(DType::kF32, Device::cpu());
      store.initialize(6);
      double loss = 0;
      vocab.head_forward(ctx, final, targets, &loss);  // (its all-reduces are not probed yet)
      Run& run = runs[static_cast<size_t>((overlap ? kRanks : 0) + tp.rank())];
      const Tensor& dwte = vocab.wte()->grad;
      run.dwte_probe.watch(tp, dwte);
      run.dfinal = vocab.head_backward(ctx, 1.0);
      tp.on_issue = tp.on_wait = nullptr;
      run.dwte = dwte.clone();
    });
  }
  for (int r = 0; r < kRanks; ++r) {
    const Run &off = runs[static_cast<size_t>(r)], &on = runs[static_cast<size_t>(kRanks + r)];
    EXPECT_EQ(off.dwte_probe.computed_at_issue, std::vector<bool>{true}) << "rank " << r;
    EXPECT_EQ(off.dwte_probe.computed_at_wait, std::vector<bool>{true}) << "rank " << r;
    EXPECT_EQ(on.dwte_probe.computed_at_issue, std::vector<bool>{false}) << "rank " << r;
    EXPECT_EQ(on.dwte_probe.computed_at_wait, std::vector<bool>{true}) << "rank " << r;
    EXPECT_EQ(std::memcmp(off.dfinal.raw(), on.dfinal.raw(), off.dfinal.nbytes()), 0)
        << "rank " << r;
    EXPECT_EQ(std::memcmp(off.dwte.raw(), on.dwte.raw(), off.dwte.nbytes()), 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, HeadBackwardOverlap, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "sequence_parallel" : "tp";
                         });

}  // namespace
}  // namespace loom
