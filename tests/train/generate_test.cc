// Sampling (train/generate.h): decoding through the key/value cache (Gpt2::decode) computes what
// running the whole context does — the logits of every new position to float rounding, and the
// same greedy and sampled tokens, past max_seq_len too (where the window slides) — for GPT-2 and
// for Llama's blocks (rotary positions, shared key/value heads, tied and untied heads) and Qwen
// 3's (per-head query/key norms, heads wider than their share of d_model: a cache as wide as the
// heads), and Mistral's sliding window (the cache's keys past a query's window left out, as the
// whole context's attention leaves them out).
#include "train/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "base/error.h"

namespace loom {
namespace {

Gpt2Config small(bool llama, bool tied, bool qwen3 = false, int64_t window = 0,
                 int64_t full_every = 0, bool olmo2 = false, bool gemma3 = false) {
  Gpt2Config c;
  c.vocab_size = 37;
  c.max_seq_len = 20;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.init_std = 0.3f;  // logits far apart: no near-ties for the greedy comparison
  c.tie_embeddings = tied;
  if (llama) {
    c.arch = Arch::kLlama;
    c.n_kv_heads = 2;
    c.ffn_hidden = 40;
    c.rope_theta = 100;
    c.qk_norm = qwen3;
    c.head_width = qwen3 ? 12 : 0;  // queries 48 wide from 32 channels
    c.sliding_window = window;
    c.full_attention_every = full_every;
    // OLMo 2: norms after the attention and the MLP, query/key norms over all the heads
    c.post_norm = c.qk_norm_full = olmo2;
    c.qk_norm = c.qk_norm || olmo2;
    if (gemma3) {  // sandwich norms, GeGLU, the scaled embedding, the windowed blocks' own base
      c.sandwich_norm = true;
      c.ffn_activation = GatedActivation::kGeluTanh;
      c.embedding_multiplier = 5.0f;
      c.rope_local_theta = 10000;
    }
  }
  return c;
}

struct Case {
  bool llama, tied, qwen3 = false;
  int64_t window = 0, full_every = 0;
  bool olmo2 = false, gemma3 = false;
};

class Decode : public ::testing::TestWithParam<Case> {};

TEST_P(Decode, CachedLogitsAreTheWholeContextsLogits) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model(small(GetParam().llama, GetParam().tied, GetParam().qwen3, GetParam().window,
                   GetParam().full_every, GetParam().olmo2, GetParam().gemma3));
  model.build(DType::kF32, Device::cpu(), 4);
  Tensor all = Tensor::empty({1, 20}, DType::kI32);
  for (int i = 0; i < 20; ++i) all.data<int32_t>()[i] = (i * 11 + 3) % 37;
  const Tensor whole = model.logits(ctx, all);  // (1, 20, V)
  // Feed the same tokens as a prompt of 7, then one at a time, then the last 5 together.
  KvCache cache;
  std::vector<float> got;
  for (const auto& [begin, n] : std::vector<std::pair<int, int>>{{0, 7}, {7, 1}, {8, 1}, {9, 6}, {15, 5}}) {
    Tensor part = Tensor::empty({1, n}, DType::kI32);
    std::copy(all.data<int32_t>() + begin, all.data<int32_t>() + begin + n, part.data<int32_t>());
    const std::vector<float> l = model.decode(ctx, part, cache).to_vector();
    got.insert(got.end(), l.begin(), l.end());
  }
  EXPECT_EQ(cache.length, 20);
  const std::vector<float> want = whole.to_vector();
  ASSERT_EQ(got.size(), want.size());
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::abs(static_cast<double>(want[i])));
    max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_GT(max_ref, 0.5);
  EXPECT_LE(max_diff, 1e-5 * max_ref);
  Tensor one = Tensor::empty({1, 1}, DType::kI32);
  one.data<int32_t>()[0] = 1;
  EXPECT_THROW(model.decode(ctx, one, cache), Error);  // past max_seq_len
}

TEST_P(Decode, SamplingWithTheCacheIsSamplingWithout) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model(small(GetParam().llama, GetParam().tied, GetParam().qwen3, GetParam().window,
                   GetParam().full_every, GetParam().olmo2, GetParam().gemma3));
  model.build(DType::kF32, Device::cpu(), 6);
  for (const double temperature : {0.0, 0.8}) {
    SampleOptions o;
    o.tokens = 45;  // 3 + 45 tokens: the 20-token window slides for the last 28
    o.temperature = temperature;
    o.top_k = 10;
    RandomStream a(9, "sample"), b(9, "sample");
    const std::vector<int32_t> cached = generate(ctx, model, {5, 6, 7}, o, a);
    o.kv_cache = false;
    const std::vector<int32_t> plain = generate(ctx, model, {5, 6, 7}, o, b);
    EXPECT_EQ(cached, plain) << "temperature " << temperature;
    EXPECT_EQ(cached.size(), 48u);
  }
}

// --stop-token ends the generation after that token (kept); --top-p keeps each draw within the
// nucleus of that step's distribution — the fewest most likely tokens reaching top_p of it,
// recomputed here from the model's logits — and a vanishing top_p is the greedy choice.
TEST(Sampling, StopTokenEndsItAndTopPDrawsFromTheNucleus) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  const Gpt2Config config = small(false, true);
  Gpt2 model(config);
  model.build(DType::kF32, Device::cpu(), 6);
  const std::vector<int32_t> prompt = {5, 6, 7};
  SampleOptions greedy;
  greedy.tokens = 12;
  greedy.temperature = 0;
  RandomStream unused(1, "sample");
  const std::vector<int32_t> g = generate(ctx, model, prompt, greedy, unused);
  ASSERT_EQ(g.size(), 15u);
  SampleOptions stopping = greedy;
  stopping.stop_token = g[4];  // the second generated token: the output ends at its first one
  const auto first = std::find(g.begin() + 3, g.end(), g[4]);
  EXPECT_EQ(generate(ctx, model, prompt, stopping, unused),
            std::vector<int32_t>(g.begin(), first + 1));

  SampleOptions narrow;
  narrow.tokens = 12;
  narrow.top_p = 1e-9;
  RandomStream r1(3, "sample");
  EXPECT_EQ(generate(ctx, model, prompt, narrow, r1), g);

  SampleOptions nucleus;
  nucleus.tokens = 16;
  nucleus.top_p = 0.6;
  RandomStream r2(4, "sample");
  const std::vector<int32_t> s = generate(ctx, model, prompt, nucleus, r2);
  ASSERT_EQ(s.size(), 19u);
  const int64_t V = config.vocab_size;
  int64_t not_argmax = 0;
  for (size_t i = 3; i < s.size(); ++i) {
    Tensor context = Tensor::empty({1, static_cast<int64_t>(i)}, DType::kI32);
    std::copy(s.begin(), s.begin() + static_cast<int64_t>(i), context.data<int32_t>());
    const Tensor logits = model.logits(ctx, context);
    const float* row = logits.data<float>() + (static_cast<int64_t>(i) - 1) * V;
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    double total = 0;
    for (int64_t v = 0; v < V; ++v) total += std::exp(row[v] - row[order[0]]);
    double kept = 0;
    std::vector<int32_t> core;
    for (int32_t v : order) {
      if (kept >= 0.6 * total) break;
      kept += std::exp(row[v] - row[order[0]]);
      core.push_back(v);
    }
    EXPECT_NE(std::find(core.begin(), core.end(), s[i]), core.end())
        << "token " << i << " = " << s[i] << " outside the nucleus of " << core.size();
    not_argmax += s[i] != order[0] ? 1 : 0;
  }
  EXPECT_GT(not_argmax, 0);  // it samples
  SampleOptions bad = nucleus;
  bad.top_p = 0;
  EXPECT_THROW(generate(ctx, model, prompt, bad, r2), Error);
  bad = nucleus;
  bad.stop_token = V;
  EXPECT_THROW(generate(ctx, model, prompt, bad, r2), Error);
}

// SampleOptions::vocab: with a tokenizer's vocabulary smaller than the model's padded one, no id
// past it is drawn, greedily or not — here the 8 rows past it are made the likeliest for every
// context: the final LayerNorm's bias all 10, their (tied) head rows all 1, so their logits are
// about 10·C while the others' stay small.
TEST(Sampling, IdsPastTheTokenizersVocabularyAreNeverDrawn) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  const Gpt2Config config = small(false, true);
  const int64_t V = config.vocab_size, kept = V - 8, C = config.d_model;
  Gpt2 model(config);
  model.build(DType::kF32, Device::cpu(), 6);
  float* wte = model.params().get("wte.weight").value.data<float>();
  float* bias = model.params().get("ln_f.bias").value.data<float>();
  std::fill(bias, bias + C, 10.0f);
  std::fill(wte + kept * C, wte + V * C, 1.0f);
  const std::vector<int32_t> prompt = {5, 6, 7};
  for (const double temperature : {0.0, 1.0}) {
    SampleOptions all, in_vocab;
    all.tokens = in_vocab.tokens = 20;
    all.temperature = in_vocab.temperature = temperature;
    in_vocab.vocab = kept;
    RandomStream r1(9, "sample"), r2(9, "sample");
    const std::vector<int32_t> padded = generate(ctx, model, prompt, all, r1);
    const std::vector<int32_t> limited = generate(ctx, model, prompt, in_vocab, r2);
    EXPECT_GT(std::count_if(padded.begin() + 3, padded.end(), [&](int32_t t) { return t >= kept; }),
              0)
        << "the padding rows are the likeliest without the limit";
    for (size_t i = 3; i < limited.size(); ++i) EXPECT_LT(limited[i], kept) << i;
  }
  SampleOptions bad;
  bad.vocab = V + 1;
  RandomStream r(1, "sample");
  EXPECT_THROW(generate(ctx, model, prompt, bad, r), Error);
}

INSTANTIATE_TEST_SUITE_P(Models, Decode,
                         ::testing::Values(Case{false, true}, Case{true, true}, Case{true, false},
                                           Case{true, true, true}, Case{true, true, false, 6},
                                           Case{true, true, false, 6, 2},
                                           Case{true, false, false, 0, 0, true},
                                           Case{true, true, true, 6, 2, false, true}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return std::string(param_info.param.gemma3           ? "gemma3"
                                              : param_info.param.olmo2          ? "olmo2"
                                              : param_info.param.full_every > 0 ? "alternating"
                                              : param_info.param.window > 0     ? "mistral"
                                              : param_info.param.qwen3          ? "qwen3"
                                              : param_info.param.llama          ? "llama"
                                                                                : "gpt2") +
                                  (param_info.param.tied ? "_tied" : "_untied");
                         });

}  // namespace
}  // namespace loom
