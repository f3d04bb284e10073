#include "models/gpt2.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "../nn/gradcheck.h"
#include "base/error.h"
#include "tensor/rng.h"

namespace loom {
namespace {

Gpt2Config tiny_config() {
  Gpt2Config c;
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.init_std = 0.3f;  // large enough that every path carries gradient
  return c;
}

void fill_batch(Tensor& tokens, Tensor& targets, int64_t vocab, uint64_t seed) {
  RandomStream rng(seed, "test.batch");
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % vocab);
  }
}

TEST(Gpt2, WholeModelGradCheckInDouble) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  Gpt2 model(tiny_config());
  model.build(DType::kF64, Device::cpu(), 3);
  for (const auto& p : model.params().parameters()) {  // non-trivial LayerNorm gains and biases
    Tensor r = testing::random_f64(p->shape, p->name + ".perturb", 0.2);
    for (int64_t i = 0; i < p->numel(); ++i) p->value.data<double>()[i] += r.data<double>()[i];
  }
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32), targets = Tensor::empty({2, 5}, DType::kI32);
  fill_batch(tokens, targets, 11, 1);
  testing::GradCheck gc{[&] { return model.forward(ctx, tokens, targets); },
                        [&] { model.backward(ctx); return Tensor(); },
                        [&] { model.clear_cache(); }};
  gc.run(model.params(), nullptr);
}

TEST(Gpt2, InitialLossIsNearLogVocab) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_config();
  c.vocab_size = 256;
  c.d_model = 32;
  c.init_std = 0.02f;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 1);
  Tensor tokens = Tensor::empty({4, 6}, DType::kI32), targets = Tensor::empty({4, 6}, DType::kI32);
  fill_batch(tokens, targets, 256, 2);
  EXPECT_NEAR(model.forward(ctx, tokens, targets), std::log(256.0), 0.05);
}

// Runs forward+backward and returns a copy of the flat gradient buffer.
std::vector<float> gradients(Recompute recompute, int threads) {
  ThreadPool pool(threads);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_config();
  c.recompute = recompute;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  Tensor tokens = Tensor::empty({3, 6}, DType::kI32), targets = Tensor::empty({3, 6}, DType::kI32);
  fill_batch(tokens, targets, 11, 3);
  model.forward(ctx, tokens, targets);
  model.backward(ctx);
  return model.params().grads().to_vector();
}

TEST(Gpt2, RunsAreBitwiseRepeatable) {
  const std::vector<float> a = gradients(Recompute::kNone, 3);
  const std::vector<float> b = gradients(Recompute::kNone, 3);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

// Bytes of the distinct buffers among `tensors`: a buffer cached in two slots (the attention
// output is also its projection's input) is memory once.
int64_t distinct_bytes(const std::vector<const Tensor*>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const Tensor* t : tensors)
    if (t->defined() && seen.insert(t->raw()).second)
      bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

struct RecomputeRun {
  std::vector<double> losses;
  std::vector<float> grads;
  int64_t cache_bytes = 0;  // what the first micro-batch's forward kept for backward
};

// Gradient accumulation over two micro-batches (scale 1/2 each). After the first forward the
// activations are stashed, measured and unstashed, as a pipeline schedule would.
RecomputeRun run_mode(Recompute mode) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2Config c = tiny_config();
  c.recompute = mode;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 5);
  RecomputeRun run;
  for (uint64_t m = 0; m < 2; ++m) {
    Tensor tokens = Tensor::empty({3, 6}, DType::kI32), targets = Tensor::empty({3, 6}, DType::kI32);
    fill_batch(tokens, targets, 11, 10 + m);
    run.losses.push_back(model.forward(ctx, tokens, targets));
    std::vector<Tensor> stash = model.stash_activations();
    if (m == 0) {
      std::vector<const Tensor*> cached;
      for (const Tensor& t : stash) cached.push_back(&t);
      run.cache_bytes = distinct_bytes(cached);
    }
    model.unstash_activations(std::move(stash));
    model.backward(ctx, 0.5);
  }
  run.grads = model.params().grads().to_vector();
  return run;
}

TEST(Gpt2, RecomputationModesGiveBitwiseIdenticalLossAndGradients) {
  const RecomputeRun none = run_mode(Recompute::kNone);
  for (Recompute mode : {Recompute::kFull, Recompute::kSelective}) {
    SCOPED_TRACE(recompute_name(mode));
    const RecomputeRun run = run_mode(mode);
    ASSERT_EQ(run.losses.size(), none.losses.size());
    for (size_t m = 0; m < run.losses.size(); ++m)
      EXPECT_EQ(std::memcmp(&run.losses[m], &none.losses[m], sizeof(double)), 0) << "micro-batch " << m;
    ASSERT_EQ(run.grads.size(), none.grads.size());
    EXPECT_EQ(std::memcmp(run.grads.data(), none.grads.data(), none.grads.size() * 4), 0);
  }
}

TEST(Gpt2, RecomputationModesKeepFullLessThanSelectiveLessThanNone) {
  const int64_t none = run_mode(Recompute::kNone).cache_bytes;
  const int64_t full = run_mode(Recompute::kFull).cache_bytes;
  const int64_t selective = run_mode(Recompute::kSelective).cache_bytes;
  RecordProperty("bytes_none", std::to_string(none));  // in --gtest_output's report
  RecordProperty("bytes_selective", std::to_string(selective));
  RecordProperty("bytes_full", std::to_string(full));
  EXPECT_LT(full, selective);
  EXPECT_LT(selective, none);
}

// One block's cache, exactly: N = B·T rows, C channels, NH heads; counts in floats.
//   none:      x, ln_1 out, qkv (3C), attention out, x1, ln_2 out, h (4C), GELU out (4C) = 16·N·C,
//              + mean and rstd of both LayerNorms (4·N) + the attention's log-sum-exp (B·NH·T)
//   selective: less ln_1 out, ln_2 out and GELU out = 10·N·C + 4·N + B·NH·T
//   full:      the input, N·C
TEST(Gpt2Block, CacheBytesPerRecomputationMode) {
  const Gpt2Config c = tiny_config();
  const int64_t B = 3, T = 6, N = B * T, C = c.d_model, NH = c.n_heads;
  const int64_t expected_none = 4 * (16 * N * C + 4 * N + B * NH * T);
  const int64_t expected_selective = 4 * (10 * N * C + 4 * N + B * NH * T);
  const int64_t expected_full = 4 * N * C;
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective}) {
    SCOPED_TRACE(recompute_name(mode));
    ThreadPool pool(1);
    Context ctx{&pool, Device::cpu(), DType::kF32};
    Gpt2Config mc = c;
    mc.recompute = mode;
    ParameterStore store;
    Gpt2Block block(store, "blocks.0", mc);
    store.allocate(DType::kF32, Device::cpu());
    store.initialize(4);
    Tensor x = Tensor::empty({B, T, C}, DType::kF32);
    init_normal(x, 1, "x", 0.0f, 1.0f);
    block.forward(ctx, x);
    std::vector<Tensor*> slots;
    block.collect_cache(slots);
    const int64_t bytes = distinct_bytes({slots.begin(), slots.end()});
    const int64_t expected = mode == Recompute::kNone   ? expected_none
                             : mode == Recompute::kFull ? expected_full
                                                        : expected_selective;
    EXPECT_EQ(bytes, expected);
    RecordProperty(std::string("bytes_") + recompute_name(mode), std::to_string(bytes));
  }
}

TEST(Recompute, NamesRoundTripAndABadNameIsAnError) {
  for (Recompute mode : {Recompute::kNone, Recompute::kFull, Recompute::kSelective})
    EXPECT_EQ(parse_recompute(recompute_name(mode)), mode);
  try {
    parse_recompute("partial");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'partial' is not one of none, full, selective"),
              std::string::npos) << e.what();
  }
}

// Document starts of (B, T) tokens ending documents at `eot` (data/documents.h's rule, here
// without the data library).
Tensor starts_of(const Tensor& tokens, int32_t eot) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1);
  Tensor starts = Tensor::empty({B, T}, DType::kI32);
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      starts.data<int32_t>()[b * T + t] = start;
      if (tokens.data<int32_t>()[b * T + t] == eot) start = static_cast<int32_t>(t + 1);
    }
  }
  return starts;
}

// data.reset_position_ids with data.document_mask: a document packed after another reads exactly
// as it does at the start of a sequence — the same logits at each of its tokens, to rounding —
// for GPT-2's learned positions (its tokens read the rows of their places in the document), and
// for Llama's rotary ones with the mask alone (relative: nothing to reset). Without the reset
// GPT-2's packed document reads other rows of wpe and its logits part from those at the start.
TEST(Gpt2, ResetPositionsReadEachDocumentAsIfItBeganTheSequence) {
  const int32_t eot = 10;
  // Row 0: [1 2 3 eot | 4 5 6 7]; row 1 begins with the second document: [4 5 6 7 eot 2 9 2].
  Tensor tokens = Tensor::empty({2, 8}, DType::kI32);
  const int32_t ids[16] = {1, 2, 3, eot, 4, 5, 6, 7, 4, 5, 6, 7, eot, 2, 9, 2};
  std::memcpy(tokens.data<int32_t>(), ids, sizeof ids);
  const Tensor starts = starts_of(tokens, eot);
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt2");
    Gpt2Config c = tiny_config();
    c.max_seq_len = 8;
    if (llama) {
      c.arch = Arch::kLlama;
      c.n_kv_heads = 1;
      c.ffn_hidden = 12;
      c.rope_theta = 10.0;
    }
    ThreadPool pool(2);
    Gpt2 model(c);
    model.build(DType::kF32, Device::cpu(), 7);
    // The largest difference between the second document's logits in row 0 (positions 4..7)
    // and in row 1 (positions 0..3).
    const auto packed_vs_first = [&](bool reset) {
      Context ctx{&pool, Device::cpu(), DType::kF32};
      ctx.documents = &starts;
      ctx.reset_position_ids = reset;
      const Tensor logits = model.logits(ctx, tokens);
      const int64_t V = c.vocab_size;
      double worst = 0;
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t v = 0; v < V; ++v)
          worst =
              std::max(worst, std::abs(static_cast<double>(logits.data<float>()[(4 + t) * V + v] -
                                                           logits.data<float>()[(8 + t) * V + v])));
      return worst;
    };
    EXPECT_LT(packed_vs_first(true), 1e-5);
    if (llama)
      EXPECT_EQ(packed_vs_first(true), packed_vs_first(false));  // no table: nothing changes
    else
      EXPECT_GT(packed_vs_first(false), 1e-2);
  }
}

// The gradient with positions reset at each document against finite differences in double:
// wpe's rows gather the gradient of every token at their place in its document.
TEST(Gpt2, ResetPositionsGradCheckInDouble) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  Gpt2 model(tiny_config());
  model.build(DType::kF64, Device::cpu(), 3);
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32), targets = Tensor::empty({2, 5}, DType::kI32);
  fill_batch(tokens, targets, 11, 2);
  const int32_t eot = 10;
  tokens.data<int32_t>()[1] = eot;  // row 0: documents at 0 and 2; row 1: at 0, 3 and 4
  tokens.data<int32_t>()[7] = eot;
  tokens.data<int32_t>()[8] = eot;
  const Tensor starts = starts_of(tokens, eot);
  ctx.documents = &starts;
  ctx.reset_position_ids = true;
  testing::GradCheck gc{[&] { return model.forward(ctx, tokens, targets); },
                        [&] {
                          model.backward(ctx);
                          return Tensor();
                        },
                        [&] { model.clear_cache(); }};
  gc.run(model.params(), nullptr);
  // Only rows 0..2 of wpe are read (the longest document has 3 tokens): rows 3.. get nothing.
  const Parameter* wpe = model.params().find("wpe.weight");
  ASSERT_NE(wpe, nullptr);
  const int64_t C = tiny_config().d_model;
  for (int64_t i = 3 * C; i < wpe->numel(); ++i) ASSERT_EQ(wpe->grad.data<double>()[i], 0.0) << i;
  double row2 = 0;
  for (int64_t i = 2 * C; i < 3 * C; ++i) row2 += std::abs(wpe->grad.data<double>()[i]);
  EXPECT_GT(row2, 0);
}

TEST(Gpt2, ParameterNamesAndCount) {
  Gpt2 model(tiny_config());
  const auto& ps = model.params().parameters();
  int64_t total = 0;
  for (const auto& p : ps) total += p->numel();
  EXPECT_EQ(total, tiny_config().num_parameters());
  EXPECT_NE(model.params().find("blocks.1.attn.qkv.weight"), nullptr);
  EXPECT_NE(model.params().find("blocks.0.mlp.proj.bias"), nullptr);
  EXPECT_NE(model.params().find("ln_f.weight"), nullptr);
  EXPECT_EQ(model.params().find("lm_head.weight"), nullptr);  // tied to wte.weight
}

TEST(Gpt2, ConfigErrorsNameTheField) {
  Gpt2Config c = tiny_config();
  c.n_heads = 3;
  try {
    Gpt2 model(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_heads = 3 does not divide model.d_model = 8"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace loom
