// Data parallelism and ZeRO 1/2/3 (issue 4): every layout trains like one device.
//
// End to end through run_training on local thread ranks: 10 steps of a small GPT in fp32 for
// dp ∈ {1,2,3,4} × zero ∈ {0,1,2,3} × micro-batches ∈ {1,3} with the same global batch, against
// the single-device run: losses to 1e-5 relative at every step, final parameters to 1e-4 relative
// (L2 error of each tensor). Plus: the same layout twice gives identical bits, a run resumes
// under another layout, ZeRO-3 shards initialise like the full model, the measured state bytes
// follow the ZeRO paper's figures, and bucket all-reduces complete while backward still runs.
#include "parallel/data_parallel.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "data/dataset.h"
#include "device/allocator.h"
#include "harness/error_of.h"
#include "harness/thread_ranks.h"
#include "models/gpt2.h"
#include "optim/loss_scaler.h"
#include "parallel/run_compare.h"
#include "tensor/rng.h"
#include "train/evaluate.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kGlobalBatch = 36;  // divisible by dp × micro-batches for every case below
constexpr int64_t kSteps = 10;

// The corpus and the single-device reference run, made once for the whole suite.
class DataParallelRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_dp_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 60000, 4000, 5);
    run("reference", 1, 0, 1);
  }
  static void TearDownTestSuite() { if (!getenv("LOOM_KEEP")) fs::remove_all(root_); }

  static Config config(int dp, int zero, int micro_batches) {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 2
n_heads = 2
[train]
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 10
seed = 5
[runtime]
threads_per_rank = 1
)", "dp_test.toml");
    c.train.steps = kSteps;
    c.train.batch_size = kGlobalBatch;
    c.train.micro_batch_size = kGlobalBatch / (dp * micro_batches);
    c.parallel.dp = dp;
    c.parallel.zero = zero;
    c.parallel.bucket_mb = 0.02;  // several buckets even for this small model
    c.runtime.ranks = dp;
    c.data.train = (root_ / "data" / "train_*.bin").string();
    return c;
  }

  static TrainSummary run(const std::string& name, int dp, int zero, int micro_batches,
                          const std::string& resume = "", int64_t stop_after = 0) {
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    o.resume = resume;
    o.stop_after = stop_after;
    return run_training(config(dp, zero, micro_batches), o);
  }

  static std::vector<nlohmann::json> metrics(const std::string& name) {
    return testing::read_metrics(root_ / name);
  }

  static fs::path final_weights(const std::string& name) {
    return root_ / name / "checkpoints" / ("step_" + std::to_string(kSteps)) / "model.safetensors";
  }

  static void expect_losses_match(const std::string& name, int64_t from_step = 1) {
    const auto ref = metrics("reference");
    const auto got = metrics(name);
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (size_t i = static_cast<size_t>(from_step - 1); i < ref.size(); ++i) {
      const double a = ref[i]["loss"].get<double>(), b = got[i]["loss"].get<double>();
      EXPECT_NEAR(b, a, 1e-5 * std::abs(a)) << name << " step " << i + 1;
    }
  }

  static void expect_weights_match(const std::string& name) {
    testing::expect_weights_match(final_weights("reference"), final_weights(name), name);
  }

  static fs::path root_;
};
fs::path DataParallelRuns::root_;

struct Layout {
  int dp, zero, micro_batches;
};

class DataParallelEquivalence : public DataParallelRuns,
                                public ::testing::WithParamInterface<Layout> {};

TEST_P(DataParallelEquivalence, MatchesOneDevice) {
  const Layout l = GetParam();
  const std::string name = "dp" + std::to_string(l.dp) + "_z" + std::to_string(l.zero) + "_m" +
                           std::to_string(l.micro_batches);
  run(name, l.dp, l.zero, l.micro_batches);
  expect_losses_match(name);
  expect_weights_match(name);
}

std::vector<Layout> all_layouts() {
  std::vector<Layout> out;
  for (int dp : {1, 2, 3, 4})
    for (int zero : {0, 1, 2, 3})
      for (int m : {1, 3}) out.push_back({dp, zero, m});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, DataParallelEquivalence, ::testing::ValuesIn(all_layouts()),
                         [](const ::testing::TestParamInfo<Layout>& p) {
                           return "dp" + std::to_string(p.param.dp) + "_zero" +
                                  std::to_string(p.param.zero) + "_micro" +
                                  std::to_string(p.param.micro_batches);
                         });

TEST_F(DataParallelRuns, EvaluationIsSharedOutOverReplicas) {
  // 3 micro-batches over 2 ranks: rank 0 runs batches 0 and 2, rank 1 batch 1; both return the
  // mean one rank gets running all three. The "loss" here is a function of the batch's tokens.
  const std::vector<std::string> shards = {(root_ / "data" / "val_000000.bin").string()};
  const auto token_loss = [](const Tensor& inputs, const Tensor&) {
    return static_cast<double>(inputs.data<int32_t>()[0] + 3 * inputs.data<int32_t>()[5]);
  };
  int calls = 0;
  const auto counted = [&](const Tensor& in, const Tensor& tg) { ++calls; return token_loss(in, tg); };
  const double whole = evaluate(counted, shards, 2, 16, 3, Device::cpu(), nullptr);
  EXPECT_EQ(calls, 3);
  std::vector<int> rank_calls(2, 0);
  std::vector<double> rank_val(2, 0.0);
  testing::run_on_thread_ranks(2, [&](Communicator& comm) {
    int& n = rank_calls[comm.rank()];
    const auto mine = [&](const Tensor& in, const Tensor& tg) { ++n; return token_loss(in, tg); };
    rank_val[comm.rank()] = evaluate(mine, shards, 2, 16, 3, Device::cpu(comm.rank()), &comm);
  });
  EXPECT_EQ(rank_calls, (std::vector<int>{2, 1}));
  EXPECT_EQ(rank_val[0], whole);
  EXPECT_EQ(rank_val[1], whole);
}

TEST_F(DataParallelRuns, ReplicasShareTheEvaluationAndReportOneDevicesValidationLoss) {
  // Evaluation covers eval_batches micro-batches of micro_batch_size sequences, whatever the
  // layout; data-parallel replicas (whole pipelines with pp) share them out (3 over dp = 2 or 4:
  // unequal shares, a rank with none) and all-reduce the sum. ZeRO-3 replicas evaluate all of them
  // (each forward gathers over dp). Same micro-batch size everywhere, so every layout sees the
  // same validation data.
  const auto run_with_eval = [](const std::string& name, int dp, int zero, int pp, int dp_shard = 0,
                                int cp = 1) {
    Config c = config(dp, zero, 1);
    c.parallel.pp = pp;
    c.parallel.dp_shard = dp_shard;
    c.parallel.cp = cp;
    c.runtime.ranks = dp * pp * cp;
    c.train.micro_batch_size = 3;  // accumulation makes up the rest of the batch of 36
    c.train.eval_every = 5;
    c.train.eval_batches = 3;
    c.data.val = (root_ / "data" / "val_*.bin").string();
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    run_training(c, o);
    return metrics(name);
  };
  const auto val_losses = [](const std::vector<nlohmann::json>& m) {
    std::vector<double> out;
    for (const auto& r : m)
      if (r.contains("val_loss")) out.push_back(r["val_loss"].get<double>());
    return out;
  };
  const std::vector<double> one = val_losses(run_with_eval("eval_one", 1, 0, 1));
  ASSERT_EQ(one.size(), 2u);  // steps 5 and 10
  // dp × pp = 2 × 2: the two pipelines share the micro-batches out.
  for (const auto& [name, dp, zero, pp] :
       {std::tuple{"eval_dp2", 2, 1, 1}, std::tuple{"eval_dp4", 4, 0, 1},
        std::tuple{"eval_dp2_zero3", 2, 3, 1}, std::tuple{"eval_dp2_pp2", 2, 1, 2}}) {
    const std::vector<double> got = val_losses(run_with_eval(name, dp, zero, pp));
    ASSERT_EQ(got.size(), one.size()) << name;
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(got[i], one[i], 1e-5 * std::abs(one[i])) << name << " evaluation " << i;
  }
  // Hybrid sharding: ZeRO-3 gathering within pairs, the pairs sharing the batches out; ZeRO-2 in
  // pairs sharing them over all four replicas; ZeRO-3 over each cp pair alone (dp_shard 1), the
  // cp pairs sharing them.
  for (const auto& [zero, dp, cp, shard] :
       {std::tuple{3, 4, 1, 2}, std::tuple{2, 4, 1, 2}, std::tuple{3, 2, 2, 1}}) {
    const std::string name = "eval_dp" + std::to_string(dp) + "_cp" + std::to_string(cp) +
                             "_shard" + std::to_string(shard) + "_zero" + std::to_string(zero);
    const std::vector<double> got = val_losses(run_with_eval(name, dp, zero, 1, shard, cp));
    ASSERT_EQ(got.size(), one.size()) << name;
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(got[i], one[i], 1e-5 * std::abs(one[i])) << name << " evaluation " << i;
  }
}

TEST_F(DataParallelRuns, SameLayoutTwiceIsBitwiseIdentical) {
  for (const Layout l : {Layout{3, 3, 3}, Layout{2, 0, 1}}) {
    const std::string a = "twice_a_" + std::to_string(l.zero), b = "twice_b_" + std::to_string(l.zero);
    run(a, l.dp, l.zero, l.micro_batches);
    run(b, l.dp, l.zero, l.micro_batches);
    const auto ma = metrics(a), mb = metrics(b);
    ASSERT_EQ(ma.size(), mb.size());
    for (size_t i = 0; i < ma.size(); ++i)
      for (const char* key : {"loss", "grad_norm", "lr"}) EXPECT_EQ(ma[i][key], mb[i][key]) << key << " step " << i + 1;
  }
}

// parallel.grad_reduce_dtype = "bf16": gradients rounded to bf16 for their all-reduce (ZeRO 0)
// or reduce-scatter (ZeRO 2 with accumulation, ZeRO 3): half the dp bytes of the fp32 run of the
// same layout (ZeRO 0; less with the parameters' fp32 all-gathers of ZeRO 2 and 3), losses near one device's (bf16's rounding of the gradients, not fp32's 1e-5), not
// the fp32 run's bits (something was rounded), and the same bits when run twice.
TEST_F(DataParallelRuns, GradientsReducedInBf16HalveTheBytesAndStayNearOneDevice) {
  const auto run_with = [&](const std::string& name, int zero, int micro, const std::string& dtype) {
    Config c = config(2, zero, micro);
    c.parallel.grad_reduce_dtype = dtype;
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    run_training(c, o);
    return metrics(name);
  };
  const auto ref = metrics("reference");
  for (const auto& [zero, micro] : {std::pair{0, 1}, std::pair{2, 3}, std::pair{3, 1}}) {
    SCOPED_TRACE("zero " + std::to_string(zero) + ", " + std::to_string(micro) + " micro-batches");
    const std::string tag = std::to_string(zero) + "_" + std::to_string(micro);
    const auto fp32 = run_with("reduce_fp32_" + tag, zero, micro, "fp32");
    const auto bf16 = run_with("reduce_bf16_" + tag, zero, micro, "bf16");
    const auto again = run_with("reduce_bf16_again_" + tag, zero, micro, "bf16");
    ASSERT_EQ(bf16.size(), ref.size());
    double worst = 0, from_fp32 = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double want = ref[i]["loss"], got = bf16[i]["loss"];
      worst = std::max(worst, std::abs(got - want) / std::abs(want));
      from_fp32 = std::max(from_fp32, std::abs(got - fp32[i]["loss"].get<double>()));
      EXPECT_EQ(bf16[i]["loss"], again[i]["loss"]) << "step " << i + 1 << " not repeatable";
      const double bytes32 = fp32[i]["comm_bytes"]["dp"], bytes16 = bf16[i]["comm_bytes"]["dp"];
      // Half, but for a few scalars (the loss, the norm) and, with ZeRO 1-3, the parameters'
      // all-gathers, which stay fp32.
      if (zero == 0) {
        EXPECT_NEAR(bytes16 / bytes32, 0.5, 1e-3) << "step " << i + 1;
      } else {
        EXPECT_LT(bytes16, 0.9 * bytes32) << "step " << i + 1;
      }
    }
    EXPECT_LT(worst, 1e-3) << "bf16 gradients strayed from one device";
    EXPECT_GT(from_fp32, 0.0) << "nothing was rounded";
    RecordProperty("worst_loss_deviation_zero" + tag, std::to_string(worst));
  }
}

// parallel.param_gather_dtype = "bf16" (ZeRO-3): the parameters gathered for forward and backward
// in bf16 (FSDP's param_dtype), the gradients reduced in bf16 too: fewer dp bytes than the same
// run with fp32 gathers (2/3 of them here: the gathers halve, the reduce-scatters stay), the
// weights used rounded to bf16 (near one device: 2e-3, not the fp32 gathers' bits), the same
// bits twice; a stage other than 3 is refused by name.
TEST_F(DataParallelRuns, ZeroThreeGathersParametersInBf16) {
  const auto run_with = [&](const std::string& name, const std::string& gather) {
    Config c = config(2, 3, 1);
    c.parallel.grad_reduce_dtype = "bf16";
    c.parallel.param_gather_dtype = gather;
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    run_training(c, o);
    return metrics(name);
  };
  const auto reduced = run_with("gather_fp32", "fp32");  // bf16 gradients, fp32 gathers
  const auto bf16 = run_with("gather_bf16", "bf16");
  const auto again = run_with("gather_bf16_again", "bf16");
  const auto ref = metrics("reference");
  ASSERT_EQ(bf16.size(), ref.size());
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double want = ref[i]["loss"], got = bf16[i]["loss"];
    worst = std::max(worst, std::abs(got - want) / std::abs(want));
    EXPECT_EQ(bf16[i]["loss"], again[i]["loss"]) << "step " << i + 1 << " not repeatable";
    const double b16 = bf16[i]["comm_bytes"]["dp"], b32 = reduced[i]["comm_bytes"]["dp"];
    // The gathers halve, the (bf16) gradients' reduce-scatter stays.
    EXPECT_LT(b16 / b32, 0.75) << "step " << i + 1;
    EXPECT_GT(b16 / b32, 0.5) << "step " << i + 1;
  }
  EXPECT_LT(worst, 2e-3) << "bf16 weights strayed from one device";
  EXPECT_NE(bf16.back()["loss"], reduced.back()["loss"]) << "the weights were not rounded";
  RecordProperty("worst_loss_deviation", std::to_string(worst));
  Config bad = config(2, 2, 1);
  bad.parallel.param_gather_dtype = "bf16";
  EXPECT_NE(testutil::error_of([&] { validate(bad); }).find("parallel.zero = 3"),
            std::string::npos);
}

TEST_F(DataParallelRuns, ResumesUnderAnotherLayout) {
  // Stop a dp=2 / ZeRO-1 run at step 5; continue it as dp=4 / ZeRO-3 and as one device.
  run("resume_first", 2, 1, 3, "", 5);
  fs::copy(root_ / "resume_first", root_ / "resume_one", fs::copy_options::recursive);
  run("resume_first", 4, 3, 1, "auto");
  run("resume_one", 1, 0, 1, "auto");
  expect_losses_match("resume_first");
  expect_losses_match("resume_one");
  expect_weights_match("resume_first");
}

// Hybrid sharding (parallel.dp_shard, HSDP): ZeRO's state sharded over groups of dp_shard of the
// dp ranks, the groups replicas of each other, stages 2/3 all-reducing each reduced chunk over
// the replicas.
struct HybridLayout {
  int dp, dp_shard, zero, micro_batches;
  std::string name() const {
    return "hsdp_dp" + std::to_string(dp) + "_shard" + std::to_string(dp_shard) + "_zero" +
           std::to_string(zero) + "_micro" + std::to_string(micro_batches);
  }
};

class HybridSharding : public DataParallelRuns, public ::testing::WithParamInterface<HybridLayout> {
 protected:
  static Config hybrid_config(const HybridLayout& l) {
    Config c = config(l.dp, l.zero, l.micro_batches);
    c.parallel.dp_shard = l.dp_shard;
    return c;
  }
  static void run_hybrid(const std::string& name, const Config& c, const std::string& resume = "",
                         int64_t stop_after = 0) {
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    o.resume = resume;
    o.stop_after = stop_after;
    run_training(c, o);
  }
};

TEST_P(HybridSharding, MatchesOneDevice) {
  const HybridLayout l = GetParam();
  const Config c = hybrid_config(l);
  run_hybrid(l.name(), c);
  expect_losses_match(l.name());
  expect_weights_match(l.name());
  // What crossed between the replicas, each step: at stages 2/3 every micro-batch's reduced
  // chunks — a shard of the gradients, each unit padded to 16 · dp elements, over dp_shard ranks —
  // in fp32; at stage 1 the last micro-batch's only (the step's whole gradient reduced once).
  int64_t padded = 0;
  const int64_t multiple = 16 * int64_t{l.dp};
  Gpt2 model(model_config_of(c));
  for (const ParamUnit& unit : model.params().units()) {
    int64_t n = 0;
    for (const Parameter* p : unit.params) n += p->numel();
    padded += (n + multiple - 1) / multiple * multiple;
  }
  const int64_t replicated = (l.zero >= 2 ? l.micro_batches : 1) * padded / l.dp_shard * 4;
  for (const nlohmann::json& r : metrics(l.name())) {
    ASSERT_TRUE(r["comm_bytes"].contains("dp_replicate")) << r.dump();
    EXPECT_EQ(r["comm_bytes"]["dp_replicate"].get<int64_t>(), replicated) << r.dump();
    EXPECT_GT(r["comm_bytes"]["dp"].get<int64_t>(), replicated);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, HybridSharding,
                         ::testing::Values(HybridLayout{4, 2, 1, 1}, HybridLayout{4, 2, 1, 3},
                                           HybridLayout{4, 2, 2, 3}, HybridLayout{4, 2, 3, 1},
                                           HybridLayout{4, 2, 3, 3}, HybridLayout{4, 1, 3, 1},
                                           HybridLayout{6, 3, 3, 1}, HybridLayout{6, 2, 2, 1}),
                         [](const ::testing::TestParamInfo<HybridLayout>& p) {
                           return p.param.name();
                         });

TEST_F(HybridSharding, SameLayoutTwiceAndResumedIsBitwiseIdentical) {
  const HybridLayout l{4, 2, 3, 3};
  const Config c = hybrid_config(l);
  run_hybrid("hsdp_twice_a", c);
  run_hybrid("hsdp_twice_b", c);
  Config sharded = c;
  sharded.train.checkpoint_format = "sharded";
  run_hybrid("hsdp_cut", sharded, "", 5);
  run_hybrid("hsdp_cut", sharded, "auto");
  const auto a = metrics("hsdp_twice_a"), b = metrics("hsdp_twice_b"), cut = metrics("hsdp_cut");
  ASSERT_EQ(a.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(b.size(), a.size());
  ASSERT_EQ(cut.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (const char* key : {"loss", "grad_norm"}) {
      EXPECT_EQ(a[i][key], b[i][key]) << key << " step " << i + 1;
      EXPECT_EQ(a[i][key], cut[i][key]) << key << " step " << i + 1 << " after the resume";
    }
}

TEST_F(HybridSharding, ShardedCheckpointsResumeUnderOtherLayouts) {
  // Every rank writes a disjoint piece (a chunk split between the replicas holding it); the
  // checkpoint reads back under plain ZeRO and one device, and a plain ZeRO-3 checkpoint under
  // hybrid sharding.
  Config hybrid = hybrid_config({4, 2, 3, 1});
  hybrid.train.checkpoint_format = "sharded";
  run_hybrid("hsdp_from", hybrid, "", 5);
  fs::copy(root_ / "hsdp_from", root_ / "hsdp_from_one", fs::copy_options::recursive);
  run_hybrid("hsdp_from", config(2, 1, 3), "auto");
  run("hsdp_from_one", 1, 0, 1, "auto");
  Config zero3 = config(4, 3, 1);
  zero3.train.checkpoint_format = "sharded";
  run_hybrid("hsdp_to", zero3, "", 5);
  Config hybrid2 = hybrid_config({4, 2, 2, 3});
  run_hybrid("hsdp_to", hybrid2, "auto");
  for (const char* name : {"hsdp_from", "hsdp_from_one", "hsdp_to"}) {
    expect_losses_match(name);
    expect_weights_match(name);
  }
}

TEST_F(HybridSharding, ShardSizesAreCheckedByName) {
  Config c = hybrid_config({4, 3, 3, 1});
  EXPECT_NE(testutil::error_of([&] {
              validate(c);
            }).find("parallel.dp_shard = 3 does not divide parallel.dp = 4"),
            std::string::npos);
  c = hybrid_config({4, 2, 0, 1});
  EXPECT_NE(testutil::error_of([&] { validate(c); }).find("parallel.zero = 0"), std::string::npos);
  // dp_shard = dp is plain ZeRO, at any stage.
  c = hybrid_config({4, 4, 0, 1});
  EXPECT_NO_THROW(validate(c));
}

// Per-rank work outside run_training: random tokens, one model per thread rank.
struct RankSetup {
  Gpt2Config model;
  int64_t micro = 2, seq = 16;
};

Gpt2Config small_model(int64_t d, int64_t layers) {
  Gpt2Config c;
  c.vocab_size = 256;
  c.max_seq_len = 16;
  c.d_model = d;
  c.n_layers = layers;
  c.n_heads = 2;
  return c;
}

void fill_tokens(Tensor& t, uint64_t seed, int rank) {
  RandomStream rng(seed, "tokens/" + std::to_string(rank));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % 256);
}

TEST(DataParallelEngine, ZeroThreeShardsInitialiseLikeTheFullModel) {
  const Gpt2Config mc = small_model(32, 2);
  Gpt2 reference(mc);
  reference.build(DType::kF32, Device::cpu(), 9);
  const Tensor& expected = reference.params().values();
  testing::run_on_thread_ranks(3, [&](Communicator& comm) {
    ThreadPool pool(1);
    Gpt2 model(mc);
    auto engine = DataParallel::create(model.params(), comm, pool, Device::cpu(comm.rank()),
                                       DataParallelConfig{3, 1 << 20}, AdamWConfig{}, 9);
    const FlatModelState state = engine->gather_state();
    for (const auto& p : model.params().parameters()) {
      const Parameter& q = reference.params().get(p->name);
      const float* a = state.values.data<float>() + p->offset;
      const float* b = expected.data<float>() + q.offset;
      for (int64_t i = 0; i < p->numel(); ++i)
        ASSERT_EQ(a[i], b[i]) << p->name << "[" << i << "] on rank " << comm.rank();
    }
  });
}

TEST(DataParallelEngine, StateBytesFollowTheZeroPaper) {
  // Ψ parameters, N = 4 ranks, fp32: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N bytes of model state.
  const Gpt2Config mc = small_model(64, 2);
  const double psi = static_cast<double>(mc.num_parameters());
  const int n = 4;
  const double expected[4] = {16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n};
  for (int zero = 0; zero <= 3; ++zero) {
    testing::run_on_thread_ranks(n, [&](Communicator& comm) {
      ThreadPool pool(1);
      Gpt2 model(mc);
      auto engine = DataParallel::create(model.params(), comm, pool, Device::cpu(comm.rank()),
                                         DataParallelConfig{zero, 1 << 20}, AdamWConfig{}, 1);
      const double measured = static_cast<double>(engine->memory().state());
      EXPECT_NEAR(measured, expected[zero], 0.10 * expected[zero])
          << "zero " << zero << " rank " << comm.rank() << ": params " << engine->memory().params
          << " grads " << engine->memory().grads << " optimizer " << engine->memory().optimizer;
    });
  }
}

TEST(DataParallelEngine, HybridShardingDividesTheStateByTheShardGroup) {
  // N = 4 ranks in 2 shard groups of S = 2: 8Ψ + 8Ψ/S, 4Ψ + 12Ψ/S, 16Ψ/S bytes at stages 1-3.
  const Gpt2Config mc = small_model(64, 2);
  const double psi = static_cast<double>(mc.num_parameters());
  const int n = 4, s = 2;
  const double expected[4] = {0, 8 * psi + 8 * psi / s, 4 * psi + 12 * psi / s, 16 * psi / s};
  for (int zero = 1; zero <= 3; ++zero) {
    testing::run_on_thread_ranks(n, [&](Communicator& comm) {
      ThreadPool pool(1);
      Gpt2 model(mc);
      ShardGroups groups = split_shard_groups(comm, s);
      EXPECT_EQ(groups.shard->size(), s);
      EXPECT_EQ(groups.replicate->size(), n / s);
      DataParallelConfig dc{zero, 1 << 20};
      dc.shard_group = groups.shard.get();
      dc.replicate_group = groups.replicate.get();
      auto engine = DataParallel::create(model.params(), comm, pool, Device::cpu(comm.rank()), dc,
                                         AdamWConfig{}, 1);
      const double measured = static_cast<double>(engine->memory().state());
      EXPECT_NEAR(measured, expected[zero], 0.10 * expected[zero]) << "zero " << zero;
    });
  }
}

// Stands between the model and the engine, forwarding every hook; before each block's backward
// it sleeps a little, standing in for a bigger block's compute (on a loaded 2-core CI machine
// the tiny test model's blocks take microseconds, too short for anything to overlap). Sleeping,
// not spinning, leaves the cores to the communication threads.
class SlowBackwardHooks : public ParamHooks {
 public:
  explicit SlowBackwardHooks(ParamHooks& inner) : inner_(inner) {}
  void before_forward(size_t u) override { inner_.before_forward(u); }
  void after_forward(size_t u) override { inner_.after_forward(u); }
  void before_backward(size_t u) override {
    if (u != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    inner_.before_backward(u);
  }
  void after_backward(size_t u) override { inner_.after_backward(u); }

 private:
  ParamHooks& inner_;
};

TEST(DataParallelEngine, GradientCommunicationOverlapsBackward) {
  // One unit per bucket: each block's all-reduce (stage 0) or reduce-scatter (stages 1 and 2: no
  // buckets, a unit at a time) starts in its after_backward hook and runs on the communicator's
  // progress thread while backward goes on; some must be seen complete from a later hook, before
  // backward ends.
  const Gpt2Config mc = small_model(64, 6);
  for (int zero : {0, 1, 2}) {
    testing::run_on_thread_ranks(2, [&](Communicator& comm) {
      ThreadPool pool(1);
      Gpt2 model(mc);
      auto engine = DataParallel::create(model.params(), comm, pool, Device::cpu(comm.rank()),
                                         DataParallelConfig{zero, 1}, AdamWConfig{}, 1);
      SlowBackwardHooks hooks(*engine);
      Context ctx{&pool, Device::cpu(comm.rank()), DType::kF32, &hooks};
      Tensor tokens = Tensor::empty({4, 16}, DType::kI32), targets = Tensor::empty({4, 16}, DType::kI32);
      int64_t early = 0, issued = 0;
      for (int step = 0; step < 5; ++step) {
        fill_tokens(tokens, step, comm.rank());
        fill_tokens(targets, step + 100, comm.rank());
        engine->begin_step();
        engine->begin_micro_batch(0, 1);
        model.forward(ctx, tokens, targets);
        model.backward(ctx);
        engine->end_micro_batch();
        early += engine->step_stats().done_before_backward_end;
        issued += engine->step_stats().collectives;
        engine->clip_grad_norm(1.0);
        engine->optimizer_step(1e-3f);
      }
      EXPECT_EQ(issued, 5 * 7) << "one collective per unit per step";
      // 6 block collectives per step could finish early; on an idle machine nearly all do.
      EXPECT_GE(early, 5) << "gradient collectives did not complete while backward ran";
    });
  }
}

// ZeRO-1 as Megatron's distributed optimizer: nothing crosses ranks before the step's last
// micro-batch, then one reduce-scatter per unit (however large the buckets: stage 0 sends its 7
// units in one bucket here), and the rank's own chunks of the gradient are stage 0's all-reduced
// gradient — the only part the optimizer and the norm read.
TEST(DataParallelEngine, ZeroOneReduceScattersEachUnitOnceAStep) {
  const Gpt2Config mc = small_model(64, 6);
  testing::run_on_thread_ranks(2, [&](Communicator& comm) {
    ThreadPool pool(1);
    Gpt2 whole(mc), sharded(mc);
    auto stage0 = DataParallel::create(whole.params(), comm, pool, Device::cpu(comm.rank()),
                                       DataParallelConfig{0}, AdamWConfig{}, 1);
    auto stage1 = DataParallel::create(sharded.params(), comm, pool, Device::cpu(comm.rank()),
                                       DataParallelConfig{1}, AdamWConfig{}, 1);
    Tensor tokens = Tensor::empty({2, 16}, DType::kI32),
           targets = Tensor::empty({2, 16}, DType::kI32);
    std::vector<int64_t> collectives;  // after each micro-batch: stage 0's, stage 1's
    for (auto [engine, model] :
         {std::pair{stage0.get(), &whole}, std::pair{stage1.get(), &sharded}}) {
      Context ctx{&pool, Device::cpu(comm.rank()), DType::kF32, engine};
      engine->begin_step();
      for (int micro = 0; micro < 2; ++micro) {
        fill_tokens(tokens, micro, comm.rank());
        fill_tokens(targets, micro + 100, comm.rank());
        engine->begin_micro_batch(micro, 2);
        model->forward(ctx, tokens, targets);
        model->backward(ctx);
        engine->end_micro_batch();
        collectives.push_back(engine->step_stats().collectives);
      }
    }
    EXPECT_EQ(collectives, (std::vector<int64_t>{0, 1, 0, 7}));
    std::vector<std::pair<int64_t, int64_t>> owned;
    stage1->owned_state(owned);
    ASSERT_EQ(owned.size(), 7u);
    const std::vector<float> reduced = whole.params().grads().to_vector();
    const std::vector<float> mine = sharded.params().grads().to_vector();
    double max_diff = 0, max_abs = 0;
    for (const auto& [begin, end] : owned)
      for (int64_t i = begin; i < end; ++i) {
        max_diff = std::max(max_diff, double(std::abs(mine[i] - reduced[i])));
        max_abs = std::max(max_abs, double(std::abs(reduced[i])));
      }
    EXPECT_GT(max_abs, 0.0);
    EXPECT_LE(max_diff, 1e-6 * max_abs);
  });
}

// One engine step of the trainer's shape (train/trainer.cc) with loss scaling: backward on loss ×
// scaler.scale(), the unscaled norm from clip_grad_norm, the update only when the scaler says so.
// `poison` overflows this rank's gradients, as fp16 GEMM operands past 65504 would.
// Returns the norm clip_grad_norm gave and whether the step was applied.
struct ScaledStep {
  double norm = 0;
  bool applied = false;
};
ScaledStep scaled_step(DataParallel& engine, Gpt2& model, Context& ctx, LossScaler& scaler,
                       const Tensor& tokens, const Tensor& targets, bool poison) {
  const double scale = scaler.scale();
  engine.begin_step();
  engine.begin_micro_batch(0, 1);
  model.forward(ctx, tokens, targets);
  // An infinite seed makes every gradient of this rank inf or NaN (under ZeRO 2/3 no full
  // gradient outlives backward, so this is where to poison it).
  model.backward(ctx, poison ? std::numeric_limits<double>::infinity() : scale);
  engine.end_micro_batch();
  const double norm = engine.clip_grad_norm(0.05, scale);  // small enough to clip
  const bool apply = scaler.update(norm);
  if (apply) engine.optimizer_step(1e-2f);
  return {norm, apply};
}

TEST(DataParallelEngine, LossScaledStepsAreBitwiseTheUnscaledOnesAndOverflowsLeaveNoTrace) {
  // dp = 2 under every ZeRO stage, 4 steps each: (a) without scaling; (b) dynamic scaling from
  // 2^40 with a window of 2 (the scale grows during the run), plus one overflowed step injected
  // before the last step (rank 1's gradient gets an inf: the all-reduce or the global norm
  // spreads it, both ranks skip, the scale halves). The skipped step must leave no trace:
  // parameters, AdamW moments and step count after (b) equal (a)'s bit for bit, and the norms
  // the clip returned are (a)'s exactly.
  const Gpt2Config mc = small_model(32, 2);
  for (int zero = 0; zero <= 3; ++zero) {
    std::vector<FlatModelState> states(2);
    std::vector<std::vector<double>> norms(2);
    std::vector<int64_t> opt_steps(2);
    for (int scaled = 0; scaled < 2; ++scaled) {
      testing::run_on_thread_ranks(2, [&](Communicator& comm) {
        ThreadPool pool(1);
        Gpt2 model(mc);
        auto engine = DataParallel::create(model.params(), comm, pool, Device::cpu(comm.rank()),
                                           DataParallelConfig{zero, 1 << 12}, AdamWConfig{}, 3);
        Context ctx{&pool, Device::cpu(comm.rank()), DType::kF32, engine.get()};
        LossScalerConfig lc;
        lc.mode = scaled ? LossScaleMode::kDynamic : LossScaleMode::kNone;
        lc.init = std::ldexp(1.0, 40);
        lc.window = 2;
        LossScaler scaler(lc);
        Tensor tokens = Tensor::empty({2, 16}, DType::kI32),
               targets = Tensor::empty({2, 16}, DType::kI32);
        for (int step = 0; step < 4; ++step) {
          fill_tokens(tokens, step, comm.rank());
          fill_tokens(targets, step + 100, comm.rank());
          if (scaled && step == 3) {
            const double before = scaler.scale();
            const ScaledStep skipped =
                scaled_step(*engine, model, ctx, scaler, tokens, targets, comm.rank() == 1);
            EXPECT_FALSE(skipped.applied) << "rank " << comm.rank();
            EXPECT_FALSE(std::isfinite(skipped.norm));
            EXPECT_EQ(scaler.scale(), before / 2) << "an overflow halves the scale";
          }
          const ScaledStep done = scaled_step(*engine, model, ctx, scaler, tokens, targets, false);
          EXPECT_TRUE(done.applied);
          if (comm.rank() == 0) norms[scaled].push_back(done.norm);
        }
        // After steps 1-2 (window 2) the scale doubled once, the overflow halved it: back to 2^40.
        if (scaled) {
          EXPECT_EQ(scaler.scale(), std::ldexp(1.0, 40));
        }
        FlatModelState st = engine->gather_state();
        if (comm.rank() == 0) {
          states[scaled] = {st.values.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone()};
          opt_steps[scaled] = engine->optimizer_steps();
        }
      });
    }
    EXPECT_EQ(norms[0], norms[1]) << "zero " << zero << ": the unscaled norms differ";
    EXPECT_GT(norms[0][0], 0.05) << "the clip must be active for the test to cover it";
    EXPECT_EQ(opt_steps[0], 4) << "zero " << zero;
    EXPECT_EQ(opt_steps[1], 4) << "zero " << zero << ": the skipped step moved AdamW's count";
    const auto same_bits = [](const Tensor& a, const Tensor& b) {
      return a.numel() == b.numel() &&
             std::memcmp(a.data<float>(), b.data<float>(), sizeof(float) * a.numel()) == 0;
    };
    EXPECT_TRUE(same_bits(states[0].values, states[1].values)) << "zero " << zero;
    EXPECT_TRUE(same_bits(states[0].exp_avg, states[1].exp_avg)) << "zero " << zero;
    EXPECT_TRUE(same_bits(states[0].exp_avg_sq, states[1].exp_avg_sq)) << "zero " << zero;
  }
}

}  // namespace
}  // namespace loom
