// `loom check` (issue 7): a tiny GPT trained for a few steps under dp, tp and pp layouts
// matches the one-device run; bad layout strings name the bad item; a layout that cannot run is
// a row with its error, not an exception; shrinking and kept run directories.
#include "train/layout_check.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "data/dataset.h"
#include "kernels/cpu/cpu_features.h"
#include "train/run_compare.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

class LayoutCheckTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_layout_check_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 40000, 4000, 3);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static Config config() {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 2
n_heads = 2
[train]
steps = 1000
batch_size = 4
micro_batch_size = 2
lr = 3e-3
warmup_steps = 100
eval_every = 50
seed = 9
[runtime]
threads_per_rank = 1
)", "layout_check_test.toml");
    c.data.train = (root_ / "data" / "train_*.bin").string();
    c.data.val = (root_ / "data" / "val_*.bin").string();  // evaluation is switched off
    return c;
  }
  static LayoutCheckOptions options() {
    LayoutCheckOptions o;
    o.steps = 4;
    return o;
  }
  static fs::path root_;
};
fs::path LayoutCheckTest::root_;

void expect_error_naming(const std::string& layouts, const std::string& needle) {
  try {
    parse_layouts(layouts);
    ADD_FAILURE() << "expected loom::Error for " << layouts;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "'" << needle << "' not in: " << e.what();
  }
}

TEST(ParseLayouts, KeysAliasesAndCanonicalNames) {
  const auto l = parse_layouts(" dp=2 ; tp=2,pp=2;dp=2,zero=1; pp=2,v=2,mbs=1; tp=2,sp=1;");
  ASSERT_EQ(l.size(), 5u);
  EXPECT_EQ(l[0].name(), "dp=2");
  EXPECT_EQ(l[1].name(), "tp=2,pp=2");
  EXPECT_EQ(l[1].ranks(), 4);
  EXPECT_EQ(l[2].zero, 1);
  EXPECT_EQ(l[3].virtual_stages, 2);
  EXPECT_EQ(l[3].micro_batch_size, 1);
  EXPECT_EQ(l[3].name(), "pp=2,v=2,mbs=1");
  EXPECT_EQ(l[4].sequence_parallel, true);
  const auto r = parse_layouts("dp=2,recompute=selective;tp=2,recompute=none");
  EXPECT_EQ(r[0].recompute, "selective");
  EXPECT_EQ(r[0].name(), "dp=2,recompute=selective");
  EXPECT_EQ(r[1].recompute, "none");
  const auto c = parse_layouts("cp=2,cp_comm=ring");
  EXPECT_EQ(c[0].cp, 2);
  EXPECT_EQ(c[0].cp_comm, "ring");
  EXPECT_EQ(c[0].name(), "cp=2,cp_comm=ring");
  EXPECT_EQ(parse_layouts("dp=1")[0].name(), "one device");
  EXPECT_EQ(parse_layouts(kDefaultCheckLayouts).size(), 6u);
}

TEST(ParseLayouts, BadItemsAreNamed) {
  expect_error_naming("dp=2;tp=2,foo=3", "foo=3");
  expect_error_naming("dp=2;tp=2,foo=3", "unknown key 'foo'");
  expect_error_naming("dp=x", "\"dp=x\"");
  expect_error_naming("dp=0", "\"dp=0\"");
  expect_error_naming("tp", "\"tp\" is not key=value");
  expect_error_naming("dp=2,,tp=2", "is empty");
  expect_error_naming("dp=2,dp=4", "repeats the key dp");
  expect_error_naming("dp=2,recompute=some", "needs none, full or selective");
  expect_error_naming("cp=2,cp_comm=tree", "needs all_gather or ring");
  expect_error_naming("zero=4", "\"zero=4\"");
  expect_error_naming("pp=2,schedule=zigzag", "schedule=zigzag");
  expect_error_naming("tp=2,sp=yes", "sp=yes");
  expect_error_naming(" ; ", "no layouts");
}

// zb-v named alone runs its two chunks (v = 2), here on a model of four blocks, and matches one
// device.
TEST_F(LayoutCheckTest, ZbVNamedAloneTakesItsTwoChunks) {
  Config c = config();
  c.model.n_layers = 4;
  const LayoutCheckResult r = check_layouts(c, parse_layouts("pp=2,schedule=zb-v"), options());
  ASSERT_EQ(r.rows.size(), 1u);
  EXPECT_EQ(r.rows[0].status, "ok") << r.rows[0].error;
  EXPECT_EQ(r.rows[0].virtual_stages, 2);
  EXPECT_LT(r.rows[0].loss_max_rel_dev, 1e-5);
  EXPECT_LT(r.rows[0].param_rel_dev, 1e-5);
}

TEST_F(LayoutCheckTest, DataTensorAndPipelineParallelMatchOneDevice) {
  const LayoutCheckResult r =
      check_layouts(config(), parse_layouts("dp=2;tp=2;pp=2;dp=2,zero=1;pp=2,tp=2,recompute=full"),
                    options());
  ASSERT_EQ(r.rows.size(), 5u);
  ASSERT_EQ(r.reference_losses.size(), 4u);
  EXPECT_EQ(r.steps, 4);
  for (const LayoutCheckRow& row : r.rows) {
    EXPECT_EQ(row.status, "ok") << row.layout << ": " << row.error;
    EXPECT_LT(row.loss_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.grad_norm_max_rel_dev, 1e-5) << row.layout;
    EXPECT_LT(row.param_rel_dev, 1e-5) << row.layout << " (" << row.param_largest_tensor << ")";
    EXPECT_TRUE(row.run_dir.empty());  // the temporary directory is gone
  }
  EXPECT_EQ(r.rows[3].zero, 1);
  EXPECT_EQ(r.rows[0].ranks, 2);
  EXPECT_EQ(r.rows[0].recompute, "none");
  EXPECT_EQ(r.rows[4].recompute, "full");
  EXPECT_TRUE(r.all_ok());
  EXPECT_TRUE(r.out_dir.empty());
  const std::string table = format_layout_check(r);
  EXPECT_NE(table.find("param rel dev"), std::string::npos) << table;
  EXPECT_NE(table.find("one device (reference)"), std::string::npos) << table;
  EXPECT_NE(table.find("dp=2,zero=1"), std::string::npos) << table;
  const nlohmann::json j = nlohmann::json::parse(layout_check_json(r));
  EXPECT_EQ(j["rows"].size(), 5u);
  EXPECT_EQ(j["rows"][4]["recompute"], "full");
  EXPECT_EQ(j["rows"][2]["layout"], "pp=2");
  EXPECT_EQ(j["rows"][2]["status"], "ok");
  EXPECT_TRUE(j["all_ok"].get<bool>());
}

TEST_F(LayoutCheckTest, LayoutsThatCannotRunAreErrorRows) {
  Config c = config();
  c.model.n_layers = 3;  // shrunk to 2 below
  c.model.seq_len = 32;  // and to 16
  LayoutCheckOptions o = options();
  o.steps = 2;
  o.max_layers = 2;
  o.max_seq_len = 16;
  o.out_dir = (root_ / "kept").string();
  // dp = 3 does not divide the batch of 4; dp = 2 with 3-sequence micro-batches neither; tp = 4
  // does not divide the 2 heads; then a layout that runs.
  const LayoutCheckResult r =
      check_layouts(c, parse_layouts("dp=3;dp=2,mbs=3;tp=4;dp=2"), o);
  EXPECT_EQ(r.n_layers, 2);
  EXPECT_EQ(r.config_n_layers, 3);
  EXPECT_EQ(r.seq_len, 16);
  EXPECT_EQ(r.config_seq_len, 32);
  ASSERT_EQ(r.rows.size(), 4u);
  EXPECT_EQ(r.rows[0].status, "error");
  EXPECT_NE(r.rows[0].error.find("train.batch_size = 4"), std::string::npos) << r.rows[0].error;
  EXPECT_EQ(r.rows[1].status, "error");
  EXPECT_NE(r.rows[1].error.find("micro_batch_size"), std::string::npos) << r.rows[1].error;
  EXPECT_EQ(r.rows[2].status, "error");
  EXPECT_NE(r.rows[2].error.find("parallel.tp = 4"), std::string::npos) << r.rows[2].error;
  EXPECT_EQ(r.rows[3].status, "ok") << r.rows[3].error;
  EXPECT_FALSE(r.all_ok());
  const std::string table = format_layout_check(r);
  EXPECT_NE(table.find("error: "), std::string::npos) << table;
  EXPECT_NE(table.find("n_layers 2 (config 3)"), std::string::npos) << table;
  // --out keeps the runs.
  EXPECT_EQ(r.out_dir, o.out_dir);
  EXPECT_TRUE(fs::exists(fs::path(r.rows[3].run_dir) / "checkpoints" / "step_2" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(o.out_dir) / "0_reference" / "metrics.jsonl"));

  // Per tensor, everything agrees to ~1e-7 but attention's qkv bias, whose key part has a zero
  // gradient and so moves by rounding noise (why the whole-model measure: train/run_compare.h).
  const auto weights = [](const fs::path& run) {
    return run / "checkpoints" / "step_2" / "model.safetensors";
  };
  const WeightsDeviation w =
      compare_weights(weights(fs::path(o.out_dir) / "0_reference"), weights(r.rows[3].run_dir));
  EXPECT_EQ(w.rel_l2, r.rows[3].param_rel_dev);
  for (const TensorDeviation& t : w.tensors) {
    if (t.name.find("qkv.bias") == std::string::npos) {
      EXPECT_LT(t.rel_l2, 1e-6) << t.name;
    }
  }
  EXPECT_THROW(compare_weights(weights(fs::path(o.out_dir) / "0_reference"),
                               fs::path(o.out_dir) / "missing.safetensors"),
               Error);
}

TEST_F(LayoutCheckTest, ToleranceZeroReportsDifferences) {
  // A tensor-parallel run sums in another order, so its parameters are not bitwise equal.
  LayoutCheckOptions o = options();
  o.steps = 2;
  o.tolerance = 0;
  o.keep = true;  // and --keep keeps the temporary directory
  const LayoutCheckResult r = check_layouts(config(), parse_layouts("tp=2"), o);
  ASSERT_FALSE(r.out_dir.empty());
  EXPECT_TRUE(fs::exists(fs::path(r.out_dir) / "0_reference" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(fs::path(r.rows.at(0).run_dir) / "metrics.jsonl"));
  EXPECT_NE(format_layout_check(r).find("runs kept in " + r.out_dir), std::string::npos);
  fs::remove_all(r.out_dir);
  ASSERT_EQ(r.rows.size(), 1u);
  EXPECT_EQ(r.rows[0].status, "DIFFERS");
  EXPECT_GT(r.rows[0].param_rel_dev, 0);
  EXPECT_GT(r.rows[0].grad_norm_max_rel_dev, 0);  // the norm too is summed in another order
  EXPECT_GE(r.rows[0].grad_norm_worst_step, 1);
  EXPECT_NE(format_layout_check(r).find("DIFFERS ("), std::string::npos);
  EXPECT_NE(format_layout_check(r).find("gradient norm at step"), std::string::npos)
      << format_layout_check(r);
  const nlohmann::json j = nlohmann::json::parse(layout_check_json(r));
  EXPECT_EQ(j["reference"]["grad_norms"].size(), 2u);
  EXPECT_GT(j["rows"][0]["grad_norm_max_rel_dev"].get<double>(), 0);
}

// The gradient norms are compared step by step: a step both runs skipped (an overflow, null in
// metrics.jsonl) matches; one skipped by one run only is an infinite deviation.
TEST(RunCompare, GradientNormsMatchWhereBothRunsSkippedAStep) {
  const double nan = std::nan("");
  EXPECT_EQ(compare_grad_norms({1.0, nan, 2.0}, {1.0, nan, 2.0}).max_rel, 0.0);
  const LossDeviation off = compare_grad_norms({1.0, nan, 2.0}, {1.0, nan, 2.2});
  EXPECT_NEAR(off.max_rel, 0.1, 1e-12);
  EXPECT_EQ(off.worst_step, 3);
  const LossDeviation one_skipped = compare_grad_norms({1.0, 2.0}, {1.0, nan});
  EXPECT_TRUE(std::isinf(one_skipped.max_rel));
  EXPECT_EQ(one_skipped.worst_step, 2);
}

// Reduced GEMM precision on CPU ranks — bf16 (kernels/cpu/sgemm_bf16_avx512.h) and fp8
// (kernels/cpu/fp8.h): the same layout twice is bitwise the same run; the run is near the fp32
// one but visibly rounded; and each layout stays much closer to the one-device run at that
// precision than the precision is to fp32. (Layouts cannot match such runs to fp32's ~1e-7: a
// sum taken in another order moves a value — an activation, a weight after the update — by an
// fp32 ulp, which now and then carries it across a rounding boundary; docs/check.md.)
void expect_layouts_close_at(const Config& base, const std::string& precision, int64_t fp8_block,
                             const LayoutCheckOptions& options) {
  LayoutCheckOptions o = options;
  o.keep = true;
  Config reduced = base;
  reduced.runtime.matmul_precision = precision;
  reduced.runtime.fp8_block = fp8_block;
  const LayoutCheckResult r = check_layouts(reduced, parse_layouts("dp=1;dp=2;tp=2;pp=2"), o);
  const LayoutCheckResult r32 = check_layouts(base, parse_layouts("dp=1"), o);
  const auto weights = [&](const fs::path& run_dir) {
    return run_dir / "checkpoints" / ("step_" + std::to_string(o.steps)) / "model.safetensors";
  };
  // Per tensor, leaving out attention's qkv.bias: its key part has an exactly zero gradient
  // (softmax ignores a constant added to every key), so it moves by AdamW's normalised rounding
  // noise, ~lr a step whatever the precision (train/run_compare.h).
  const auto worst_tensor = [](const WeightsDeviation& d) {
    double worst = 0;
    for (const TensorDeviation& t : d.tensors)
      if (t.name.find("attn.qkv.bias") == std::string::npos) worst = std::max(worst, t.rel_l2);
    return worst;
  };
  const fs::path reference = fs::path(r.out_dir) / "0_reference";
  const double precision_gap = worst_tensor(
      compare_weights(weights(fs::path(r32.out_dir) / "0_reference"), weights(reference)));
  const LossDeviation loss_gap = compare_losses(r32.reference_losses, r.reference_losses);
  ASSERT_EQ(r.rows.size(), 4u);
  std::vector<double> layout_gaps;
  for (const LayoutCheckRow& row : r.rows) {
    ASSERT_NE(row.status, "error") << row.error;
    layout_gaps.push_back(worst_tensor(compare_weights(weights(reference), weights(row.run_dir))));
  }
  fs::remove_all(r.out_dir);
  fs::remove_all(r32.out_dir);
  EXPECT_EQ(r.rows[0].loss_max_rel_dev, 0.0);  // one device again: bitwise
  EXPECT_EQ(r.rows[0].param_rel_dev, 0.0);
  EXPECT_EQ(r32.rows.at(0).param_rel_dev, 0.0);
  EXPECT_GT(loss_gap.max_rel, 1e-6) << precision << " GEMMs should round";
  EXPECT_LT(loss_gap.max_rel, 1e-2);
  EXPECT_GT(precision_gap, 1e-4);
  std::printf("%s vs fp32: loss %.2e, worst tensor %.2e; layouts at %s vs one device:",
              precision.c_str(), loss_gap.max_rel, precision_gap, precision.c_str());
  for (size_t i = 1; i < r.rows.size(); ++i) {
    const LayoutCheckRow& row = r.rows[i];
    EXPECT_LT(row.loss_max_rel_dev, 1e-4) << row.layout;
    EXPECT_LT(row.grad_norm_max_rel_dev, 1e-4) << row.layout;
    EXPECT_LT(layout_gaps[i], precision_gap / 5)
        << row.layout << "; " << precision << " vs fp32 " << precision_gap;
    std::printf(" %s %.2e / %.2e", row.layout.c_str(), row.loss_max_rel_dev, layout_gaps[i]);
  }
  std::printf("\n");
}

TEST_F(LayoutCheckTest, Bf16GemmsOnCpuRanksKeepLayoutsCloseToOneDevice) {
  if (!cpu::has_avx512f()) GTEST_SKIP() << "bf16 GEMMs on CPU ranks need AVX-512";
  expect_layouts_close_at(config(), "bf16", 128, options());
}

// fp8 with blocks of 16: d_model / tp = 16, so no block straddles the two shards.
TEST_F(LayoutCheckTest, Fp8GemmsOnCpuRanksKeepLayoutsCloseToOneDevice) {
  if (!cpu::has_avx512f()) GTEST_SKIP() << "fp8 GEMMs on CPU ranks need AVX-512";
  expect_layouts_close_at(config(), "fp8", 16, options());
}

TEST_F(LayoutCheckTest, FailingReferenceThrows) {
  Config c = config();
  c.data.train = (root_ / "missing" / "train_*.bin").string();
  EXPECT_THROW(check_layouts(c, parse_layouts("dp=2"), options()), Error);
}

}  // namespace
}  // namespace loom
