// Tensor parallelism in training (issue 5): 10 steps of a small GPT with a 257-token vocabulary
// (padded on every tp > 1) in fp32 through run_training on thread ranks, for tp ∈ {2, 4} with
// and without sequence parallelism and tp = 2 × dp = 2 (ZeRO 0 and 3), against the
// single-device run: losses within 1e-5 relative at every step, final parameters (gathered into
// the whole-model checkpoint) within 1e-4 relative L2 error per tensor. Plus: resuming a tp = 2
// run as tp = 4 with sequence parallelism, sequence parallelism lowering activation memory, the
// backward's overlap of collectives and weight gradients training the same bits, and
// misconfigurations named in errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "data/dataset.h"
#include "parallel/run_compare.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kSteps = 10;

struct Layout {
  int tp, dp;
  bool sp;
  int zero;
  std::string name() const {
    return "tp" + std::to_string(tp) + "_dp" + std::to_string(dp) + (sp ? "_sp" : "") + "_zero" +
           std::to_string(zero);
  }
};

class TensorParallelRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_tp_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 60000, 4000, 5);
    TrainOptions o = options("reference");
    run_training(config({1, 1, false, 0}), o);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static Config config(const Layout& l) {
    Config c = parse_config(R"(
[model]
vocab_size = 257
seq_len = 16
d_model = 32
n_layers = 2
n_heads = 4
[train]
batch_size = 8
micro_batch_size = 2
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 10
seed = 5
[runtime]
threads_per_rank = 1
)", "tp_test.toml");
    c.train.steps = kSteps;
    c.train.micro_batch_size = 8 / (2 * l.dp);  // 2 micro-batches per rank
    c.parallel.tp = l.tp;
    c.parallel.dp = l.dp;
    c.parallel.zero = l.zero;
    c.parallel.sequence_parallel = l.sp;
    c.runtime.ranks = l.tp * l.dp;
    c.data.train = (root_ / "data" / "train_*.bin").string();
    return c;
  }
  static TrainOptions options(const std::string& name) {
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / name).string();
    return o;
  }
  static std::vector<nlohmann::json> metrics(const std::string& name) {
    return testing::read_metrics(root_ / name);
  }
  static void expect_matches_reference(const std::string& name) {
    const auto ref = metrics("reference"), got = metrics(name);
    ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double a = ref[i]["loss"].get<double>(), b = got[i]["loss"].get<double>();
      EXPECT_NEAR(b, a, 1e-5 * std::abs(a)) << name << " step " << i + 1;
    }
    const auto weights = [&](const std::string& run) {
      return root_ / run / "checkpoints" / ("step_" + std::to_string(kSteps)) / "model.safetensors";
    };
    testing::expect_weights_match(weights("reference"), weights(name), name);
  }
  static fs::path root_;
};
fs::path TensorParallelRuns::root_;

class TensorParallelEquivalence : public TensorParallelRuns,
                                  public ::testing::WithParamInterface<Layout> {};

TEST_P(TensorParallelEquivalence, MatchesOneDevice) {
  const Layout l = GetParam();
  run_training(config(l), options(l.name()));
  expect_matches_reference(l.name());
  // The step metrics report the bytes each axis moved.
  const nlohmann::json bytes = metrics(l.name()).back()["comm_bytes"];
  EXPECT_GT(bytes["tp"].get<int64_t>(), 0);
  EXPECT_EQ(bytes["pp"].get<int64_t>(), 0);
  if (l.dp > 1) {
    EXPECT_GT(bytes["dp"].get<int64_t>(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, TensorParallelEquivalence,
                         ::testing::Values(Layout{2, 1, false, 0}, Layout{2, 1, true, 0},
                                           Layout{4, 1, false, 0}, Layout{4, 1, true, 0},
                                           Layout{2, 2, false, 0}, Layout{2, 2, true, 1},
                                           Layout{2, 2, true, 3}),
                         [](const ::testing::TestParamInfo<Layout>& p) { return p.param.name(); });

TEST_F(TensorParallelRuns, ResumesUnderAnotherTensorParallelLayout) {
  TrainOptions o = options("resume");
  o.stop_after = 5;
  run_training(config({2, 1, false, 0}), o);
  o.stop_after = 0;
  o.resume = "auto";
  run_training(config({4, 1, true, 0}), o);
  expect_matches_reference("resume");
}

TEST_F(TensorParallelRuns, SequenceParallelismLowersActivationMemory) {
  // Activations large enough to dominate the step's transient buffers.
  auto big = [&](bool sp) {
    Config c = config({2, 1, sp, 0});
    c.model.seq_len = 64;
    c.model.d_model = 64;
    c.train.micro_batch_size = 4;
    c.train.steps = 2;
    c.train.save_every = 0;
    return c;
  };
  run_training(big(false), options("mem_plain"));
  run_training(big(true), options("mem_sp"));
  const double plain = metrics("mem_plain").back()["mem_activations_peak_mb"].get<double>();
  const double sp = metrics("mem_sp").back()["mem_activations_peak_mb"].get<double>();
  EXPECT_LT(sp, plain) << "activation peak with sequence parallelism " << sp << " MiB, without " << plain;
}

// parallel.tp_backward_overlap = "on" trains the bits of "off" (waiting at once): every step's
// loss and gradient norm and the final weights, with and without sequence parallelism, also
// under dp 2 with ZeRO-3.
TEST_F(TensorParallelRuns, BackwardOverlapTrainsTheSameBits) {
  for (const Layout& l : {Layout{2, 1, false, 0}, Layout{2, 1, true, 0}, Layout{2, 2, true, 3}}) {
    std::string names[2];
    for (const bool overlap : {false, true}) {
      Config c = config(l);
      c.train.steps = 4;
      c.train.save_every = 4;
      c.parallel.tp_backward_overlap = overlap ? "on" : "off";
      names[overlap] = l.name() + (overlap ? "_overlap" : "_no_overlap");
      run_training(c, options(names[overlap]));
    }
    const auto off = metrics(names[0]), on = metrics(names[1]);
    ASSERT_EQ(off.size(), 4u) << l.name();
    ASSERT_EQ(on.size(), off.size()) << l.name();
    for (size_t i = 0; i < off.size(); ++i)
      for (const char* key : {"loss", "grad_norm"})
        EXPECT_EQ(on[i][key].get<double>(), off[i][key].get<double>())
            << l.name() << ": " << key << " at step " << i + 1;
    const auto weights = [&](const std::string& run) {
      return root_ / run / "checkpoints" / "step_4" / "model.safetensors";
    };
    testing::expect_weights_match(weights(names[0]), weights(names[1]), l.name(), 0.0);
  }
}

TEST_F(TensorParallelRuns, MisconfigurationsAreNamedErrors) {
  auto expect_error = [&](Config c, const std::string& text) {
    try {
      run_training(c, options("bad"));
      ADD_FAILURE() << "no error, expected: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  Config heads = config({4, 1, false, 0});
  heads.model.n_heads = 2;
  expect_error(heads, "parallel.tp = 4 does not divide model.n_heads = 2");
  Config world = config({4, 1, false, 0});
  world.runtime.ranks = 2;
  expect_error(world, "parallel.dp × parallel.tp = 1 × 4 = 4 does not divide the 2 ranks of the job");
  Config tokens = config({4, 1, true, 0});
  tokens.model.seq_len = 15;
  tokens.model.max_seq_len = 16;
  tokens.train.micro_batch_size = 1;
  tokens.train.batch_size = 2;
  expect_error(tokens, "do not split over parallel.tp = 4");
}

}  // namespace
}  // namespace loom
