// Sampling (train/generate.h): decoding through the key/value cache (Gpt2::decode) computes what
// running the whole context does — the logits of every new position to float rounding, and the
// same greedy and sampled tokens, past max_seq_len too (where the window slides) — for GPT-2 and
// for Llama's blocks (rotary positions, shared key/value heads, tied and untied heads).
#include "train/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "base/error.h"

namespace loom {
namespace {

Gpt2Config small(bool llama, bool tied) {
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
  }
  return c;
}

struct Case {
  bool llama, tied;
};

class Decode : public ::testing::TestWithParam<Case> {};

TEST_P(Decode, CachedLogitsAreTheWholeContextsLogits) {
  ThreadPool pool(2);
  Context ctx{&pool, Device::cpu(), DType::kF32};
  Gpt2 model(small(GetParam().llama, GetParam().tied));
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
  Gpt2 model(small(GetParam().llama, GetParam().tied));
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

INSTANTIATE_TEST_SUITE_P(Models, Decode,
                         ::testing::Values(Case{false, true}, Case{true, true}, Case{true, false}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return std::string(param_info.param.llama ? "llama" : "gpt2") +
                                  (param_info.param.tied ? "_tied" : "_untied");
                         });

}  // namespace
}  // namespace loom
