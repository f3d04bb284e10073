// Llama (model.arch = "llama") under every strategy: each layout trains like one device (losses
// and final parameters within 1e-5 relative; `loom check`'s measure), grouped-query heads split
// over tp with the query heads they serve; a stopped and resumed run continues bit for bit; a
// sharded checkpoint written under one layout resumes under another to the same run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "base/error.h"
#include "data/dataset.h"
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

  static TrainOptions options(const std::string& name) {
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / name).string();
    return o;
  }

  static fs::path root_;
};
fs::path LlamaParallel::root_;

TEST_F(LlamaParallel, EveryStrategyMatchesOneDevice) {
  LayoutCheckOptions o;
  o.steps = 4;
  const char* layouts =
      "dp=2,zero=1;dp=2,zero=3;tp=2;tp=2,sp=1;pp=2;pp=2,schedule=interleaved,v=2;"
      "pp=2,tp=2,recompute=full;dp=2,tp=2,zero=2,sp=1,recompute=selective;dp=2,pp=2,schedule=gpipe";
  const LayoutCheckResult r = check_layouts(config(), parse_layouts(layouts), o);
  ASSERT_EQ(r.rows.size(), 9u);
  for (const LayoutCheckRow& row : r.rows) {
    EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
    EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout << " (" << row.param_largest_tensor << ")";
  }
  // The runs learn: the loss falls from about ln 256 within the four steps.
  ASSERT_EQ(r.reference_losses.size(), 4u);
  EXPECT_NEAR(r.reference_losses.front(), std::log(256.0), 0.1);
  EXPECT_LT(r.reference_losses.back(), r.reference_losses.front() - 0.1);
}

// An untied head (model.tie_embeddings = false, lm_head.weight): vocabulary-parallel under tp, on
// the last stage alone under pp (nothing summed with the first stage's wte).
TEST_F(LlamaParallel, AnUntiedHeadUnderEveryStrategyMatchesOneDevice) {
  Config c = config();
  c.model.tie_embeddings = false;
  LayoutCheckOptions o;
  o.steps = 4;
  const LayoutCheckResult r = check_layouts(
      c, parse_layouts("tp=2;pp=2;pp=2,tp=2,sp=1;dp=2,zero=3;dp=2,pp=2,schedule=interleaved,v=2,mbs=2"), o);
  ASSERT_EQ(r.rows.size(), 5u);
  for (const LayoutCheckRow& row : r.rows) {
    EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
    EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout << " (" << row.param_largest_tensor << ")";
  }
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
  c.train.steps = 4;
  c.train.warmup_steps = 2;
  c.train.save_every = 2;
  c.parallel.tp = 2;
  c.parallel.dp = 2;
  c.parallel.zero = 1;
  c.runtime.ranks = 4;
  run_training(c, options("whole"));
  TrainOptions first = options("resumed");
  first.stop_after = 2;
  run_training(c, first);
  TrainOptions second = options("resumed");
  second.resume = "auto";
  run_training(c, second);
  const auto a = testing::read_metrics(root_ / "whole"), b = testing::read_metrics(root_ / "resumed");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
  testing::expect_weights_match(root_ / "whole" / "checkpoints" / "step_4" / "model.safetensors",
                                root_ / "resumed" / "checkpoints" / "step_4" / "model.safetensors",
                                "resumed", 0.0);
}

TEST_F(LlamaParallel, ShardedCheckpointOfOneLayoutResumesUnderAnother) {
  Config c = config();
  c.train.steps = 4;
  c.train.warmup_steps = 2;
  c.train.save_every = 2;
  run_training(c, options("one_device"));  // the reference, whole checkpoints
  Config tp = c;
  tp.train.checkpoint_format = "sharded";
  tp.parallel.tp = 2;
  tp.parallel.pp = 2;
  tp.runtime.ranks = 4;
  TrainOptions first = options("resharded");
  first.stop_after = 2;
  run_training(tp, first);
  Config dp = c;  // resume the tp × pp shards on two data-parallel ranks with ZeRO-3
  dp.train.checkpoint_format = "sharded";
  dp.parallel.dp = 2;
  dp.parallel.zero = 3;
  dp.runtime.ranks = 2;
  TrainOptions second = options("resharded");
  second.resume = "auto";
  run_training(dp, second);
  const auto ref = testing::read_metrics(root_ / "one_device");
  const auto got = testing::read_metrics(root_ / "resharded");
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i]["loss"].get<double>(), ref[i]["loss"].get<double>(),
                1e-5 * ref[i]["loss"].get<double>())
        << "step " << i + 1;
}

}  // namespace
}  // namespace loom
