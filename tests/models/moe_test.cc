// Mixture of experts (nn/moe_mlp.h) in Llama's blocks: the module's gradients — the routing
// weights' and the balance loss's included — against finite differences in double; the balance
// loss's value where it is known; the routing against a direct computation; parameter names and
// count; what is refused. (The whole model's gradients and recomputation modes bit for bit:
// llama_test.cc.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../nn/gradcheck.h"
#include "base/error.h"
#include "harness/error_of.h"
#include "models/gpt2.h"
#include "nn/moe_mlp.h"
#include "tensor/rng.h"

namespace loom {
namespace {

Gpt2Config tiny_moe(int64_t experts = 4, int64_t top_k = 2) {
  Gpt2Config c;
  c.arch = Arch::kLlama;
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.ffn_hidden = 6;
  c.rope_theta = 10.0;
  c.init_std = 0.3f;
  c.moe_experts = experts;
  c.moe_top_k = top_k;
  c.moe_aux_loss_coef = 0.25f;  // large, so its gradient is far above the check's tolerance
  return c;
}

// The module alone: L = Σ y ∘ R + coef · balance loss, its input's and every weight's gradient.
void module_grad_check(int64_t experts, int64_t top_k, double backward_scale, int64_t shared = 0,
                       MoeCapacity capacity = {}, RouterScore score = RouterScore::kSoftmax,
                       int64_t groups = 1, int64_t group_topk = 1, double scale = 1,
                       bool normalize = true) {
  SCOPED_TRACE(::testing::Message() << "top " << top_k << " of " << experts);
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  ctx.backward_scale = backward_scale;
  ParameterStore store;
  const float coef = 0.3f;
  // The router z-loss is a softmax's: sigmoid scores take none.
  const float z = score == RouterScore::kSoftmax ? 0.2f : 0.0f;
  MoeMlp moe(store, "mlp",
             {6, 5, experts, top_k, shared, capacity, score, groups, group_topk, scale, normalize},
             {coef, z}, 0.5f, 0.4f);
  store.allocate(DType::kF64, Device::cpu());
  store.initialize(7);
  Tensor x = testing::random_f64({2, 5, 6}, "x");
  const Tensor r = testing::random_f64({2, 5, 6}, "r");
  testing::GradCheck gc{
      [&] { return backward_scale * (testing::dot(moe.forward(ctx, x), r) + moe.aux_loss()); },
      [&] {
        Tensor dy = r.clone();
        for (int64_t i = 0; i < dy.numel(); ++i) dy.data<double>()[i] *= backward_scale;
        return moe.backward(ctx, dy);
      },
      [&] { moe.clear_cache(); }};
  gc.run(store, &x);
  // Every expert took tokens (else its weights' check checked nothing): 20 choices, 4 experts.
  moe.forward(ctx, x);
  for (int64_t n : *moe.expert_tokens()) EXPECT_GT(n, 0);
  // With a capacity, some choices were dropped (else the drops' gradients went unchecked).
  if (!capacity.dropless()) {
    EXPECT_GT(moe.dropped_pairs(), 0);
  }
}

TEST(MoeMlp, GradCheckInDoubleTopTwoOfFour) {
  module_grad_check(4, 2, 1.0);
}
TEST(MoeMlp, GradCheckInDoubleTopOneOfThree) {
  module_grad_check(3, 1, 1.0);
}
TEST(MoeMlp, GradCheckInDoubleEveryExpert) {
  module_grad_check(3, 3, 1.0);
}
// backward's dy at a loss scale (gradient accumulation's 1 / micro-batches, fp16's scale): the
// balance loss's gradient follows at ctx.backward_scale.
TEST(MoeMlp, GradCheckInDoubleAtALossScale) {
  module_grad_check(4, 2, 0.375);
}
// Two shared experts (one SwiGLU 2 × 5 wide) beside the routed ones.
TEST(MoeMlp, GradCheckInDoubleWithSharedExperts) {
  module_grad_check(4, 2, 1.0, 2);
}
// An expert capacity of 2 of each sequence's 10 choices (factor 0.8): the dropped pairs add
// nothing, and their routing weights' gradients are zero; the rest as dropless.
// DeepSeek-V3's sigmoid scores: the weights their normalised chosen scores, the balance loss's P
// each token's scores normalised over all experts — through both into the router.
TEST(MoeMlp, GradCheckInDoubleWithSigmoidScores) {
  module_grad_check(4, 2, 1.0, 0, {}, RouterScore::kSigmoid);
  module_grad_check(3, 1, 0.375, 1, {}, RouterScore::kSigmoid);
  module_grad_check(4, 2, 1.0, 0, {0.8, TokenDropPolicy::kProbs}, RouterScore::kSigmoid);
}
// Group-limited routing (2 groups of 2, the best one's pair; 4 groups of 1, the best two) with
// the weights scaled by 2.5: the scale reaches the router through the normalisation.
TEST(MoeMlp, GradCheckInDoubleWithGroupsAndScaledWeights) {
  module_grad_check(4, 2, 1.0, 0, {}, RouterScore::kSigmoid, 2, 1, 2.5);
  module_grad_check(4, 2, 0.5, 0, {}, RouterScore::kSoftmax, 4, 2, 2.5);
}
// The chosen scores not normalised over the k (transformers' norm_topk_prob = false): softmax
// scores (Qwen-MoE's, OLMoE's), sigmoid ones, scaled, with a shared expert and a capacity.
TEST(MoeMlp, GradCheckInDoubleWithWeightsNotNormalised) {
  module_grad_check(4, 2, 1.0, 0, {}, RouterScore::kSoftmax, 1, 1, 1, false);
  module_grad_check(4, 3, 0.5, 1, {}, RouterScore::kSigmoid, 1, 1, 2.5, false);
  module_grad_check(4, 2, 1.0, 0, {0.8, TokenDropPolicy::kProbs}, RouterScore::kSoftmax, 1, 1, 1,
                    false);
}
TEST(MoeMlp, GradCheckInDoubleWithExpertCapacity) {
  module_grad_check(4, 2, 1.0, 0, {0.8, TokenDropPolicy::kProbs});
  module_grad_check(4, 2, 0.5, 1, {0.8, TokenDropPolicy::kPosition});
}

// The routing as its definition says, computed here from the router's logits: each token's
// top-k of the softmax (ties to the lower index), its output the weighed sum of its experts'.
// The layer's output against its definition: each token's top two experts by p_e (+ bias[e] with
// balancing biases), their outputs weighed by their probabilities renormalised over the two.
// With an expert capacity, per sequence each expert takes the `capacity` choices of highest
// weight (to 1/1024; ties: the earlier token) or of the earliest tokens, and the rest add nothing.
// With group-limited routing the two come from the best `group_topk` of `groups` groups of
// experts, a group scored by the sum of its best 2 / group_topk scores; the weights are scaled.
void expect_output_is_the_renormalised_top_two_sum(const std::vector<float>& bias,
                                                   MoeCapacity capacity = {},
                                                   RouterScore scores = RouterScore::kSoftmax,
                                                   int64_t E = 5, int64_t groups = 1,
                                                   int64_t group_topk = 1, double scale = 1,
                                                   bool normalize = true) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  const int64_t C = 6, K = 2, B = 2, T = 7;
  ParameterStore store;
  MoeMlp moe(store, "mlp", {C, 4, E, K, 0, capacity, scores, groups, group_topk, scale, normalize},
             {}, 0.5f, 0.4f);
  ParameterStore expert_store;  // the same experts again, run on every token
  std::vector<std::unique_ptr<SwiGluMlp>> experts;
  for (int64_t e = 0; e < E; ++e)
    experts.push_back(std::make_unique<SwiGluMlp>(expert_store, "mlp.experts." + std::to_string(e),
                                                  C, 4, 0.5f, 0.4f));
  store.allocate(DType::kF64, Device::cpu());
  store.initialize(3);
  expert_store.allocate(DType::kF64, Device::cpu());
  expert_store.initialize(3);  // same names, same seed: the same values
  if (!bias.empty()) moe.set_expert_bias(bias.data());
  const Tensor x = testing::random_f64({B, T, C}, "x");
  const Tensor y = moe.forward(ctx, x);
  const Parameter& router = *store.find("mlp.router.weight");
  std::vector<Tensor> all;
  for (auto& e : experts) all.push_back(e->forward(ctx, x));
  std::vector<int64_t> chose(B * T * K);  // each token's two experts
  std::vector<double> weight(B * T * K);  // and their weights
  for (int64_t t = 0; t < B * T; ++t) {
    std::vector<double> logit(E), p(E);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < C; ++c)
        logit[e] += router.value.data<double>()[e * C + c] * x.data<double>()[t * C + c];
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logit[e]);
    for (int64_t e = 0; e < E; ++e)
      p[e] = scores == RouterScore::kSigmoid ? 1 / (1 + std::exp(-logit[e]))
                                             : std::exp(logit[e]) / sum;
    const auto score = [&](int64_t e) { return p[e] + (bias.empty() ? 0.0 : bias[e]); };
    // The candidates: the experts of the best group_topk groups (ties to the lower group).
    const int64_t per_group = E / groups;
    std::vector<double> group_score(groups);
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<double> in_group;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) in_group.push_back(score(e));
      std::sort(in_group.rbegin(), in_group.rend());
      for (int64_t i = 0; i < K / group_topk; ++i) group_score[g] += in_group[i];
    }
    std::vector<bool> candidate(E, groups == 1);
    for (int64_t g = 0; g < groups && groups > 1; ++g) {
      int64_t better = 0;
      for (int64_t o = 0; o < groups; ++o)
        better += group_score[o] > group_score[g] || (group_score[o] == group_score[g] && o < g);
      if (better < group_topk)
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) candidate[e] = true;
    }
    int64_t first = -1, second = -1;
    for (int64_t e = 0; e < E; ++e)
      if (candidate[e] && (first < 0 || score(e) > score(first))) first = e;
    for (int64_t e = 0; e < E; ++e)
      if (candidate[e] && e != first && (second < 0 || score(e) > score(second))) second = e;
    chose[t * K] = first;
    chose[t * K + 1] = second;
    const double chosen = normalize ? p[first] + p[second] : 1;
    weight[t * K] = scale * p[first] / chosen;
    weight[t * K + 1] = scale * p[second] / chosen;
  }
  // Which choices their experts take: every one, or per sequence and expert the capacity's best.
  std::vector<bool> taken(B * T * K, true);
  int64_t dropped = 0;
  if (!capacity.dropless()) {
    const int64_t most = static_cast<int64_t>(std::ceil(capacity.factor * T * K / E));
    for (int64_t i = 0; i < B * T * K; ++i) {
      int64_t ahead = 0;  // the sequence's choices of the same expert ranked before this one
      for (int64_t o = (i / (T * K)) * T * K; o < (i / (T * K) + 1) * T * K; ++o) {
        if (o == i || chose[o] != chose[i]) continue;
        const auto rank = [&](int64_t k) { return std::llround(weight[k] * 1024); };  // to 1/1024
        const bool before = capacity.policy == TokenDropPolicy::kPosition
                                ? o < i
                                : rank(o) > rank(i) || (rank(o) == rank(i) && o < i);
        ahead += before;
      }
      taken[i] = ahead < most;
      dropped += !taken[i];
    }
    if (most < T) {
      EXPECT_GT(dropped, 0) << "the capacity dropped nothing: the test checks nothing";
    }
  }
  EXPECT_EQ(moe.dropped_pairs(), dropped);
  for (int64_t t = 0; t < B * T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double want = 0;
      for (int64_t j = 0; j < K; ++j)
        if (taken[t * K + j])
          want += weight[t * K + j] * all[chose[t * K + j]].data<double>()[t * C + c];
      EXPECT_NEAR(y.data<double>()[t * C + c], want, 1e-12) << "token " << t << " channel " << c;
    }
}

TEST(MoeMlp, OutputIsTheRenormalisedTopKSumOfTheExperts) {
  expect_output_is_the_renormalised_top_two_sum({});
}

// Without the normalisation (model.moe_router_norm_topk_prob = false): the two chosen experts'
// outputs weighed by their scores as they are — softmax (Qwen-MoE's) and sigmoid, scaled, with a
// capacity ranking the choices by those weights.
TEST(MoeMlp, WeightsNotNormalisedAreTheChosenScoresThemselves) {
  expect_output_is_the_renormalised_top_two_sum({}, {}, RouterScore::kSoftmax, 5, 1, 1, 1, false);
  expect_output_is_the_renormalised_top_two_sum({}, {}, RouterScore::kSigmoid, 5, 1, 1, 2.5, false);
  expect_output_is_the_renormalised_top_two_sum({}, {0.5, TokenDropPolicy::kProbs},
                                                RouterScore::kSoftmax, 5, 1, 1, 1, false);
}

// Sigmoid scores (DeepSeek-V3): each logit's sigmoid on its own, the top two by score (+ bias),
// weighed by their scores over their sum — with biases and a capacity too.
TEST(MoeMlp, SigmoidScoresChooseAndWeighByEachLogitsSigmoid) {
  expect_output_is_the_renormalised_top_two_sum({}, {}, RouterScore::kSigmoid);
  expect_output_is_the_renormalised_top_two_sum({0.3f, -0.2f, 0.0f, 0.1f, -0.4f}, {},
                                                RouterScore::kSigmoid);
  expect_output_is_the_renormalised_top_two_sum({}, {0.5, TokenDropPolicy::kProbs},
                                                RouterScore::kSigmoid);
  EXPECT_EQ(parse_router_score("sigmoid", "k"), RouterScore::kSigmoid);
  EXPECT_THROW(parse_router_score("relu", "model.moe_router_score_function"), Error);
  // The z-loss is a softmax's log-sum-exp: refused with sigmoid scores, by name.
  ParameterStore store;
  try {
    MoeMlp moe(store, "blocks.0.mlp", {6, 5, 4, 2, 0, {}, RouterScore::kSigmoid}, {0.1f, 0.01f},
               0.5f, 0.4f);
    ADD_FAILURE() << "a z-loss with sigmoid scores accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.mlp: the router z-loss"), std::string::npos)
        << e.what();
  }
}

// Group-limited routing (DeepSeek-V3's node-limited routing) and scaled weights: 6 experts in 3
// groups of 2, a token's two from its best group (scored by the sum of both), or from its best
// two groups (each scored by its best expert) — softmax or sigmoid scores, with biases; the
// weights times 2.5 (DeepSeek-V3's factor).
TEST(MoeMlp, GroupLimitedRoutingTakesTheBestGroupsExpertsAndScalesTheWeights) {
  const std::vector<float> bias = {0.2f, -0.1f, 0.0f, 0.3f, -0.2f, 0.1f};
  for (const RouterScore scores : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (const int64_t group_topk : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << router_score_name(scores) << ", best " << group_topk);
      expect_output_is_the_renormalised_top_two_sum({}, {}, scores, 6, 3, group_topk, 2.5);
      expect_output_is_the_renormalised_top_two_sum(bias, {}, scores, 6, 3, group_topk, 1);
    }
  // One group is plain routing; so are groups of one expert each taken two at a time.
  expect_output_is_the_renormalised_top_two_sum(bias, {}, RouterScore::kSoftmax, 6, 1, 1, 0.5);
  expect_output_is_the_renormalised_top_two_sum(bias, {}, RouterScore::kSoftmax, 6, 6, 2, 1);
  // Groups that cannot serve a top 2 are refused by name.
  for (const std::pair<int64_t, int64_t>& groups :
       {std::pair<int64_t, int64_t>{4, 1}, {3, 3}, {6, 1}}) {
    const std::string error = testutil::error_of([&] {
      ParameterStore store;
      MoeMlp moe(store, "blocks.1.mlp",
                 {6, 5, 6, 2, 0, {}, RouterScore::kSoftmax, groups.first, groups.second}, {}, 0.5f,
                 0.4f);
    });
    EXPECT_NE(error.find("blocks.1.mlp: group-limited routing of 6 experts in " +
                         std::to_string(groups.first) + " groups"),
              std::string::npos)
        << error;
  }
}

// Expert capacity (nn/moe_capacity.h): 14 choices a sequence over 5 experts, each taking 3
// (factor 1) or 2 (factor 0.5) of them, by weight or by position.
TEST(MoeMlp, ExpertCapacityDropsEachSequencesChoicesBeyondIt) {
  for (const double factor : {1.0, 0.5})
    for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
      SCOPED_TRACE(::testing::Message()
                   << "factor " << factor << " " << token_drop_policy_name(policy));
      expect_output_is_the_renormalised_top_two_sum({}, {factor, policy});
      expect_output_is_the_renormalised_top_two_sum({0.3f, -0.2f, 0.0f, 0.1f, -0.4f},
                                                    {factor, policy});
    }
  // A capacity past every sequence's choices of any expert drops nothing: the dropless layer.
  expect_output_is_the_renormalised_top_two_sum({}, {3.0, TokenDropPolicy::kProbs});
}

// keep_within_capacity on choices written out: per sequence, ties to the earlier token.
TEST(MoeCapacity, KeepsEachSequencesBestChoicesPerExpert) {
  // Two sequences of 4 tokens, one choice each, 2 experts: capacity ceil(1 · 4 / 2) = 2.
  const std::vector<int32_t> choice = {0, 0, 0, 1, /**/ 1, 1, 1, 1};
  const std::vector<float> score = {0.5f, 0.9f, 0.7f, 1.0f, /**/ 0.6f, 0.8f, 0.8f, 0.6f};
  std::vector<uint8_t> keep(8);
  EXPECT_EQ(keep_within_capacity(choice, score, 4, 1, 2, {1.0, TokenDropPolicy::kProbs}, keep), 3);
  EXPECT_EQ(keep, (std::vector<uint8_t>{0, 1, 1, 1, /**/ 0, 1, 1, 0}));
  EXPECT_EQ(keep_within_capacity(choice, score, 4, 1, 2, {1.0, TokenDropPolicy::kPosition}, keep),
            3);
  EXPECT_EQ(keep, (std::vector<uint8_t>{1, 1, 0, 1, /**/ 1, 1, 0, 0}));
  // Ties by weight — to 1/1024 — go to the earlier token; dropless keeps all.
  const std::vector<float> level = {0.2499f, 0.25f, 0.2501f, 1, 0.25f, 0.25f, 0.25f, 0.25f};
  keep_within_capacity(choice, level, 4, 1, 2, {1.0, TokenDropPolicy::kProbs}, keep);
  EXPECT_EQ(keep, (std::vector<uint8_t>{1, 1, 0, 1, /**/ 1, 1, 0, 0}));
  EXPECT_EQ(keep_within_capacity(choice, score, 4, 1, 2, {}, keep), 0);
  EXPECT_EQ(keep, std::vector<uint8_t>(8, 1));
  // The capacity counts a sequence's choices: 2 tokens × top 2 of 4 experts, factor 1.5 → 2.
  EXPECT_EQ((MoeCapacity{1.5, TokenDropPolicy::kProbs}.per_sequence(2, 2, 4)), 2);
  EXPECT_EQ((MoeCapacity{1.0, TokenDropPolicy::kProbs}.per_sequence(7, 2, 5)), 3);
  EXPECT_THROW(parse_token_drop_policy("random", "model.moe_token_drop_policy"), Error);
}

// DeepSeek-V3's balancing biases steer the choice only: a token's experts are its top two by
// p_e + bias_e, weighed by their p renormalised. Biases of zeros are none at all.
TEST(MoeMlp, BalancingBiasesChooseTheExpertsButNotTheirWeights) {
  expect_output_is_the_renormalised_top_two_sum({0.3f, -0.2f, 0.0f, 0.1f, -0.4f});
  expect_output_is_the_renormalised_top_two_sum({0.0f, 0.0f, 5.0f, 0.0f, 5.0f});  // 2 and 4 always
  expect_output_is_the_renormalised_top_two_sum({0.0f, 0.0f, 0.0f, 0.0f, 0.0f});
}

// The balancing step: per block, each expert's bias moves by the rate towards the mean load —
// up below it, down above it, not at all on it.
TEST(MoeMlp, BalancingBiasesMoveTowardsTheMeanLoad) {
  std::vector<float> biases = {0.5f, 0.0f, 0.0f, 0.0f, 1.0f, -1.0f};
  // block 0: loads 6, 2, 4 (mean 4); block 1: 3, 3, 3 (balanced)
  update_expert_biases(biases, {6, 2, 4, 3, 3, 3}, 3, 0.25);
  EXPECT_EQ(biases, (std::vector<float>{0.25f, 0.25f, 0.0f, 0.0f, 1.0f, -1.0f}));
  update_expert_biases(biases, {0, 12, 0, 9, 0, 0}, 3, 0.25);
  EXPECT_EQ(biases, (std::vector<float>{0.5f, 0.0f, 0.25f, -0.25f, 1.25f, -0.75f}));
}

// A router of zeros gives every expert the same probability: the ties go to experts 0 .. k−1,
// which take every token, f = E/k for them, P = 1/E for all: the balance loss is exactly 1 —
// and its gradient pushes the router away from the crowded experts.
TEST(MoeMlp, BalanceLossIsOneWhenRoutingIsUniformAndItsGradientSpreadsTokens) {
  ThreadPool pool(1);
  Context ctx{&pool, Device::cpu(), DType::kF64};
  ParameterStore store;
  MoeMlp moe(store, "mlp", {6, 4, 4, 2}, {0.5f, 0.0f}, 0.5f, 0.4f);
  store.allocate(DType::kF64, Device::cpu());
  store.initialize(3);
  Parameter& router = *store.find("mlp.router.weight");
  std::fill(router.value.data<double>(), router.value.data<double>() + router.numel(), 0.0);
  const Tensor x = testing::random_f64({3, 4, 6}, "x");
  moe.forward(ctx, x);
  EXPECT_DOUBLE_EQ(moe.balance_loss(), 1.0);
  EXPECT_DOUBLE_EQ(moe.aux_loss(), 0.5);
  EXPECT_EQ(*moe.expert_tokens(), (std::vector<int64_t>{12, 12, 0, 0}));
  // Only the balance loss's gradient (dy = 0). Per token dL/dp_e = coef / (B·T) · f_e, f =
  // (2, 2, 0, 0); through the softmax at p = 1/4 the logits' gradient is +a for the crowded
  // experts and −a for the idle ones, a = coef / (B·T) / 4: descent moves tokens to the idle.
  // The router's gradient row e is then ±a · Σ_t x_t.
  store.zero_grads();
  moe.backward(ctx, Tensor::zeros({3, 4, 6}, DType::kF64));
  const double a = 0.5 / 12 / 4;
  const double* g = router.grad.data<double>();
  for (int64_t c = 0; c < 6; ++c) {
    double sx = 0;
    for (int64_t t = 0; t < 12; ++t) sx += x.data<double>()[t * 6 + c];
    for (int64_t e = 0; e < 4; ++e)
      EXPECT_NEAR(g[e * 6 + c], (e < 2 ? a : -a) * sx, 1e-15) << "expert " << e << " channel " << c;
  }
}

TEST(MoeLlama, ParametersAreTheExpertsAndTheRouterAndTheirCountIsTheConfigs) {
  Gpt2Config c = tiny_moe(3, 2);
  c.moe_shared_experts = 2;
  Gpt2 model(c);
  model.build(DType::kF32, Device::cpu(), 1);
  int64_t total = 0;
  for (const auto& p : model.params().parameters()) total += p->numel();
  EXPECT_EQ(total, c.num_parameters());
  const ParameterStore& store = model.params();
  ASSERT_NE(store.find("blocks.1.mlp.router.weight"), nullptr);
  EXPECT_EQ(store.find("blocks.1.mlp.router.weight")->shape, (Shape{3, 8}));
  EXPECT_EQ(store.find("blocks.0.mlp.experts.2.fc.weight")->shape, (Shape{12, 8}));
  EXPECT_EQ(store.find("blocks.0.mlp.experts.2.proj.weight")->shape, (Shape{8, 6}));
  EXPECT_EQ(store.find("blocks.0.mlp.shared.fc.weight")->shape, (Shape{2 * 2 * 6, 8}));
  EXPECT_EQ(store.find("blocks.0.mlp.shared.proj.weight")->shape, (Shape{8, 2 * 6}));
  EXPECT_EQ(store.find("blocks.0.mlp.fc.weight"), nullptr);  // no dense MLP
  // Flops count a token's top-k experts and the shared ones, not all of them: beside the dense
  // model's one SwiGLU, one more routed expert and the two shared ones' per layer.
  Gpt2Config dense = c;
  dense.moe_experts = 0;
  dense.moe_shared_experts = 0;
  const double router = 6.0 * c.n_layers * c.d_model * 3;
  EXPECT_DOUBLE_EQ(c.flops_per_token(6),
                   dense.flops_per_token(6) +
                       6.0 * c.n_layers * (1 + 2) * 3 * c.d_model * c.ffn_hidden + router);
}

TEST(MoeLlama, ShapesThatCannotRouteAreErrors) {
  Gpt2Config c = tiny_moe(4, 5);
  EXPECT_THROW(c.validate(), Error);
  c.moe_top_k = 0;
  EXPECT_THROW(c.validate(), Error);
  c = tiny_moe();
  c.moe_aux_loss_coef = -0.1f;
  EXPECT_THROW(c.validate(), Error);
  c = tiny_moe();
  c.arch = Arch::kGpt2;  // GPT-2's blocks stay dense: moe() is Llama's only
  EXPECT_FALSE(c.moe());
}

}  // namespace
}  // namespace loom
