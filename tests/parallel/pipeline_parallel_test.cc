// Pipeline parallelism (issue 6): every schedule trains like one device.
//
// End to end through run_training on local thread ranks: 10 steps of a small GPT (8 blocks) in
// fp32 for pp ∈ {2, 4} × {gpipe, 1f1b, interleaved (2 chunks per rank), zb-h1, zb-interleaved,
// zb-v} × micro-batches
// m ∈ {pp, 2·pp, an odd count where the schedule allows it}, pp = 2 with dp = 2 and pp = 2 with
// tp = 2 (every schedule, with and without sequence parallelism), against
// the single-device run with the same global batch: losses to 1e-5 relative at every step.
// Plus: a pipeline run stops and resumes as data parallelism (whole-model checkpoints); 1F1B
// holds at most pp micro-batches of activations on the first stage and GPipe all m (counted
// and measured on the allocator); zb-h1 trains bit for bit as 1f1b (GPT-2 and Llama, with dp,
// ZeRO-1, tp, sp, recomputation, fp8 and bf16 GEMMs) and holds 1F1B's micro-batches plus the
// weight gradients W still owes; zb-interleaved and zb-v train bit for bit as interleaved, zb-v
// within 1F1B's activations; zb-v's partition balances each rank's two stages; bad layouts are
// errors naming the keys.
#include "parallel/pipeline_parallel.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/error.h"
#include "data/dataset.h"
#include "device/allocator.h"
#include "harness/thread_ranks.h"
#include "tensor/rng.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kSteps = 10;
constexpr int64_t kMicro = 2;  // sequences per micro-batch

struct Layout {
  int pp, dp;
  std::string schedule;
  int chunks, microbatches;
  int tp = 1;
  bool sp = false;  // sequence parallelism (with tp > 1)
  std::string name() const {
    std::string sched = schedule;  // (gtest names take no '-': zb-h1 → zb_h1)
    std::replace(sched.begin(), sched.end(), '-', '_');
    return "pp" + std::to_string(pp) + "_dp" + std::to_string(dp) +
           (tp > 1 ? "_tp" + std::to_string(tp) : "") + (sp ? "_sp" : "") + "_" + sched + "_v" +
           std::to_string(chunks) + "_m" + std::to_string(microbatches);
  }
};

struct BitsCase {
  std::string name;
  Layout layout;
  std::function<void(Config&)> edit = [](Config&) {};
};

// Llama's SwiGLU, RMSNorm and grouped-query heads at the test's size.
void use_small_llama(Config& c) {
  c.model.arch = "llama";
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 80;
}

class PipelineRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_pp_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 60000, 4000, 5);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static Config config(const Layout& l) {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 8
n_heads = 2
[train]
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 0
seed = 5
[runtime]
threads_per_rank = 1
)", "pp_test.toml");
    c.train.steps = kSteps;
    c.train.micro_batch_size = kMicro;
    c.train.batch_size = kMicro * l.microbatches * l.dp;
    c.parallel.pp = l.pp;
    c.parallel.dp = l.dp;
    c.parallel.schedule = l.schedule;
    c.parallel.virtual_stages = l.chunks;
    c.parallel.tp = l.tp;
    c.parallel.sequence_parallel = l.sp;
    c.runtime.ranks = l.pp * l.dp * l.tp;
    c.data.train = (root_ / "data" / "train_*.bin").string();
    return c;
  }

  static std::vector<double> losses(const std::string& name) {
    std::ifstream in(root_ / name / "metrics.jsonl");
    std::vector<double> out;
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
    return out;
  }

  // Trains `l` and the single-device run of the same global batch; compares every step.
  static void expect_matches_one_device(const Layout& l, const std::string& resume_as = "") {
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / l.name()).string();
    run_training(config(l), o);
    Config one = config(l);
    one.parallel = ParallelConfig{};
    one.runtime.ranks = 1;
    o.run_dir = (root_ / ("one_" + l.name())).string();
    run_training(one, o);
    const std::vector<double> ref = losses("one_" + l.name()), got = losses(l.name());
    ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << l.name() << " step " << i + 1;
  }

  // Trains k under `base` and under `zero_bubble`; every loss and gradient norm the same bits.
  static void expect_zero_bubble_is_bit_for_bit(const BitsCase& k, const char* base,
                                                const char* zero_bubble) {
    SCOPED_TRACE(k.name);
    std::vector<nlohmann::json> runs[2];
    int i = 0;
    for (const char* schedule : {base, zero_bubble}) {
      Layout l = k.layout;
      l.schedule = schedule;
      Config c = config(l);
      k.edit(c);
      TrainOptions o;
      o.progress = false;
      o.run_dir = (root_ / ("bits_" + k.name + "_" + schedule)).string();
      run_training(c, o);
      std::ifstream in(fs::path(o.run_dir) / "metrics.jsonl");
      for (std::string line; std::getline(in, line);)
        runs[i].push_back(nlohmann::json::parse(line));
      ++i;
    }
    ASSERT_EQ(runs[0].size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(runs[1].size(), runs[0].size());
    for (size_t s = 0; s < runs[0].size(); ++s) {
      EXPECT_EQ(runs[1][s]["loss"].get<double>(), runs[0][s]["loss"].get<double>())
          << "step " << s + 1;
      EXPECT_EQ(runs[1][s]["grad_norm"].get<double>(), runs[0][s]["grad_norm"].get<double>())
          << "step " << s + 1;
      EXPECT_GT(runs[1][s].value("pp_deferred_mb", 0.0), 0.0) << "step " << s + 1;
      // Every pipeline rank's bubble, rank 0's first.
      const auto& by_rank = runs[1][s]["bubble_by_pp_rank"];
      ASSERT_EQ(by_rank.size(), static_cast<size_t>(k.layout.pp));
      EXPECT_EQ(by_rank[0].get<double>(), runs[1][s]["bubble"].get<double>());
      for (const auto& b : by_rank) {
        EXPECT_GE(b.get<double>(), 0.0);
        EXPECT_LT(b.get<double>(), 1.0);
      }
    }
  }

  static fs::path root_;
};
fs::path PipelineRuns::root_;

class PipelineEquivalence : public PipelineRuns, public ::testing::WithParamInterface<Layout> {};

TEST_P(PipelineEquivalence, MatchesOneDevice) { expect_matches_one_device(GetParam()); }

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (int pp : {2, 4}) {
    for (int m : {pp, 2 * pp, pp + 1}) {
      out.push_back({pp, 1, "gpipe", 1, m});
      out.push_back({pp, 1, "1f1b", 1, m});
      out.push_back({pp, 1, "zb-h1", 1, m});
      if (m % pp == 0) out.push_back({pp, 1, "interleaved", 2, m});
      if (m % pp == 0) out.push_back({pp, 1, "zb-interleaved", 2, m});
      out.push_back({pp, 1, "zb-v", 2, m});  // any m
    }
  }
  out.push_back({4, 1, "zb-h1", 1, 2});  // fewer micro-batches than stages
  out.push_back({2, 2, "1f1b", 1, 4});
  out.push_back({2, 2, "zb-h1", 1, 4});
  out.push_back({2, 2, "interleaved", 2, 2});
  out.push_back({2, 2, "zb-interleaved", 2, 4});
  out.push_back({2, 2, "zb-v", 2, 3});
  // Tensor parallelism inside the stages (the tp rank of a stage talks to the same tp rank of
  // its neighbours), with and without sequence parallelism.
  out.push_back({2, 1, "gpipe", 1, 3, 2});
  out.push_back({2, 1, "1f1b", 1, 4, 2});
  out.push_back({2, 1, "1f1b", 1, 2, 2, true});
  out.push_back({2, 1, "interleaved", 2, 4, 2});
  out.push_back({2, 1, "interleaved", 2, 2, 2, true});
  out.push_back({2, 1, "zb-h1", 1, 4, 2});
  out.push_back({2, 1, "zb-h1", 1, 3, 2, true});
  out.push_back({2, 1, "zb-interleaved", 2, 4, 2, true});
  out.push_back({2, 1, "zb-v", 2, 3, 2, true});
  out.push_back({2, 2, "1f1b", 1, 2, 2, true});  // dp × pp × tp = 2 × 2 × 2
  out.push_back({2, 2, "zb-h1", 1, 2, 2, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, PipelineEquivalence, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& p) { return p.param.name(); });

// parallel.pp_send_dtype = "bf16": stage boundaries send their activations and gradients rounded
// to bf16 — half the pp bytes of the fp32 run (pp_bytes_sent), the residual stream rounded at
// each boundary (near one device: 1e-2; not the fp32 run's bits), the same bits twice; in 1F1B
// and interleaved schedules.
TEST_F(PipelineRuns, Bf16StageBoundariesHalveTheBytesAndStayNearOneDevice) {
  for (const Layout& l : {Layout{2, 1, "1f1b", 1, 4}, Layout{2, 1, "interleaved", 2, 4}}) {
    SCOPED_TRACE(l.name());
    const auto run_as = [&](const std::string& name, const std::string& dtype) {
      Config c = config(l);
      c.parallel.pp_send_dtype = dtype;
      TrainOptions o;
      o.progress = false;
      o.run_dir = (root_ / name).string();
      run_training(c, o);
      std::ifstream in(root_ / name / "metrics.jsonl");
      std::vector<nlohmann::json> out;
      std::string line;
      while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
      return out;
    };
    const auto fp32 = run_as("send32_" + l.name(), "fp32");
    const auto bf16 = run_as("send16_" + l.name(), "bf16");
    const auto again = run_as("send16_again_" + l.name(), "bf16");
    Config one = config(l);
    one.parallel = ParallelConfig{};
    one.runtime.ranks = 1;
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / ("send_one_" + l.name())).string();
    run_training(one, o);
    const std::vector<double> ref = losses("send_one_" + l.name());
    ASSERT_EQ(bf16.size(), ref.size());
    double from_fp32 = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double got = bf16[i]["loss"];
      EXPECT_NEAR(got, ref[i], 1e-2 * std::abs(ref[i])) << "step " << i + 1;
      EXPECT_EQ(bf16[i]["loss"], again[i]["loss"]) << "step " << i + 1;
      from_fp32 = std::max(from_fp32, std::abs(got - fp32[i]["loss"].get<double>()));
      EXPECT_EQ(bf16[i]["pp_bytes_sent"].get<double>() * 2, fp32[i]["pp_bytes_sent"].get<double>())
          << "step " << i + 1;
    }
    EXPECT_GT(from_fp32, 0.0) << "nothing was rounded";
  }
}

// A zero-bubble schedule computes what its base schedule computes, only later: each Linear's
// weight gradient is the same GEMM on the same operands, accumulated over the micro-batches in
// the same order (each chunk's W's come in micro-batch order), so every loss and gradient norm
// is the base's bit for bit — across the ways a backward can run (recomputation,
// tensor-parallel Linears with and without sequence parallelism, fp8 and bf16 GEMM operands,
// Llama's SwiGLU and rotary attention) and with data parallelism (the bucketed all-reduces
// start from W's replayed hooks) and ZeRO-1. And W did owe work (pp_deferred_mb).
TEST_F(PipelineRuns, ZeroBubbleIsOneFOneBBitForBit) {
  const BitsCase cases[] = {
      {"plain", {4, 1, "", 1, 5}},
      {"dp2_zero1", {2, 2, "", 1, 4}, [](Config& c) { c.parallel.zero = 1; }},
      {"tp2_sp", {2, 1, "", 1, 3, 2, true}},
      {"tp2", {2, 1, "", 1, 2, 2}, [](Config& c) { c.parallel.recompute = "selective"; }},
      {"recompute_full", {2, 1, "", 1, 4}, [](Config& c) { c.parallel.recompute = "full"; }},
      {"fp8",
       {2, 1, "", 1, 4},
       [](Config& c) {
         c.runtime.matmul_precision = "fp8";
         c.runtime.fp8_block = 16;
       }},
      {"bf16_gemms", {2, 1, "", 1, 4}, [](Config& c) { c.runtime.matmul_precision = "bf16"; }},
      {"llama", {2, 1, "", 1, 4}, [](Config& c) { use_small_llama(c); }},
  };
  for (const BitsCase& k : cases) expect_zero_bubble_is_bit_for_bit(k, "1f1b", "zb-h1");
}

// zb-interleaved against interleaved likewise: two and four ranks of two chunks (and three
// chunks), with dp and ZeRO-1, tp with sequence parallelism, recomputation, Llama.
TEST_F(PipelineRuns, InterleavedZeroBubbleIsInterleavedBitForBit) {
  const BitsCase cases[] = {
      {"v2", {2, 1, "", 2, 4}},
      {"pp4_v2", {4, 1, "", 2, 8}},
      {"v3_selective",
       {2, 1, "", 3, 4},
       [](Config& c) {
         c.model.n_layers = 6;
         c.parallel.recompute = "selective";
       }},
      {"dp2_zero1_v2", {2, 2, "", 2, 4}, [](Config& c) { c.parallel.zero = 1; }},
      {"tp2_sp_v2", {2, 1, "", 2, 2, 2, true}},
      {"llama_v2", {2, 1, "", 2, 4}, [](Config& c) { use_small_llama(c); }},
  };
  for (const BitsCase& k : cases)
    expect_zero_bubble_is_bit_for_bit(k, "interleaved", "zb-interleaved");
}

// zb-v against interleaved (v = 2): the same 2·pp stages on other ranks — the V puts the last
// stage on rank 0 with the first, so the tied embedding's copies are summed there without a
// message, and rank pp − 1 hands stage pp − 1's output to its own stage pp in memory — and each
// chunk's B's and W's in micro-batch order: every loss and gradient norm the same bits, with
// dp and ZeRO-1, tp with sequence parallelism, Llama, recomputation and bf16 stage boundaries
// (rounded at the in-memory hand-off as on the wire). Rank 0 sends two boundaries per
// micro-batch (stage 0's output, stage 2pp − 1's input gradient) where interleaved's sends three
// (stage 0's and stage pp's outputs, stage pp's input gradient).
TEST_F(PipelineRuns, ZbVIsInterleavedBitForBit) {
  // Both on the same blocks per stage (zb-v's own partition balances a rank's two stages
  // together, interleaved's each stage: other blocks, other sums; at pp 4 both give one each).
  const auto two_each = [](Config& c) { c.parallel.layer_split = "2,2,2,2"; };
  const BitsCase cases[] = {
      {"v2", {2, 1, "", 2, 4}, two_each},
      {"pp4_v2", {4, 1, "", 2, 8}},
      {"dp2_zero1_v2",
       {2, 2, "", 2, 4},
       [&](Config& c) {
         two_each(c);
         c.parallel.zero = 1;
       }},
      {"tp2_sp_v2", {2, 1, "", 2, 2, 2, true}, two_each},
      {"llama_v2_selective",
       {2, 1, "", 2, 4},
       [&](Config& c) {
         two_each(c);
         use_small_llama(c);
         c.parallel.recompute = "selective";
       }},
      {"bf16_sends_v2",
       {2, 1, "", 2, 4},
       [&](Config& c) {
         two_each(c);
         c.parallel.pp_send_dtype = "bf16";
       }},
  };
  for (const BitsCase& k : cases) expect_zero_bubble_is_bit_for_bit(k, "interleaved", "zb-v");
  for (const int pp : {2, 4}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    const std::string base = "bits_" + std::string(pp == 2 ? "v2" : "pp4_v2") + "_";
    const auto bytes = [&](const char* schedule) {
      std::ifstream in(root_ / (base + schedule) / "metrics.jsonl");
      std::string line;
      std::getline(in, line);
      return nlohmann::json::parse(line)["pp_bytes_sent"].get<double>();
    };
    EXPECT_DOUBLE_EQ(bytes("zb-v") * 3, bytes("interleaved") * 2);  // rank 0's (formats.md)
  }
}

TEST_F(PipelineRuns, StopsAndResumesUnderAnotherLayout) {
  const Layout pipe{2, 1, "1f1b", 1, 4};
  TrainOptions o;
  o.progress = false;
  o.run_dir = (root_ / "resume").string();
  o.stop_after = 5;
  run_training(config(pipe), o);  // writes checkpoints/step_5 from the two stages
  ASSERT_TRUE(fs::exists(root_ / "resume" / "checkpoints" / "step_5" / "model.safetensors"));
  Config dp = config(pipe);
  dp.parallel = ParallelConfig{};
  dp.parallel.dp = 2;
  dp.runtime.ranks = 2;
  o.stop_after = 0;
  o.resume = "auto";
  run_training(dp, o);  // continues as data parallelism
  Config one = config(pipe);
  one.parallel = ParallelConfig{};
  one.runtime.ranks = 1;
  o.resume = "";
  o.run_dir = (root_ / "resume_ref").string();
  run_training(one, o);
  const std::vector<double> ref = losses("resume_ref"), got = losses("resume");
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i + 1;
}

TEST_F(PipelineRuns, BadLayoutsAreErrorsNamingTheKeys) {
  TrainOptions o;
  o.progress = false;
  o.run_dir = (root_ / "bad").string();
  auto expect_error = [&](const Layout& l, int layers, const std::string& text) {
    Config c = config(l);
    c.model.n_layers = layers;
    try {
      run_training(c, o);
      ADD_FAILURE() << "no error for " << l.name();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error({2, 1, "interleaved", 2, 3}, 8, "multiple of parallel.pp");
  expect_error({4, 1, "1f1b", 1, 4}, 3, "n_layers");
}

TEST(PipelinePartition, BalancesCostAndHonoursAnExplicitSplit) {
  Gpt2Config mc;
  mc.vocab_size = 50304;  // GPT-2: the LM head costs about as much as several blocks
  mc.d_model = 768;
  mc.n_layers = 12;
  mc.n_heads = 12;
  mc.max_seq_len = 1024;
  const std::vector<int64_t> balanced = pipeline_partition(mc, 1024, 4, "");
  ASSERT_EQ(balanced.size(), 5u);
  EXPECT_EQ(balanced.front(), 0);
  EXPECT_EQ(balanced.back(), 12);
  const int64_t last = balanced[4] - balanced[3], first = balanced[1] - balanced[0];
  EXPECT_LT(last, first) << "the stage with the LM head gets fewer blocks";
  mc.vocab_size = 8;  // a negligible head: equal stages
  EXPECT_EQ(pipeline_partition(mc, 1024, 4, ""), (std::vector<int64_t>{0, 3, 6, 9, 12}));
  EXPECT_EQ(pipeline_partition(mc, 1024, 3, "5,4,3"), (std::vector<int64_t>{0, 5, 9, 12}));
  for (const char* bad : {"5,4", "5,4,4", "5,x,3", "6,0,6"}) {
    try {
      pipeline_partition(mc, 1024, 3, bad);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.layer_split"), std::string::npos) << e.what();
    }
  }
}

// The forward cost of the busiest rank when stage r and stage S − 1 − r share rank r (the V).
double busiest_v_rank(const Gpt2Config& mc, int pp, const std::vector<int64_t>& stage_begin) {
  const StageCosts c = pipeline_stage_costs(mc, 1024, stage_begin);
  double worst = 0;
  for (int r = 0; r < pp; ++r) worst = std::max(worst, c.forward[r] + c.forward[2 * pp - 1 - r]);
  return worst;
}

// zb-v's partition balances what a rank runs — stages r and S − 1 − r together, the LM head on
// rank 0's second — not each stage: for GPT-2 124M on 2 and 4 ranks its most loaded rank carries
// no more than under the stage-balanced partition in the same V, every stage keeps a block, and
// an explicit split still wins. Where the stage-balanced cut pairs two heavy stages on one rank
// the V's is strictly better: 24 blocks on 4 ranks (GPT-2 medium's depth at 124M's width), its
// busiest rank ~12% lighter; 8 blocks on 2 ranks, ~13%.
TEST(PipelinePartition, TheVBalancesEachRanksTwoStages) {
  Gpt2Config mc;
  mc.vocab_size = 50304;
  mc.d_model = 768;
  mc.n_layers = 12;
  mc.n_heads = 12;
  mc.max_seq_len = 1024;
  for (int pp : {2, 4}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    const int S = 2 * pp;
    const std::vector<int64_t> v = pipeline_partition(mc, 1024, S, "", true);
    ASSERT_EQ(v.size(), static_cast<size_t>(S) + 1);
    EXPECT_EQ(v.front(), 0);
    EXPECT_EQ(v.back(), 12);
    for (int st = 0; st < S; ++st) EXPECT_GE(v[st + 1] - v[st], 1) << "stage " << st;
    EXPECT_LE(busiest_v_rank(mc, pp, v),
              busiest_v_rank(mc, pp, pipeline_partition(mc, 1024, S, "")));
  }
  for (const auto& [blocks, pp] : {std::pair{24, 4}, std::pair{8, 2}}) {
    Gpt2Config g = mc;
    g.n_layers = blocks;
    EXPECT_LT(busiest_v_rank(g, pp, pipeline_partition(g, 1024, 2 * pp, "", true)),
              0.9 * busiest_v_rank(g, pp, pipeline_partition(g, 1024, 2 * pp, "")))
        << blocks << " blocks, pp " << pp;
  }
  EXPECT_EQ(pipeline_partition(mc, 1024, 4, "3,3,3,3", true),
            (std::vector<int64_t>{0, 3, 6, 9, 12}));
}

TEST_F(PipelineRuns, AnExplicitLayerSplitTrainsTheSameModel) {
  Layout l{2, 1, "1f1b", 1, 4};
  Config c = config(l);
  c.parallel.layer_split = "6,2";
  TrainOptions o;
  o.progress = false;
  o.run_dir = (root_ / "split").string();
  run_training(c, o);
  Config one = config(l);
  one.parallel = ParallelConfig{};
  one.runtime.ranks = 1;
  o.run_dir = (root_ / "split_ref").string();
  run_training(one, o);
  const std::vector<double> ref = losses("split_ref"), got = losses("split");
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i + 1;
}

// m micro-batches of random tokens and targets, (B, T) each, on `device`.
struct MicroBatches {
  std::vector<Tensor> tokens, targets;
};
MicroBatches random_micro_batches(int m, int64_t B, int64_t T, Device device, uint64_t seed) {
  MicroBatches mb;
  RandomStream rng(seed, "tokens");
  for (int i = 0; i < m; ++i) {
    mb.tokens.push_back(Tensor::empty({B, T}, DType::kI32, device));
    mb.targets.push_back(Tensor::empty({B, T}, DType::kI32, device));
    for (Tensor* t : {&mb.tokens.back(), &mb.targets.back()})
      for (int64_t j = 0; j < t->numel(); ++j) t->data<int32_t>()[j] = static_cast<int32_t>(rng.next_u32() % 256);
  }
  return mb;
}

// A 4-block GPT small enough for the memory tests.
Gpt2Config small_pipeline_gpt() {
  Gpt2Config mc;
  mc.vocab_size = 256;
  mc.max_seq_len = 32;
  mc.d_model = 64;
  mc.n_layers = 4;
  mc.n_heads = 2;
  return mc;
}

// What each rank's allocator and engine saw in the second step of `schedule` (the first warms
// the caching allocator), each rank its own dp group of one.
struct StepMemory {
  int64_t peak = 0;            // allocator peak above what the step started with
  int64_t deferred_bytes = 0;  // zero bubble: bytes the owed weight gradients kept at most
  int in_flight = 0;           // micro-batches between F and B at most
  int deferred = 0;            // micro-batches whose W was still owed at most
};
std::vector<StepMemory> second_step_memory(const Gpt2Config& mc, int pp, int m,
                                           const char* schedule, int chunks = 1) {
  std::vector<StepMemory> seen(pp);
  testing::run_on_thread_ranks(pp, [&](Communicator& comm) {
    auto solo = comm.split(comm.rank(), 0);
    ThreadPool pool(1);
    const Device device = Device::cpu(comm.rank());
    PipelineConfig pc;
    pc.schedule = schedule;
    pc.virtual_stages = chunks;
    pc.microbatches = m;
    pc.micro_batch_size = 4;
    pc.seq_len = 32;
    PipelineParallel pipe(mc, comm, *solo, pool, device, pc, DataParallelConfig{}, AdamWConfig{},
                          1);
    const MicroBatches mb = random_micro_batches(m, 4, 32, device, 7);
    pipe.train_step(mb.tokens, mb.targets);
    Allocator& alloc = allocator_for(device);
    const int64_t before = alloc.stats().bytes_in_use;
    alloc.reset_peak();
    pipe.train_step(mb.tokens, mb.targets);
    StepMemory& s = seen[comm.rank()];
    s.peak = alloc.stats().peak_bytes_in_use - before;
    s.in_flight = pipe.stats().max_in_flight;
    s.deferred = pipe.stats().max_deferred;
    s.deferred_bytes = pipe.stats().max_deferred_bytes;
  });
  return seen;
}

// The first stage's activations: 1F1B holds at most pp micro-batches, GPipe all m.
TEST(PipelineMemory, OneFOneBHoldsAtMostPpMicroBatchesGPipeAll) {
  const int pp = 2, m = 8;
  const StepMemory gpipe = second_step_memory(small_pipeline_gpt(), pp, m, "gpipe")[0];
  const StepMemory one_f_one_b = second_step_memory(small_pipeline_gpt(), pp, m, "1f1b")[0];
  EXPECT_EQ(gpipe.in_flight, m) << "GPipe holds every micro-batch";
  EXPECT_LE(one_f_one_b.in_flight, pp) << "1F1B holds at most pp micro-batches";
  EXPECT_GT(gpipe.peak, 2 * one_f_one_b.peak)
      << "GPipe's activation peak on stage 0 (" << gpipe.peak << " B) should be well above 1F1B's ("
      << one_f_one_b.peak << " B)";
}

// zb-h1 against 1f1b on 4 stages: the same micro-batches between F and B on each rank
// (pp − r), plus the weight gradients still owed — r + 1 micro-batches' at most on rank r (r
// trailing, and the one whose B just ran) —; those keep each Linear's input and output gradient
// (max_deferred_bytes; on the last rank also the LM head's), so rank r's allocator peak exceeds
// 1F1B's by at most those bytes; and as the later ranks hold fewer micro-batches between F and B,
// they hold about what the first one does.
TEST(PipelineMemory, ZeroBubbleHoldsOneFOneBsMicroBatchesPlusTheOwedWeightGradients) {
  const int pp = 4, m = 8;
  const Gpt2Config mc = small_pipeline_gpt();
  const std::vector<StepMemory> seen[2] = {second_step_memory(mc, pp, m, "1f1b"),
                                           second_step_memory(mc, pp, m, "zb-h1")};
  for (int r = 0; r < pp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(seen[0][r].in_flight, pp - r);
    EXPECT_EQ(seen[1][r].in_flight, pp - r);
    EXPECT_EQ(seen[0][r].deferred, 0);
    EXPECT_EQ(seen[1][r].deferred, r + 1);
    EXPECT_GT(seen[1][r].deferred_bytes, 0);
    EXPECT_LE(seen[1][r].peak, seen[0][r].peak + seen[1][r].deferred_bytes)
        << "zb-h1 " << seen[1][r].peak << " B, 1f1b " << seen[0][r].peak << " B, owed "
        << seen[1][r].deferred_bytes << " B";
    // The paper's "same memory as 1F1B": every rank's peak within a few percent of 1F1B's
    // largest, its first rank's (~2.4 MB here), except the last, whose W's also keep the LM
    // head's input and its logits' gradient (N·V) for the head's weight gradient (~2.95 MB).
    if (r < pp - 1) {
      EXPECT_LE(static_cast<double>(seen[1][r].peak), 1.05 * static_cast<double>(seen[0][0].peak));
    }
  }
}

// zb-v holds 1F1B's activations: at most 2·pp chunk micro-batches between F and W on a rank (a
// chunk is half a 1F1B stage; pipeline_schedule_test counts them), so every rank's allocator
// peak stays within 10% of 1F1B's largest, its first rank's (the V's rank 0 also keeps the LM
// head's logits), while zb-interleaved (interleaved's warm-up plus owed W's) holds a third more
// on rank 0. (Measured here: 4.77 and 4.45 MB against 1F1B's 4.42 and zb-interleaved's 6.58.)
TEST(PipelineMemory, ZbVHoldsOneFOneBsActivations) {
  const int pp = 2, m = 8;
  Gpt2Config mc = small_pipeline_gpt();
  mc.n_layers = 8;
  const std::vector<StepMemory> v = second_step_memory(mc, pp, m, "zb-v", 2);
  const std::vector<StepMemory> one = second_step_memory(mc, pp, m, "1f1b");
  const std::vector<StepMemory> zbi = second_step_memory(mc, pp, m, "zb-interleaved", 2);
  for (int r = 0; r < pp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_GT(v[r].deferred, 0);
    EXPECT_LE(v[r].in_flight, 2 * pp);
    EXPECT_LE(static_cast<double>(v[r].peak), 1.1 * static_cast<double>(one[0].peak))
        << "zb-v " << v[r].peak << " B, 1f1b's rank 0 " << one[0].peak << " B";
  }
  EXPECT_LT(static_cast<double>(v[0].peak), 0.8 * static_cast<double>(zbi[0].peak))
      << "zb-v " << v[0].peak << " B, zb-interleaved " << zbi[0].peak << " B";
}

// Loss scaling through the pipeline (optim/loss_scaler.h): an overflowed step's gradients
// (here: an infinite scale, so inf and NaN) make the norm non-finite on every stage — NaN
// included — and skipping it leaves no trace: after a skipped step and a step scaled by 2^10,
// every stage's parameters are bit for bit those after the one unscaled step.
TEST(PipelineLossScaling, AnOverflowIsSeenOnEveryStageAndASkippedStepLeavesNoTrace) {
  Gpt2Config mc;
  mc.vocab_size = 256;
  mc.max_seq_len = 16;
  mc.d_model = 32;
  mc.n_layers = 2;
  mc.n_heads = 2;
  const int pp = 2, m = 2;
  std::vector<std::vector<float>> after[2];  // [run][rank]: stage parameters
  for (int run = 0; run < 2; ++run) {
    after[run].resize(pp);
    testing::run_on_thread_ranks(pp, [&](Communicator& comm) {
      auto solo = comm.split(comm.rank(), 0);
      ThreadPool pool(1);
      const Device device = Device::cpu(comm.rank());
      PipelineConfig pc;
      pc.schedule = "1f1b";
      pc.microbatches = m;
      pc.micro_batch_size = 2;
      pc.seq_len = 16;
      PipelineParallel pipe(mc, comm, *solo, pool, device, pc, DataParallelConfig{}, AdamWConfig{}, 3);
      const MicroBatches mb = random_micro_batches(m, 2, 16, device, 11);
      if (run == 1) {
        pipe.train_step(mb.tokens, mb.targets, std::numeric_limits<double>::infinity());
        const double overflowed = pipe.clip_grad_norm(0.1, std::numeric_limits<double>::infinity());
        EXPECT_FALSE(std::isfinite(overflowed)) << "rank " << comm.rank() << ": " << overflowed;
      }
      const double scale = run == 1 ? 1024.0 : 1.0;
      pipe.train_step(mb.tokens, mb.targets, scale);
      EXPECT_TRUE(std::isfinite(pipe.clip_grad_norm(0.1, scale)));
      pipe.optimizer_step(1e-2f);
      const Tensor& v = pipe.chunk(0).params().values();
      after[run][comm.rank()].assign(v.data<float>(), v.data<float>() + v.numel());
    });
  }
  for (int r = 0; r < pp; ++r) EXPECT_EQ(after[0][r], after[1][r]) << "stage " << r;
}

// ZeRO-1 under pipelining reduce-scatters each unit's gradient once a step, as without it
// (Megatron's distributed optimizer), where stage 0 all-reduces its buckets: the tied
// embedding's units wait for the sum of both copies (then reduce-scattered), and the norm sums
// each stage's reduced chunks over dp. pp 2 × dp 2, each dp rank its own micro-batches: the
// norm and the updated parameters are stage 0's within rounding, the two copies of the tied
// embedding stay bit for bit the same, and every unit went through exactly one collective.
TEST(PipelineZeroOne, ReduceScattersEachUnitOnceAndMatchesStageZero) {
  Gpt2Config mc = small_pipeline_gpt();
  const int pp = 2, dp = 2, m = 2;
  double norms[2][pp * dp];
  std::vector<float> values[2][pp * dp], wte[2][pp * dp];
  int64_t collectives[2][pp * dp], units[pp * dp];
  for (int zero = 0; zero < 2; ++zero)
    testing::run_on_thread_ranks(pp * dp, [&](Communicator& comm) {
      const int r = comm.rank();
      auto pp_group = comm.split(r / pp, r % pp);  // stage r % pp of replica r / pp
      auto dp_group = comm.split(r % pp, r / pp);
      ThreadPool pool(1);
      const Device device = Device::cpu(r);
      PipelineConfig pc;
      pc.schedule = "1f1b";
      pc.microbatches = m;
      pc.micro_batch_size = 2;
      pc.seq_len = 16;
      DataParallelConfig dc;
      dc.zero = zero;
      PipelineParallel pipe(mc, *pp_group, *dp_group, pool, device, pc, dc, AdamWConfig{}, 3);
      for (int step = 0; step < 2; ++step) {
        const MicroBatches mb = random_micro_batches(m, 2, 16, device, 11 + 7 * (r / pp) + step);
        pipe.train_step(mb.tokens, mb.targets, 1.0);
        norms[zero][r] = pipe.clip_grad_norm(0.5);
        collectives[zero][r] = pipe.chunk_engine(0).step_stats().collectives;
        pipe.optimizer_step(1e-2f);
      }
      units[r] = static_cast<int64_t>(pipe.chunk(0).params().units().size());
      const Tensor& v = pipe.chunk(0).params().values();
      values[zero][r].assign(v.data<float>(), v.data<float>() + v.numel());
      const Tensor& w = pipe.chunk(0).head_weight()->value;
      wte[zero][r].assign(w.data<float>(), w.data<float>() + w.numel());
    });
  for (int r = 0; r < pp * dp; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_NEAR(norms[1][r], norms[0][r], 1e-6 * norms[0][r]);
    EXPECT_EQ(norms[1][r], norms[1][0]);  // one norm on every rank
    EXPECT_GT(norms[0][r], 0.5);          // clipped: the norm's factor is in the update
    EXPECT_EQ(collectives[0][r], 1);      // stage 0: one bucket
    EXPECT_EQ(collectives[1][r], units[r]);
    ASSERT_EQ(values[1][r].size(), values[0][r].size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < values[0][r].size(); ++i) {
      diff += std::pow(values[1][r][i] - values[0][r][i], 2);
      norm += std::pow(values[0][r][i], 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5);     // as every layout against one device
    EXPECT_EQ(values[1][r], values[1][r % pp]);  // the dp replicas hold the same weights
  }
  for (int d = 0; d < dp; ++d)  // the tied embedding: stage 0's wte, stage 1's copy
    EXPECT_EQ(wte[1][d * pp], wte[1][d * pp + 1]);
}

}  // namespace
}  // namespace loom
