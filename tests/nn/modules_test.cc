// Every module's backward against double-precision finite differences.
#include <gtest/gtest.h>

#include "base/error.h"
#include "gradcheck.h"
#include "nn/causal_self_attention.h"
#include "nn/embedding.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"

namespace loom {
namespace {
using testing::dot;
using testing::GradCheck;
using testing::random_f64;

struct Fixture {
  ThreadPool pool{2};
  Context ctx{&pool, Device::cpu(), DType::kF64};
  ParameterStore store;
  void build() {
    store.allocate(DType::kF64, Device::cpu());
    store.initialize(7);
    // Give zero-initialised biases and unit gains random values so their gradients matter.
    for (const auto& p : store.parameters()) {
      Tensor r = random_f64(p->shape, p->name + ".perturb", 0.3);
      for (int64_t i = 0; i < p->numel(); ++i) p->value.data<double>()[i] += r.data<double>()[i];
    }
  }
};

TEST(ModulesGradCheck, Linear) {
  Fixture f;
  Linear lin(f.store, "lin", 5, 3, true, 0.5f);
  f.build();
  Tensor x = random_f64({2, 3, 5}, "x");
  Tensor r = random_f64({2, 3, 3}, "r");
  GradCheck gc{[&] { return dot(lin.forward(f.ctx, x), r); }, [&] { return lin.backward(f.ctx, r); },
               [&] { lin.clear_cache(); }};
  gc.run(f.store, &x);
}

TEST(ModulesGradCheck, LayerNorm) {
  Fixture f;
  LayerNorm ln(f.store, "ln", 6);
  f.build();
  Tensor x = random_f64({4, 6}, "x", 2.0);
  Tensor r = random_f64({4, 6}, "r");
  GradCheck gc{[&] { return dot(ln.forward(f.ctx, x), r); }, [&] { return ln.backward(f.ctx, r); },
               [&] { ln.clear_cache(); }};
  gc.run(f.store, &x);
}

TEST(ModulesGradCheck, Mlp) {
  Fixture f;
  Mlp mlp(f.store, "mlp", 4, 0.5f, 0.3f);
  f.build();
  Tensor x = random_f64({3, 4}, "x");
  Tensor r = random_f64({3, 4}, "r");
  GradCheck gc{[&] { return dot(mlp.forward(f.ctx, x), r); }, [&] { return mlp.backward(f.ctx, r); },
               [&] { mlp.clear_cache(); }};
  gc.run(f.store, &x);
}

TEST(ModulesGradCheck, CausalSelfAttention) {
  Fixture f;
  CausalSelfAttention attn(f.store, "attn", 8, 2, 0.5f, 0.5f);
  f.build();
  Tensor x = random_f64({2, 5, 8}, "x");
  Tensor r = random_f64({2, 5, 8}, "r");
  GradCheck gc{[&] { return dot(attn.forward(f.ctx, x), r); },
               [&] { return attn.backward(f.ctx, r); }, [&] { attn.clear_cache(); }};
  gc.run(f.store, &x);
}

TEST(ModulesGradCheck, Embedding) {
  Fixture f;
  Embedding emb(f.store, 7, 6, 4, 0.5f);
  f.build();
  Tensor tokens = Tensor::empty({2, 5}, DType::kI32);
  const int32_t ids[] = {1, 6, 3, 3, 0, 2, 2, 5, 6, 1};  // repeats exercise accumulation
  for (int i = 0; i < 10; ++i) tokens.data<int32_t>()[i] = ids[i];
  Tensor r = random_f64({2, 5, 4}, "r");
  GradCheck gc{[&] { return dot(emb.forward(f.ctx, tokens), r); },
               [&] { emb.backward(f.ctx, r); return Tensor(); }, [&] { emb.clear_cache(); }};
  gc.run(f.store, nullptr);
}

TEST(Modules, AttentionRejectsHeadsNotDividingChannels) {
  ParameterStore store;
  try {
    CausalSelfAttention attn(store, "blocks.0.attn", 10, 4, 0.02f, 0.02f);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_heads = 4 does not divide d_model = 10"), std::string::npos)
        << e.what();
  }
}

TEST(Modules, EmbeddingRejectsOutOfVocabularyToken) {
  Fixture f;
  Embedding emb(f.store, 7, 6, 4, 0.5f);
  f.build();
  Tensor tokens = Tensor::zeros({1, 3}, DType::kI32);
  tokens.data<int32_t>()[1] = 7;
  EXPECT_THROW(emb.forward(f.ctx, tokens), Error);
}

TEST(ParameterStore, FlatBuffersNamesAndDecayRule) {
  ParameterStore store;
  Linear lin(store, "blocks.3.attn.qkv", 4, 12, true);
  LayerNorm ln(store, "blocks.3.ln_1", 4);
  store.allocate(DType::kF32, Device::cpu());
  EXPECT_TRUE(store.get("blocks.3.attn.qkv.weight").weight_decay);
  EXPECT_FALSE(store.get("blocks.3.attn.qkv.bias").weight_decay);
  EXPECT_FALSE(store.get("blocks.3.ln_1.weight").weight_decay);
  EXPECT_THROW(store.get("nope"), Error);
  // Views alias the flat buffers.
  Parameter& w = store.get("blocks.3.attn.qkv.weight");
  EXPECT_EQ(w.value.data<float>(), store.values().data<float>() + w.offset);
  EXPECT_EQ(w.grad.data<float>(), store.grads().data<float>() + w.offset);
  EXPECT_THROW(store.add("late", {2}, InitKind::kZeros), Error);
}

}  // namespace
}  // namespace loom
