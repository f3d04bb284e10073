// Llama (model.arch = "llama") under every strategy: each layout trains like one device (losses
// and final parameters within 1e-5 relative; `loom check`'s measure), grouped-query heads split
// over tp with the query heads they serve; a stopped and resumed run continues bit for bit; a
// sharded checkpoint written under one layout resumes under another to the same run. With a
// mixture of experts in its blocks (docs/moe.md) the same, under data parallelism, ZeRO and
// pipelining; tensor and context parallelism and a dense checkpoint refused by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "checkpoint/export.h"
#include "data/dataset.h"
#include "harness/error_of.h"
#include "parallel/run_compare.h"
#include "train/layout_check.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

class LlamaParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_llama_parallel_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 40000, 4000, 3);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  // 4 query heads sharing 2 key/value heads (of size 8), a SwiGLU 80 wide, 4 blocks.
  static Config config() {
    Config c = parse_config(R"(
[model]
arch = "llama"
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 4
n_heads = 4
n_kv_heads = 2
ffn_hidden = 80
rope_theta = 500
[train]
steps = 1000
batch_size = 8
micro_batch_size = 4
lr = 3e-3
warmup_steps = 100
eval_every = 0
save_every = 0
seed = 21
[runtime]
threads_per_rank = 1
)", "llama_parallel_test.toml");
    c.data.train = (root_ / "data" / "train_*.bin").string();
    return c;
  }

  // The same Llama with a mixture of 4 experts of width 24 in each block, 2 per token
  // (nn/moe_mlp.h), and a strong balance loss, so that a layout getting its gradient wrong shows.
  static Config moe_config() {
    Config c = config();
    c.model.ffn_hidden = 24;
    c.model.moe_experts = 4;
    c.model.moe_top_k = 2;
    c.model.moe_aux_loss_coef = 0.1;
    return c;
  }

  // Each layout within 1e-5 (relative) of one device's losses and final parameters, and the
  // reference learning: from about ln 256 down within the steps.
  static void expect_layouts_match_one_device(const Config& c, const std::string& layouts,
                                              size_t count) {
    LayoutCheckOptions o;
    o.steps = 4;
    const LayoutCheckResult r = check_layouts(c, parse_layouts(layouts), o);
    ASSERT_EQ(r.rows.size(), count);
    for (const LayoutCheckRow& row : r.rows) {
      EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
      EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
      EXPECT_LT(row.grad_norm_max_rel_dev, 1e-5) << row.layout;
      EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout << " (" << row.param_largest_tensor << ")";
    }
    ASSERT_EQ(r.reference_losses.size(), 4u);
    EXPECT_NEAR(r.reference_losses.front(), std::log(256.0), 0.1);
    EXPECT_LT(r.reference_losses.back(), r.reference_losses.front() - 0.1);
  }

  static TrainOptions options(const std::string& name) {
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / name).string();
    return o;
  }

  // 4 steps with a checkpoint at 2 (run dirs PREFIXwhole, PREFIXresumed): stopped after step 2
  // and resumed, the run's losses and final weights (in whole checkpoints; sharded ones: the
  // losses) are bit for bit the uninterrupted run's.
  static void expect_resumed_run_bitwise_equal(Config c, const std::string& prefix) {
    c.train.steps = 4;
    c.train.warmup_steps = 2;
    c.train.save_every = 2;
    run_training(c, options(prefix + "whole"));
    TrainOptions first = options(prefix + "resumed");
    first.stop_after = 2;
    run_training(c, first);
    TrainOptions second = options(prefix + "resumed");
    second.resume = "auto";
    run_training(c, second);
    const auto a = testing::read_metrics(root_ / (prefix + "whole"));
    const auto b = testing::read_metrics(root_ / (prefix + "resumed"));
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    if (c.train.checkpoint_format == "sharded") return;
    const fs::path step_4 = fs::path("checkpoints") / "step_4" / "model.safetensors";
    testing::expect_weights_match(root_ / (prefix + "whole") / step_4,
                                  root_ / (prefix + "resumed") / step_4, "resumed", 0.0);
  }

  // `source`'s step-2 checkpoint continued for steps 3 and 4 under `other` (run dir `dir`): its
  // losses and gradient norms (and validation loss, where `source` has one at step 4) those of
  // `source`'s last steps, within rounding.
  static void expect_continued_elsewhere(const std::string& source, const std::string& dir,
                                         Config other) {
    fs::create_directories(root_ / dir / "checkpoints");
    fs::copy(root_ / source / "checkpoints" / "step_2", root_ / dir / "checkpoints" / "step_2",
             fs::copy_options::recursive);
    other.train.steps = 4;
    other.train.warmup_steps = 2;
    TrainOptions o = options(dir);
    o.resume = "auto";
    run_training(other, o);
    const auto want = testing::read_metrics(root_ / source);
    const auto got = testing::read_metrics(root_ / dir);
    ASSERT_EQ(want.size(), 4u) << source;
    ASSERT_EQ(got.size(), 2u) << dir;
    for (size_t i = 0; i < got.size(); ++i) {
      const double loss = want[i + 2]["loss"].get<double>();
      EXPECT_NEAR(got[i]["loss"].get<double>(), loss, 1e-5 * loss) << dir << " step " << i + 3;
      // The gradient norm too: sharded and expert-parallel gradients' squares each counted once.
      const double norm = want[i + 2]["grad_norm"].get<double>();
      EXPECT_NEAR(got[i]["grad_norm"].get<double>(), norm, 1e-6 * norm) << dir << " step " << i + 3;
    }
    if (!want[3].contains("val_loss")) return;
    ASSERT_TRUE(got[1].contains("val_loss")) << dir;
    const double val = want[3]["val_loss"].get<double>();
    EXPECT_NEAR(got[1]["val_loss"].get<double>(), val, 1e-5 * val) << dir;
  }

  static fs::path root_;
};
fs::path LlamaParallel::root_;

TEST_F(LlamaParallel, EveryStrategyMatchesOneDevice) {
  expect_layouts_match_one_device(
      config(),
      "dp=2,zero=1;dp=2,zero=3;tp=2;tp=2,sp=1;pp=2;pp=2,schedule=interleaved,v=2;"
      "pp=2,tp=2,recompute=full;dp=2,tp=2,zero=2,sp=1,recompute=selective;dp=2,pp=2,schedule=gpipe",
      9);
}

// An untied head (model.tie_embeddings = false, lm_head.weight): vocabulary-parallel under tp, on
// the last stage alone under pp (nothing summed with the first stage's wte).
TEST_F(LlamaParallel, AnUntiedHeadUnderEveryStrategyMatchesOneDevice) {
  Config c = config();
  c.model.tie_embeddings = false;
  expect_layouts_match_one_device(
      c, "tp=2;pp=2;pp=2,tp=2,sp=1;dp=2,zero=3;dp=2,pp=2,schedule=interleaved,v=2,mbs=2", 5);
}

// Biases on the queries, keys and values (model.qkv_bias, Qwen 2's), started from a
// Qwen2ForCausalLM that transformers saved with random biases (tests/data/hf_tiny_qwen2): the
// fused bias split over tp in the q, k and v blocks its rows are in, with sequence and context
// parallelism, pipelining and ZeRO-3 — each layout one device's run.
// Three steps of `c` from a tiny Qwen that transformers saved (tests/data/hf_tiny_qwen*: 2 blocks,
// a SwiGLU 48 wide, rope_theta 1e6, epsilon 1e-6), with `edit` applied, under each of `layouts`:
// each within 1e-5 of one device, which starts from the Qwen's own predictions.
void expect_hub_qwen_layouts_match(Config c, const std::string& dir, void (*edit)(ModelConfig&),
                                   const std::string& layouts, size_t count) {
  c.model.n_layers = 2;
  c.model.ffn_hidden = 48;
  c.model.rope_theta = 1e6;
  c.model.norm_eps = 1e-6;
  c.model.max_seq_len = 64;
  edit(c.model);
  c.train.init_from = LOOM_SOURCE_DIR "/tests/data/" + dir;
  LayoutCheckOptions o;
  o.steps = 3;
  const LayoutCheckResult r = check_layouts(c, parse_layouts(layouts), o);
  ASSERT_EQ(r.rows.size(), count);
  for (const LayoutCheckRow& row : r.rows) {
    EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
    EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.grad_norm_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout << " (" << row.param_largest_tensor << ")";
  }
  // The Qwen's own predictions, not the random initialisation's ln 256.
  ASSERT_EQ(r.reference_losses.size(), 3u);
  EXPECT_GT(std::abs(r.reference_losses.front() - std::log(256.0)), 0.05);
}

TEST_F(LlamaParallel, QkvBiasesFromATransformersQwen2UnderEveryLayoutMatchOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_qwen2", [](ModelConfig& m) { m.qkv_bias = true; },
      "tp=2;tp=2,sp=1;cp=2;pp=2,schedule=zb-h1;dp=2,zero=3;"
      "dp=2,tp=2,zero=2,sp=1,recompute=selective",
      6);
}

// Qwen 3's per-head query/key norms (model.qk_norm) and heads wider than their share of d_model
// (model.head_dim = 16: queries 64 wide from 32 channels), started from a Qwen3ForCausalLM that
// transformers saved with random norm gains (tests/data/hf_tiny_qwen3): under tp each rank
// normalises its own heads, so the shared gains' gradients are summed over the group (a layout
// that forgot that sum would fail here); with sequence and context parallelism, pipelining,
// ZeRO-3 and recomputation — each layout one device's run.
TEST_F(LlamaParallel, QkNormsAndWideHeadsFromATransformersQwen3UnderEveryLayoutMatchOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_qwen3",
      [](ModelConfig& m) {
        m.head_dim = 16;
        m.qk_norm = true;
      },
      "tp=2;tp=2,sp=1;cp=2;cp=2,tp=2;pp=2,schedule=zb-h1;dp=2,zero=3;"
      "dp=2,tp=2,zero=2,sp=1,recompute=selective;tp=2,recompute=full",
      8);
}

// Qwen 3's mixture of experts (Qwen3MoeForCausalLM: the norms and wide heads above, 4 experts 24
// wide per block, 2 per token), started from the one transformers saved
// (tests/data/hf_tiny_qwen3_moe): with expert parallelism (both dispatchers), expert tensor
// parallelism, context parallelism and pipelining — each layout one device's run.
TEST_F(LlamaParallel, Qwen3MixtureFromTransformersUnderEveryLayoutMatchesOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_qwen3_moe",
      [](ModelConfig& m) {
        m.head_dim = 16;
        m.qk_norm = true;
        m.moe_experts = 4;
        m.moe_top_k = 2;
        m.ffn_hidden = 24;
      },
      "dp=2,ep=2;dp=2,ep=2,ep_dispatch=all_to_all,zero=1;tp=2,sp=1;cp=2;pp=2;dp=2,tp=2,ep=2,zero=3",
      6);
}

// OLMo 2's reordered norms (model.norm_placement = "post": each branch's output normalised before
// the skip connection adds it) under tensor parallelism — the row-parallel outputs normalised
// once summed, on each rank's rows with sequence parallelism (the gains' gradients then summed
// over tp) — with context parallelism, pipelining, ZeRO and either recomputation (selective
// restores the branches' inputs): each layout one device's run.
TEST_F(LlamaParallel, PostNormsUnderEveryLayoutMatchOneDevice) {
  Config c = config();
  c.model.norm_placement = "post";
  c.model.qk_norm = true;
  expect_layouts_match_one_device(
      c,
      "tp=2;tp=2,sp=1;cp=2,tp=2,sp=1;dp=2,tp=2,zero=2,sp=1,recompute=selective;"
      "tp=2,recompute=full;pp=2,tp=2,sp=1,schedule=zb-h1;dp=2,zero=3,recompute=selective",
      7);
}

// Gemma's block: sandwich norms (model.norm_placement = "sandwich") and GeGLU
// (model.ffn_activation = "gelu_tanh"). Under tp the output norms normalise the row-parallel
// outputs once summed — on each rank's rows with sequence parallelism, their gains' gradients
// then summed over tp with the pre-norms' (a layout that forgot them fails here) — and each rank
// takes the GELU of its slice of the gates; under cp, pp, ZeRO and every recomputation mode,
// each layout one device's run.
TEST_F(LlamaParallel, SandwichNormsAndGeGluUnderEveryLayoutMatchOneDevice) {
  Config c = config();
  c.model.norm_placement = "sandwich";
  c.model.ffn_activation = "gelu_tanh";
  expect_layouts_match_one_device(
      c,
      "tp=2;tp=2,sp=1;cp=2,tp=2,sp=1;dp=2,tp=2,zero=2,sp=1,recompute=selective;"
      "tp=2,recompute=full;pp=2,tp=2,sp=1,schedule=zb-h1;dp=2,zero=3,recompute=selective;cp=2",
      8);
}

// tests/data/hf_tiny_gemma3's shape (tools/make_hf_llama_fixture.py --gemma3).
void tiny_gemma3(ModelConfig& m) {
  m.n_layers = 3;
  m.head_dim = 16;
  m.qk_norm = true;
  m.norm_placement = "sandwich";
  m.ffn_activation = "gelu_tanh";
  m.embedding_multiplier = static_cast<float>(std::sqrt(32.0));
  m.sliding_window = 5;
  m.full_attention_every = 3;
  m.rope_local_theta = 10000;
  m.tie_embeddings = true;
}

// Gemma 3, started from a Gemma3ForCausalLM transformers saved (tests/data/hf_tiny_gemma3): its
// sandwich norms, GeGLU, per-head query/key norms on heads 16 wide, the embedding times √32, a
// window of 5 (of 16 positions) in blocks 0 and 1 turned by a base of 10 000 and block 2 whole
// turned by 1e6 — under tp (the embedding scaled after the vocabulary-parallel lookup's sum),
// sp, cp (the window and both rotary tables on a shard), pp, ZeRO and recomputation, each layout
// one device's run.
TEST_F(LlamaParallel, Gemma3FromTransformersUnderEveryLayoutMatchesOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_gemma3", tiny_gemma3,
      "tp=2;tp=2,sp=1,recompute=selective;cp=2;cp=2,tp=2,sp=1;pp=2,schedule=zb-h1;dp=2,zero=3;"
      "dp=2,tp=2,zero=2,sp=1;tp=2,recompute=full",
      8);
}

// Gemma 3 4B+'s form, started from the text model of a Gemma3ForConditionalGeneration
// (tests/data/hf_tiny_gemma3_mm): the whole-sequence block's rotary frequencies divided by 8
// (model.rope_scaling = "linear"), the windowed blocks' not — the same tables on every rank: tp's
// blocks, cp's shards (all-gather and ring), pp's stages — and 27B's scores scaled by 1/√24
// (model.query_pre_attn_scalar, on each tp rank's query heads), each layout one device's run.
TEST_F(LlamaParallel, Gemma3WithLinearRopeScalingUnderEveryLayoutMatchesOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_gemma3_mm",
      [](ModelConfig& m) {
        tiny_gemma3(m);
        m.rope_scaling = "linear";
        m.rope_scaling_factor = 8;
        m.query_pre_attn_scalar = 24;
      },
      "tp=2,sp=1;cp=2;cp=2,cp_comm=ring;pp=3,schedule=1f1b;dp=2,tp=2,zero=3", 5);
}

// Phi-3's class, started from a Phi3ForCausalLM transformers saved (tests/data/hf_tiny_phi3): its
// fused qkv_proj and gate_up_proj read as Loom's fused weights, then split as every layout splits
// them (tp's heads and hidden columns), a window of 5 — each layout one device's run.
TEST_F(LlamaParallel, Phi3FromTransformersUnderEveryLayoutMatchesOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_phi3",
      [](ModelConfig& m) {
        m.rope_theta = 500;
        m.norm_eps = 1e-5;
        m.tie_embeddings = false;
        m.sliding_window = 5;
      },
      "tp=2,sp=1;cp=2,cp_comm=ring;pp=2,schedule=zb-h1;dp=2,tp=2,zero=3", 4);
}

// OLMoE, started from an OlmoeForCausalLM transformers saved (tests/data/hf_tiny_olmoe): a
// mixture of 4 experts, 2 a token, its chosen weights not normalised, with query/key norms over
// all the heads — under expert parallelism (all-gather and all-to-all), tp (the norms' rows split,
// the experts' widths too), cp, pp and ZeRO, each layout one device's run.
TEST_F(LlamaParallel, OlmoeFromTransformersUnderEveryLayoutMatchesOneDevice) {
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_olmoe",
      [](ModelConfig& m) {
        m.rope_theta = 500;
        m.norm_eps = 1e-5;
        m.tie_embeddings = false;
        m.qk_norm = true;
        m.qk_norm_scope = "full";
        m.moe_experts = 4;
        m.moe_top_k = 2;
        m.moe_router_norm_topk_prob = false;
        m.ffn_hidden = 24;
      },
      "dp=2,ep=2;dp=2,ep=2,ep_dispatch=all_to_all,zero=1;tp=2,sp=1;cp=2;pp=2;"
      "dp=2,tp=2,ep=2,zero=3",
      6);
}

// OLMo 2's whole form, started from an Olmo2ForCausalLM transformers saved with random gains
// (tests/data/hf_tiny_olmo2): post-norms and one RMSNorm over all the query heads and one over
// all the key heads (model.qk_norm_scope = "full") — under data and context parallelism
// (all-gather and ring), pipelining and ZeRO, recomputed or not, and tensor parallelism, which
// splits the norms' rows: each rank's heads normalised by the rows' sums of squares over the tp
// group, its shard of the gains' gradients from the group's Σ weight·dout·x (a rank that took
// its own heads' sums alone would be off by far more than the tolerance here).
TEST_F(LlamaParallel, FullQkNormsWithPostNormsUnderEveryLayoutMatchOneDevice) {
  const auto olmo2 = [](ModelConfig& m) {
    m.rope_theta = 500;
    m.tie_embeddings = false;
    m.norm_placement = "post";
    m.qk_norm = true;
    m.qk_norm_scope = "full";
  };
  expect_hub_qwen_layouts_match(
      config(), "hf_tiny_olmo2", olmo2,
      "dp=2,zero=1;cp=2;cp=2,cp_comm=ring,recompute=selective;pp=2,schedule=zb-h1;"
      "dp=2,zero=3,recompute=full;dp=2,pp=2,schedule=gpipe;tp=2;tp=2,sp=1,recompute=selective;"
      "cp=2,tp=2,sp=1;dp=2,tp=2,zero=2,sp=1;tp=2,recompute=full;pp=2,tp=2,schedule=1f1b",
      12);
}

TEST_F(LlamaParallel, TensorParallelNeedsWholeKeyValueHeadsPerRank) {
  Config c = config();
  c.parallel.tp = 4;  // 2 key/value heads cannot split over 4 ranks
  c.parallel.dp = 1;
  c.parallel.pp = 1;
  c.runtime.ranks = 4;
  try {
    validate(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "parallel.tp = 4 does not divide the key/value heads, model.n_kv_heads = 2"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(LlamaParallel, StoppedAndResumedRunContinuesBitForBit) {
  Config c = config();
  c.parallel.tp = 2;
  c.parallel.dp = 2;
  c.parallel.zero = 1;
  c.runtime.ranks = 4;
  expect_resumed_run_bitwise_equal(c, "");
}

// Llama, and OLMo 2 (its full-width query/key norms' gains tp shards too).
TEST_F(LlamaParallel, ShardedCheckpointOfOneLayoutResumesUnderAnother) {
  for (const bool olmo2 : {false, true}) {
    const std::string model = olmo2 ? "olmo2" : "llama";
    SCOPED_TRACE(model);
    Config c = config();
    c.train.steps = 4;
    c.train.warmup_steps = 2;
    c.train.save_every = 2;
    if (olmo2) {
      c.model.norm_placement = "post";
      c.model.qk_norm = true;
      c.model.qk_norm_scope = "full";
    }
    run_training(c, options(model + "_one_device"));  // the reference, whole checkpoints
    Config tp = c;
    tp.train.checkpoint_format = "sharded";
    tp.parallel.tp = 2;
    tp.parallel.pp = 2;
    tp.runtime.ranks = 4;
    TrainOptions first = options(model + "_resharded");
    first.stop_after = 2;
    run_training(tp, first);
    Config dp = c;  // resume the tp × pp shards on two data-parallel ranks with ZeRO-3
    dp.train.checkpoint_format = "sharded";
    dp.parallel.dp = 2;
    dp.parallel.zero = 3;
    dp.runtime.ranks = 2;
    TrainOptions second = options(model + "_resharded");
    second.resume = "auto";
    run_training(dp, second);
    const auto ref = testing::read_metrics(root_ / (model + "_one_device"));
    const auto got = testing::read_metrics(root_ / (model + "_resharded"));
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i]["loss"].get<double>(), ref[i]["loss"].get<double>(),
                  1e-5 * ref[i]["loss"].get<double>())
          << "step " << i + 1;
  }
}

// A mixture of experts (model.moe_experts) under every strategy built for it: its balance loss
// is per sequence, so however dp, micro-batches and pipeline stages split the batch its gradient
// is one device's.
TEST_F(LlamaParallel, MixtureOfExpertsUnderEveryStrategyBuiltForItMatchesOneDevice) {
  expect_layouts_match_one_device(moe_config(),
                                  "dp=2,zero=1;dp=2,zero=3;dp=2,zero=2,mbs=2,recompute=selective;"
                                  "pp=2;pp=2,schedule=interleaved,v=2;"
                                  "pp=2,schedule=zb-v,v=2,recompute=full;dp=2,pp=2,schedule=gpipe",
                                  7);
}

// Tensor parallelism (parallel/tensor_parallel_block.h): every expert's width split over tp, the
// mixture's partial outputs and input gradients summed over it — with sequence parallelism from
// and to each rank's rows —, the routing weights' gradients summed inside; under recomputation,
// pipelining (zero-bubble too: the experts' weight gradients deferred), ZeRO, and with expert
// parallelism over the dp ranks of each tp rank besides — and all at once with cp (8 ranks).
TEST_F(LlamaParallel, MixtureOfExpertsUnderTensorParallelismMatchesOneDevice) {
  expect_layouts_match_one_device(
      moe_config(),
      "tp=2;tp=2,sp=1;tp=2,sp=1,recompute=selective;"
      "tp=2,recompute=full,mbs=2;pp=2,tp=2,sp=1,schedule=interleaved,v=2;"
      "dp=2,tp=2,zero=3,sp=1;dp=2,tp=2,ep=2;"
      "dp=2,tp=2,ep=2,zero=2,sp=1,ep_dispatch=all_to_all;"
      "dp=2,tp=2,ep=2,zero=3,recompute=full;"
      "dp=2,pp=2,tp=2,ep=2,zero=1,sp=1,mbs=2;"
      "pp=2,tp=2,schedule=zb-v,v=2;dp=2,cp=2,tp=2,ep=2,sp=1,zero=3",
      12);
  Config shared = moe_config();
  shared.model.moe_shared_experts = 2;
  expect_layouts_match_one_device(shared, "tp=2,sp=1;dp=2,tp=2,ep=2,zero=1,recompute=selective", 2);
}

// Context parallelism (parallel/context_parallel.h): each rank a part of every sequence's
// positions, the sequences' choices and probability sums per expert summed over cp for the
// balance loss; with either exchange, ZeRO, tensor, expert and pipeline parallelism.
TEST_F(LlamaParallel, MixtureOfExpertsUnderContextParallelismMatchesOneDevice) {
  expect_layouts_match_one_device(moe_config(),
                                  "cp=2;cp=2,cp_comm=ring,recompute=selective;dp=2,cp=2,zero=3;"
                                  "cp=2,tp=2,sp=1;cp=2,pp=2,recompute=full;dp=2,cp=2,ep=2,zero=1;"
                                  "dp=2,cp=2,ep=2,zero=2,ep_dispatch=all_to_all",
                                  7);
}

// Auxiliary-loss-free balancing (model.moe_bias_update_rate, DeepSeek-V3): every layout moves the
// biases by the batch's counts, so its runs are one device's; checkpoints keep the biases, so a
// stopped run resumes bit for bit; they change the routing (the run is not the unbiased one); and
// an export to MixtralForCausalLM, which has no biases, is refused.
TEST_F(LlamaParallel, MixtureBalancedByBiasesMatchesOneDeviceAndResumesBitForBit) {
  Config c = moe_config();
  c.model.moe_bias_update_rate = 0.01;
  expect_layouts_match_one_device(c,
                                  "dp=2,zero=1;pp=2,schedule=zb-v,v=2;tp=2,sp=1;"
                                  "dp=2,ep=2,ep_dispatch=all_to_all;cp=2,recompute=selective",
                                  5);
  c.parallel.dp = 2;
  c.parallel.zero = 1;
  c.runtime.ranks = 2;
  expect_resumed_run_bitwise_equal(c, "bias_");
  Config sharded = c;
  sharded.train.checkpoint_format = "sharded";
  expect_resumed_run_bitwise_equal(sharded, "bias_sharded_");
  const fs::path step_4 = root_ / "bias_whole" / "checkpoints" / "step_4";
  std::ifstream in(step_4 / "state.json");
  const nlohmann::json state = nlohmann::json::parse(in);
  ASSERT_TRUE(state.contains("moe_expert_bias"));
  const auto biases = state["moe_expert_bias"].get<std::vector<float>>();
  ASSERT_EQ(biases.size(), static_cast<size_t>(c.model.n_layers * c.model.moe_experts));
  EXPECT_TRUE(std::any_of(biases.begin(), biases.end(), [](float b) { return b != 0; }));
  // The same run without biases routes otherwise: its losses part from step 2 on.
  Config plain = c;
  plain.model.moe_bias_update_rate = 0;
  plain.train.steps = 4;
  plain.train.warmup_steps = 2;
  plain.train.save_every = 2;
  run_training(plain, options("bias_none"));
  const auto with = testing::read_metrics(root_ / "bias_whole");
  const auto without = testing::read_metrics(root_ / "bias_none");
  ASSERT_EQ(without.size(), 4u);
  EXPECT_EQ(with[0]["loss"].get<double>(), without[0]["loss"].get<double>());
  EXPECT_NE(with[3]["loss"].get<double>(), without[3]["loss"].get<double>());
  const std::string error = testutil::error_of(
      [&] { export_checkpoint(step_4.string(), "hf", (root_ / "bias_hf").string(), false); });
  EXPECT_NE(error.find("routes by balancing biases (model.moe_bias_update_rate)"),
            std::string::npos)
      << error;
}

// Expert capacity (model.moe_capacity_factor, nn/moe_capacity.h): each expert takes at most
// ceil(0.75 · 16 · 2 / 4) = 6 of a sequence's 32 choices. Decided per whole sequence, so every
// layout drops the pairs one device drops — micro-batches, dp, ZeRO, pipelines, tp (each rank
// routes alike), cp (the sequences' choices summed over the group first), ep with either
// dispatcher (the all-to-all sends only the pairs kept). It changes the run: the dropless
// one's first loss differs.
TEST_F(LlamaParallel, MixtureWithExpertCapacityDropsAsOneDeviceUnderEveryLayout) {
  Config c = moe_config();
  c.model.moe_capacity_factor = 0.75;
  expect_layouts_match_one_device(c,
                                  "dp=2,zero=1,mbs=2;dp=2,zero=3,recompute=selective;"
                                  "pp=2,schedule=zb-v,v=2;tp=2,sp=1;cp=2;cp=2,cp_comm=ring,tp=2;"
                                  "dp=2,ep=2,recompute=full;dp=2,ep=2,ep_dispatch=all_to_all;"
                                  "dp=2,cp=2,ep=2,zero=2,ep_dispatch=all_to_all;"
                                  "dp=2,pp=2,ep=2,ep_dispatch=all_to_all,recompute=selective",
                                  10);
  c.model.moe_token_drop_policy = "position";
  expect_layouts_match_one_device(
      c, "dp=2,ep=2,ep_dispatch=all_to_all,mbs=2;cp=2,cp_comm=ring;tp=2,pp=2", 3);
  Config dropless = moe_config(), dropping = c;
  for (Config* run : {&dropless, &dropping}) {
    run->train.steps = 1;
    run->train.warmup_steps = 1;
  }
  run_training(dropless, options("capacity_none"));
  run_training(dropping, options("capacity_position"));
  const auto without = testing::read_metrics(root_ / "capacity_none");
  const auto with = testing::read_metrics(root_ / "capacity_position");
  ASSERT_EQ(with.size(), 1u);
  EXPECT_NE(with[0]["loss"].get<double>(), without[0]["loss"].get<double>());
  // The metric moe_dropped, the share of the step's choices dropped, counts the whole batch: the
  // same figure under every layout (and none without a capacity).
  EXPECT_FALSE(without[0].contains("moe_dropped"));
  const double share = with[0]["moe_dropped"].get<double>();
  EXPECT_GT(share, 0.0);
  EXPECT_LT(share, 0.5);
  Config ep = dropping, cp = dropping;
  ep.parallel.dp = ep.parallel.ep = 2;
  ep.parallel.ep_dispatch = "all_to_all";
  ep.train.micro_batch_size = 2;
  ep.runtime.ranks = 2;
  cp.parallel.cp = cp.parallel.tp = cp.parallel.pp = 2;
  cp.runtime.ranks = 8;
  run_training(ep, options("capacity_ep"));
  run_training(cp, options("capacity_cp_tp_pp"));
  for (const char* run : {"capacity_ep", "capacity_cp_tp_pp"})
    EXPECT_EQ(testing::read_metrics(root_ / run)[0]["moe_dropped"].get<double>(), share) << run;
}

// DeepSeek-V3's router: sigmoid scores (model.moe_router_score_function), balancing biases, a
// shared expert, group-limited routing (2 groups of 2 experts, a token's pair from its best
// group: under ep = 2 one rank) and weights scaled by 2.5 — under dp × ZeRO, pipelining, tp, cp
// and ep by either dispatcher, one device's run; and not the softmax router's run.
TEST_F(LlamaParallel, MixtureScoredBySigmoidsAsDeepSeekV3MatchesOneDevice) {
  Config c = moe_config();
  c.model.moe_router_score_function = "sigmoid";
  c.model.moe_bias_update_rate = 0.01;
  c.model.moe_shared_experts = 1;
  c.model.moe_router_num_groups = 2;
  c.model.moe_router_group_topk = 1;
  c.model.moe_router_topk_scaling_factor = 2.5;
  expect_layouts_match_one_device(c,
                                  "dp=2,zero=1,mbs=2;pp=2,schedule=zb-v,v=2;tp=2,sp=1;"
                                  "cp=2,recompute=selective;dp=2,ep=2,ep_dispatch=all_to_all;"
                                  "dp=2,ep=2,zero=3,recompute=full",
                                  6);
  Config softmax = c;
  softmax.model.moe_router_score_function = "softmax";
  for (Config* run : {&c, &softmax}) {
    run->train.steps = 1;
    run->train.warmup_steps = 1;
  }
  run_training(c, options("sigmoid_scores"));
  run_training(softmax, options("softmax_scores"));
  EXPECT_NE(testing::read_metrics(root_ / "sigmoid_scores")[0]["loss"].get<double>(),
            testing::read_metrics(root_ / "softmax_scores")[0]["loss"].get<double>());
}

// With two shared experts beside the routed ones (model.moe_shared_experts: DeepSeekMoE's form).
// The chosen experts' scores as their weights, not normalised over the k (Qwen-MoE's and OLMoE's
// router: model.moe_router_norm_topk_prob = false), with a shared expert: one device's run under
// dp × ZeRO, pipelining, tp, cp and ep — and not the normalising router's.
TEST_F(LlamaParallel, MixtureWithWeightsNotNormalisedMatchesOneDevice) {
  Config c = moe_config();
  c.model.moe_router_norm_topk_prob = false;
  c.model.moe_shared_experts = 1;
  expect_layouts_match_one_device(c,
                                  "dp=2,zero=1,mbs=2;pp=2,schedule=zb-h1;tp=2,sp=1;cp=2;"
                                  "dp=2,ep=2,ep_dispatch=all_to_all,zero=2",
                                  5);
  Config normalised = c;
  normalised.model.moe_router_norm_topk_prob = true;
  LayoutCheckOptions o;
  o.steps = 2;
  const double a = check_layouts(c, parse_layouts("dp=2"), o).reference_losses.back();
  const double b = check_layouts(normalised, parse_layouts("dp=2"), o).reference_losses.back();
  EXPECT_GT(std::abs(a - b), 1e-4) << "the normalisation changed nothing";
}

TEST_F(LlamaParallel, MixtureOfExpertsWithSharedExpertsMatchesOneDevice) {
  Config c = moe_config();
  c.model.moe_shared_experts = 2;
  expect_layouts_match_one_device(c, "dp=2,zero=3;pp=2,recompute=selective;dp=2,pp=2", 3);
}

TEST_F(LlamaParallel, MixtureOfExpertsStoppedAndResumedContinuesBitForBit) {
  Config c = moe_config();
  c.parallel.dp = 2;
  c.parallel.zero = 2;
  c.runtime.ranks = 2;
  expect_resumed_run_bitwise_equal(c, "moe_");
  // The same checkpoint under a dense config is named for what it holds.
  Config dense = c;
  dense.model.moe_experts = 0;
  dense.model.moe_top_k = Config().model.moe_top_k;
  dense.model.moe_aux_loss_coef = Config().model.moe_aux_loss_coef;
  TrainOptions third = options("moe_resumed");
  third.resume = "auto";
  const std::string error = testutil::error_of([&] { run_training(dense, third); });
  EXPECT_NE(
      error.find("holds a mixture of 4 experts, top 2, but the config asks for a dense model"),
      std::string::npos)
      << error;
}

// metrics.jsonl's moe_aux_loss, the balance losses the step added: the same under dp (each rank's
// mean over micro-batches, averaged), pp (each stage's blocks', summed) and cp × tp (each rank's
// the whole sequences', the counts summed over cp; every tp rank's the same) as on one device, and
// between 1 and E/k = 2 times the coefficient a block; and moe_expert_load, the busiest expert's
// tokens over the mean, the same bits.
TEST_F(LlamaParallel, MixtureOfExpertsBalanceLossIsReportedTheSameUnderEveryLayout) {
  Config one = moe_config();
  one.train.steps = 3;
  one.train.warmup_steps = 1;
  run_training(one, options("moe_aux_one"));
  Config dp = one;
  dp.parallel.dp = 2;
  dp.train.micro_batch_size = 2;
  dp.runtime.ranks = 2;
  run_training(dp, options("moe_aux_dp"));
  Config pp = one;
  pp.parallel.pp = 2;
  pp.parallel.schedule = "zb-v";
  pp.parallel.virtual_stages = 2;
  pp.runtime.ranks = 2;
  run_training(pp, options("moe_aux_pp"));
  Config cp = one;  // each rank half of every sequence: the loss is the whole sequences'
  cp.parallel.cp = 2;
  cp.parallel.tp = 2;
  cp.runtime.ranks = 4;
  run_training(cp, options("moe_aux_cp_tp"));
  const auto ref = testing::read_metrics(root_ / "moe_aux_one");
  ASSERT_EQ(ref.size(), 3u);
  for (const char* run : {"moe_aux_dp", "moe_aux_pp", "moe_aux_cp_tp"}) {
    const auto got = testing::read_metrics(root_ / run);
    ASSERT_EQ(got.size(), 3u) << run;
    for (size_t i = 0; i < got.size(); ++i) {
      const double want = ref[i]["moe_aux_loss"].get<double>();
      EXPECT_GT(want, 0.1 * 4 * 0.9) << "step " << i + 1;
      EXPECT_LT(want, 0.1 * 4 * 2) << "step " << i + 1;
      EXPECT_NEAR(got[i]["moe_aux_loss"].get<double>(), want, 1e-6 * want)
          << run << " step " << i + 1;
      // The expert load counts the whole batch's tokens: exactly one device's figure.
      const double load = ref[i]["moe_expert_load"].get<double>();
      EXPECT_GE(load, 1.0);
      EXPECT_LE(load, 2.0);  // E / k
      EXPECT_EQ(got[i]["moe_expert_load"].get<double>(), load) << run << " step " << i + 1;
    }
  }
}

// train.init_from a MixtralForCausalLM that transformers saved (tests/data/hf_tiny_mixtral): every
// layout starts from its weights, so their runs match one device's.
TEST_F(LlamaParallel, MixtureOfExpertsStartsFromATransformersMixtralUnderEveryLayout) {
  Config c = moe_config();
  c.model.n_layers = 2;
  c.model.ffn_hidden = 48;
  c.model.rope_theta = 500;
  c.model.max_seq_len = 64;
  c.model.tie_embeddings = false;
  c.model.moe_top_k = 2;
  c.train.init_from = LOOM_SOURCE_DIR "/tests/data/hf_tiny_mixtral";
  LayoutCheckOptions o;
  o.steps = 3;
  const LayoutCheckResult r = check_layouts(c, parse_layouts("dp=2,zero=3;pp=2"), o);
  ASSERT_EQ(r.rows.size(), 2u);
  for (const LayoutCheckRow& row : r.rows) {
    EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
    EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.grad_norm_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout;
  }
  // Not the random initialisation's ln 256: the Mixtral's own (random, 200-token) predictions.
  ASSERT_EQ(r.reference_losses.size(), 3u);
  EXPECT_GT(std::abs(r.reference_losses.front() - std::log(256.0)), 0.05);
}

// Expert parallelism (parallel.ep, parallel/expert_parallel.h): each rank of an ep group holds
// E/ep of every block's experts; the group's tokens are gathered to them and their outputs summed
// back. Under ZeRO 0-3 (ZeRO-3 gathering the experts over the ranks holding them, with full
// recomputation re-running the experts' forward inside the backward), with micro-batches,
// recomputation and pipelining, and with dp/ep = 2 expert-data-parallel ranks per expert
// (dp = 4): one device's run.
TEST_F(LlamaParallel, MixtureOfExpertsWithExpertParallelismMatchesOneDevice) {
  expect_layouts_match_one_device(moe_config(),
                                  "dp=2,ep=2;dp=2,ep=2,zero=1,mbs=2,recompute=selective;"
                                  "dp=2,ep=2,zero=2;dp=4,ep=2,zero=1,mbs=1;dp=4,ep=4,zero=2,mbs=1;"
                                  "dp=2,ep=2,pp=2,schedule=zb-v,v=2,recompute=full;"
                                  "dp=2,ep=2,zero=3;dp=4,ep=2,zero=3,mbs=1,recompute=full;"
                                  "dp=2,ep=2,zero=3,mbs=2,recompute=selective",
                                  9);
  // The all-to-all dispatcher: each token's rows to its experts' ranks only, in padded blocks.
  expect_layouts_match_one_device(
      moe_config(),
      "dp=2,ep=2,ep_dispatch=all_to_all;dp=4,ep=2,zero=1,mbs=1,ep_dispatch=all_to_all;"
      "dp=4,ep=4,zero=3,mbs=1,recompute=full,ep_dispatch=all_to_all;"
      "dp=2,ep=2,zero=2,mbs=2,recompute=selective,ep_dispatch=all_to_all;"
      "dp=2,ep=2,pp=2,schedule=zb-v,v=2,recompute=selective,ep_dispatch=all_to_all",
      5);
  Config shared = moe_config();
  shared.model.moe_shared_experts = 1;
  expect_layouts_match_one_device(
      shared, "dp=2,ep=2,zero=1;dp=2,ep=2,pp=2;dp=4,ep=4,ep_dispatch=all_to_all", 3);
}

// A run under expert parallelism stops and resumes bit for bit from either checkpoint format,
// and its checkpoints, whole or sharded, hold every expert once: they resume under another
// layout (here one device) to the same run — losses, gradient norms and the validation loss
// (which every rank of an ep group computes together).
TEST_F(LlamaParallel, ExpertParallelCheckpointsResumeBitForBitAndUnderOtherLayouts) {
  Config c = moe_config();
  c.data.val = (root_ / "data" / "val_*.bin").string();
  c.train.eval_every = 4;
  c.train.eval_batches = 3;  // not a multiple of dp: ranks of an ep group may not split them
  c.parallel.dp = 4;
  c.parallel.ep = 2;
  c.parallel.zero = 1;
  c.train.micro_batch_size = 2;
  c.runtime.ranks = 4;
  expect_resumed_run_bitwise_equal(c, "ep_");
  Config sharded = c;  // and the all-to-all dispatcher
  sharded.train.checkpoint_format = "sharded";
  sharded.parallel.zero = 2;
  sharded.parallel.ep_dispatch = "all_to_all";
  expect_resumed_run_bitwise_equal(sharded, "ep_sharded_");
  // The whole checkpoint at step 2 of the ep run, continued on one device; and the sharded one
  // on dp = 2 without expert parallelism: both the ep run's last steps, within rounding.
  const auto ep_run = testing::read_metrics(root_ / "ep_whole");
  // metrics.jsonl: the token exchange on an axis of its own ("ep": the tokens' rows and their
  // outputs, forward and backward, every step), absent without expert parallelism.
  for (const auto& record : ep_run) {
    ASSERT_TRUE(record["comm_bytes"].contains("ep") && record["comm_ms"].contains("ep"));
    EXPECT_GT(record["comm_bytes"]["ep"].get<int64_t>(), 0);
    // Its waits are a part of the step, outside the compute.
    EXPECT_LE(record["comm_ms"]["ep"].get<double>() + record["compute_ms"].get<double>(),
              record["step_ms"].get<double>() * (1 + 1e-9));
  }
  Config other = moe_config();
  other.data.val = c.data.val;
  other.train.eval_every = c.train.eval_every;
  other.train.eval_batches = c.train.eval_batches;
  other.train.micro_batch_size = 2;
  expect_continued_elsewhere("ep_whole", "ep_to_one", other);
  other.parallel.dp = 2;
  other.runtime.ranks = 2;
  expect_continued_elsewhere("ep_sharded_whole", "ep_sharded_to_dp", other);
  for (const char* dir : {"ep_to_one", "ep_sharded_to_dp"})
    EXPECT_FALSE(testing::read_metrics(root_ / dir)[0]["comm_bytes"].contains("ep")) << dir;
}

// A mixture split by tensor and expert parallelism at once (dp 2 × tp 2, ep 2, sequence
// parallel) stops and resumes bit for bit from either checkpoint format; its checkpoints hold
// every expert whole (its tp slices put together, each ep block once) and resume on one device
// and under pp 2 × tp 2 to the same run. So does one split by context and expert parallelism
// (dp 2 × cp 2, ep 2: the ep groups within dp, the experts' gradients reduced over dp × cp).
TEST_F(LlamaParallel, MixtureSplitEveryWayCheckpointsAndResumesAnywhere) {
  Config c = moe_config();
  c.parallel.dp = 2;
  c.parallel.tp = 2;
  c.parallel.ep = 2;
  c.parallel.sequence_parallel = true;
  c.parallel.zero = 1;
  c.runtime.ranks = 4;
  expect_resumed_run_bitwise_equal(c, "tp_ep_");
  Config sharded = c;
  sharded.train.checkpoint_format = "sharded";
  sharded.parallel.zero = 2;
  expect_resumed_run_bitwise_equal(sharded, "tp_ep_sharded_");
  expect_continued_elsewhere("tp_ep_whole", "tp_ep_to_one", moe_config());
  Config pp = moe_config();
  pp.parallel.pp = 2;
  pp.parallel.tp = 2;
  pp.runtime.ranks = 4;
  expect_continued_elsewhere("tp_ep_sharded_whole", "tp_ep_sharded_to_pp", pp);
  Config cp = moe_config();
  cp.parallel.dp = 2;
  cp.parallel.cp = 2;
  cp.parallel.ep = 2;
  cp.parallel.zero = 2;
  cp.runtime.ranks = 4;
  expect_resumed_run_bitwise_equal(cp, "cp_ep_");
  cp.train.checkpoint_format = "sharded";
  expect_resumed_run_bitwise_equal(cp, "cp_ep_sharded_");
  expect_continued_elsewhere("cp_ep_whole", "cp_ep_to_one", moe_config());
  expect_continued_elsewhere("cp_ep_sharded_whole", "cp_ep_sharded_to_one", moe_config());
}

// Hybrid sharding (parallel.dp_shard) with every other strategy: the dense units' state sharded
// over groups of dp_shard dp ranks (× cp), the experts' over the ranks holding them, as before —
// one device's run under ZeRO 1-3, both dispatchers, tp, cp and a pipeline; a run stopped and
// resumed from its sharded checkpoint is the uninterrupted one bit for bit, and that checkpoint
// continues on one device.
TEST_F(LlamaParallel, MixtureUnderHybridShardingMatchesOneDevice) {
  expect_layouts_match_one_device(
      moe_config(),
      "dp=4,ep=2,zero=3,dp_shard=2,mbs=1;"
      "dp=4,ep=4,zero=2,dp_shard=2,mbs=1,ep_dispatch=all_to_all;"
      "dp=4,ep=2,zero=1,dp_shard=2,mbs=1,recompute=selective;"
      "dp=2,cp=2,ep=2,zero=3,dp_shard=1;dp=2,tp=2,sp=1,ep=2,zero=2,dp_shard=1;"
      "dp=2,pp=2,ep=2,zero=1,dp_shard=1,schedule=zb-v,v=2",
      6);
  Config c = moe_config();
  c.parallel.dp = 2;
  c.parallel.cp = 2;
  c.parallel.ep = 2;
  c.parallel.zero = 3;
  c.parallel.dp_shard = 1;
  c.runtime.ranks = 4;
  c.train.checkpoint_format = "sharded";
  expect_resumed_run_bitwise_equal(c, "hsdp_cp_ep_");
  expect_continued_elsewhere("hsdp_cp_ep_whole", "hsdp_cp_ep_to_one", moe_config());
}

TEST_F(LlamaParallel, MixtureOfExpertsConfigsThatCannotRunAreRefusedByName) {
  const auto refused = [](const Config& c, const std::string& expected) {
    const std::string error = testutil::error_of([&] { validate(c); });
    EXPECT_NE(error.find(expected), std::string::npos) << error;
  };
  Config gpt2 = moe_config();
  gpt2.model.arch = "gpt2";
  gpt2.model.n_kv_heads = 0;
  gpt2.model.ffn_hidden = 0;
  gpt2.model.rope_theta = 10000;
  refused(gpt2, "model.moe_experts applies to model.arch = \"llama\" only");
  Config k = moe_config();
  k.model.moe_top_k = 5;
  refused(k, "model.moe_top_k = 5 must be between 1 and model.moe_experts = 4");
  Config dense = moe_config();
  dense.model.moe_experts = 0;
  refused(dense, "model.moe_aux_loss_coef applies with model.moe_experts > 0 only");
  dense.model.moe_bias_update_rate = 0.001;
  refused(dense, "model.moe_bias_update_rate applies with model.moe_experts > 0 only");
  Config rate = moe_config();
  rate.model.moe_bias_update_rate = 2;
  refused(rate, "model.moe_bias_update_rate = 2.0 must be in [0.0, 1.0)");
  dense.model.moe_capacity_factor = 1.25;
  refused(dense, "model.moe_capacity_factor applies with model.moe_experts > 0 only");
  Config capacity = moe_config();
  capacity.model.moe_capacity_factor = -1;
  refused(capacity, "model.moe_capacity_factor = -1.0 must be in [0.0, 1024.0]");
  capacity.model.moe_capacity_factor = 0;
  capacity.model.moe_token_drop_policy = "position";
  refused(capacity, "model.moe_token_drop_policy applies with model.moe_capacity_factor > 0 only");
  capacity.model.moe_token_drop_policy = "random";
  refused(capacity, "model.moe_token_drop_policy = \"random\"");
  dense.model.moe_router_score_function = "sigmoid";
  refused(dense, "model.moe_router_score_function applies with model.moe_experts > 0 only");
  Config sigmoid = moe_config();
  sigmoid.model.moe_router_score_function = "sigmoid";
  sigmoid.model.moe_router_z_loss_coef = 0.001;
  refused(sigmoid,
          "model.moe_router_z_loss_coef applies with model.moe_router_score_function = "
          "\"softmax\" only");
  sigmoid.model.moe_router_score_function = "tanh";
  refused(sigmoid, "model.moe_router_score_function = \"tanh\" must be one of: softmax, sigmoid");
  Config groups = moe_config();
  groups.model.moe_router_num_groups = 3;
  groups.model.moe_router_group_topk = 1;
  refused(groups, "model.moe_router_num_groups = 3 does not divide model.moe_experts = 4");
  groups.model.moe_router_num_groups = 4;
  refused(groups,
          "model.moe_router_group_topk = 1 must be in [1, model.moe_router_num_groups = 4]");
  groups.model.moe_router_num_groups = 0;
  refused(groups, "model.moe_router_group_topk applies with model.moe_router_num_groups > 0 only");
  groups.model.moe_router_topk_scaling_factor = 0;
  refused(groups, "model.moe_router_topk_scaling_factor = 0.0 must be in [0.001, 1000.0]");
  Config ep = moe_config();
  ep.parallel.dp = 2;
  ep.parallel.ep = 4;
  ep.runtime.ranks = 2;
  refused(ep, "parallel.ep = 4 does not divide parallel.dp = 2");
  ep.model.moe_experts = 6;
  ep.parallel.dp = 4;
  ep.runtime.ranks = 4;
  refused(ep, "parallel.ep = 4 does not divide model.moe_experts = 6");
  Config ep_dense = config();
  ep_dense.parallel.dp = 2;
  ep_dense.parallel.ep = 2;
  ep_dense.runtime.ranks = 2;
  refused(ep_dense, "parallel.ep = 2 splits a mixture's experts: it needs model.moe_experts > 0");
}

}  // namespace
}  // namespace loom
