// Hybrid parallelism (issue 7): every dp × pp × tp layout trains like one device.
//
// The equivalence matrix: every factorisation of 2, 4, 6 and 8 ranks into (dp, pp, tp) — the
// model (8 blocks, 24 heads of width 2, a 256-token vocabulary padded where tp does not divide
// it) allows them all — crossed with ZeRO ∈ {0, 1} (where dp > 1), schedule ∈ {1f1b,
// interleaved with 2 chunks per rank} (where pp > 1; interleaved where 2·pp ≤ 8 blocks),
// m ∈ {pp, 2·pp} micro-batches per step (m ∈ {1, 2} without pipelining) and recomputation off /
// on (on = full with ZeRO 0, selective with ZeRO 1; sequence parallelism on with it where the
// tokens split over tp); and zb-v (two chunks per rank in a V, where 2·pp ≤ 8 blocks) once per
// ZeRO stage, with 2·pp micro-batches and recomputation on. Each run is 6 steps on local thread
// ranks with the global batch of the one-device reference (48 sequences); the losses match it to
// 1e-5 relative at every step. Plus: the same layout run twice gives the same bits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/dataset.h"
#include "parallel/run_compare.h"
#include "models/gpt2.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kSteps = 6;
constexpr int64_t kBatch = 48;  // sequences per step: every dp × m below divides it
constexpr int64_t kSeq = 8;

struct Mesh {
  int dp, pp, tp;
  std::string name() const {
    return "dp" + std::to_string(dp) + "_pp" + std::to_string(pp) + "_tp" + std::to_string(tp);
  }
};

struct Variant {
  int zero;
  std::string schedule;  // "1f1b", "interleaved" or "zb-v" (pp > 1)
  int microbatches;
  std::string recompute;
  bool sequence_parallel;
  std::string name() const {
    return "zero" + std::to_string(zero) + "_" + schedule + "_m" + std::to_string(microbatches) +
           "_" + recompute + (sequence_parallel ? "_sp" : "");
  }
};

class HybridRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_hybrid_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 20000, 2000, 5);
    TrainOptions o = options("reference");
    run_training(base_config(), o);
    reference_ = read_losses(root_ / "reference");
    ASSERT_EQ(reference_.size(), static_cast<size_t>(kSteps));
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static Config base_config() {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 8
d_model = 48
n_layers = 8
n_heads = 24
[train]
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 0
seed = 11
[runtime]
threads_per_rank = 1
)", "hybrid_test.toml");
    c.train.steps = kSteps;
    c.train.batch_size = kBatch;
    c.train.micro_batch_size = kBatch;
    c.data.train = (root_ / "data" / "train_*.bin").string();
    return c;
  }

  static Config config(const Mesh& mesh, const Variant& v) {
    Config c = base_config();
    c.parallel.dp = mesh.dp;
    c.parallel.pp = mesh.pp;
    c.parallel.tp = mesh.tp;
    c.parallel.zero = v.zero;
    c.parallel.schedule = v.schedule;
    c.parallel.virtual_stages = v.schedule == "interleaved" || v.schedule == "zb-v" ? 2 : 1;
    c.parallel.recompute = v.recompute;
    c.parallel.sequence_parallel = v.sequence_parallel;
    c.train.micro_batch_size = kBatch / (mesh.dp * v.microbatches);
    c.runtime.ranks = mesh.dp * mesh.pp * mesh.tp;
    return c;
  }

  static TrainOptions options(const std::string& name) {
    TrainOptions o;
    o.progress = false;
    o.run_dir = (root_ / name).string();
    return o;
  }

  static fs::path root_;
  static std::vector<double> reference_;
};
fs::path HybridRuns::root_;
std::vector<double> HybridRuns::reference_;

// The variants a mesh is checked under.
std::vector<Variant> variants(const Mesh& mesh) {
  std::vector<Variant> out;
  std::vector<std::string> schedules = {"1f1b"};
  if (mesh.pp > 1 && 2 * mesh.pp <= 8) schedules.push_back("interleaved");
  const std::vector<int> counts = mesh.pp > 1 ? std::vector<int>{mesh.pp, 2 * mesh.pp}
                                              : std::vector<int>{1, 2};
  for (int zero : mesh.dp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0})
    for (const std::string& schedule : schedules)
      for (int m : counts)
        for (bool recompute : {false, true}) {
          const int64_t micro = kBatch / (mesh.dp * m);
          const bool sp = recompute && mesh.tp > 1 && (micro * kSeq) % mesh.tp == 0;
          out.push_back({zero, schedule, m, recompute ? (zero == 0 ? "full" : "selective") : "none", sp});
        }
  if (mesh.pp > 1 && 2 * mesh.pp <= 8)
    for (int zero : mesh.dp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0}) {
      const int m = 2 * mesh.pp;
      const bool sp = mesh.tp > 1 && (kBatch / (mesh.dp * m) * kSeq) % mesh.tp == 0;
      out.push_back({zero, "zb-v", m, zero == 0 ? "full" : "selective", sp});
    }
  return out;
}

std::vector<Mesh> meshes() {
  std::vector<Mesh> out;
  for (int world : {2, 4, 6, 8})
    for (int dp = 1; dp <= world; ++dp)
      for (int pp = 1; pp <= world / dp; ++pp)
        if (world % (dp * pp) == 0) out.push_back({dp, pp, world / (dp * pp)});
  return out;
}

class HybridEquivalence : public HybridRuns, public ::testing::WithParamInterface<Mesh> {};

TEST_P(HybridEquivalence, EveryVariantMatchesOneDevice) {
  const Mesh mesh = GetParam();
  for (const Variant& v : variants(mesh)) {
    const std::string name = mesh.name() + "_" + v.name();
    SCOPED_TRACE(name);
    run_training(config(mesh, v), options(name));
    const std::vector<double> got = read_losses(root_ / name);
    ASSERT_EQ(got.size(), reference_.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], reference_[i], 1e-5 * std::abs(reference_[i])) << "step " << i + 1;
    fs::remove_all(root_ / name);
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, HybridEquivalence, ::testing::ValuesIn(meshes()),
                         [](const ::testing::TestParamInfo<Mesh>& p) { return p.param.name(); });

// The same layout twice: the same bits in every metric that is not a time, and in the final
// checkpoint.
TEST_F(HybridRuns, TheSameLayoutTwiceIsBitwiseIdentical) {
  Config c = config({2, 2, 2}, {1, "interleaved", 2, "selective", true});
  c.train.save_every = kSteps;
  for (const char* name : {"twice_a", "twice_b"}) run_training(c, options(name));
  const auto a = testing::read_metrics(root_ / "twice_a"), b = testing::read_metrics(root_ / "twice_b");
  ASSERT_EQ(a.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()) << "step " << i + 1;
  }
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  const std::string step = "step_" + std::to_string(kSteps);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string x = bytes(root_ / "twice_a" / "checkpoints" / step / file);
    EXPECT_FALSE(x.empty()) << file;
    EXPECT_TRUE(x == bytes(root_ / "twice_b" / "checkpoints" / step / file)) << file;
  }
}

// Start-up prints the layout: one line per rank with its (pp, dp, tp) coordinates (tp
// innermost), its parameter count and expected memory; the activation estimate is within 40% of
// the measured peak on rank 0.
TEST_F(HybridRuns, StartUpReportsTheLayoutAndMemoryPerRank) {
  struct Case {
    Mesh mesh;
    Variant variant;
  };
  const Case cases[] = {{{2, 2, 2}, {0, "1f1b", 2, "none", false}},
                        {{1, 2, 2}, {0, "1f1b", 4, "full", true}},
                        {{2, 1, 2}, {1, "1f1b", 2, "selective", false}},
                        {{1, 4, 1}, {0, "1f1b", 4, "none", false}}};
  for (const Case& k : cases) {
    const std::string name = "report_" + k.mesh.name() + "_" + k.variant.name();
    SCOPED_TRACE(name);
    Config c = config(k.mesh, k.variant);
    c.train.steps = 2;
    const TrainSummary s = run_training(c, options(name));
    std::istringstream lines(s.layout_report);
    std::string line;
    std::getline(lines, line);
    EXPECT_NE(line.find("pp=" + std::to_string(k.mesh.pp) + " x dp=" + std::to_string(k.mesh.dp) +
                        " x tp=" + std::to_string(k.mesh.tp)), std::string::npos) << line;
    std::getline(lines, line);  // the header
    EXPECT_EQ(line.rfind("rank  pp  dp  tp", 0), 0u) << line;
    const int ranks = k.mesh.dp * k.mesh.pp * k.mesh.tp;
    int64_t parameters_dp0 = 0;
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(std::getline(lines, line));
      int rank = -1, pp = -1, dp = -1, tp = -1;
      long long params = 0;
      ASSERT_EQ(std::sscanf(line.c_str(), "%d %d %d %d %lld", &rank, &pp, &dp, &tp, &params), 5) << line;
      EXPECT_EQ(rank, r);
      EXPECT_EQ(tp, r % k.mesh.tp);
      EXPECT_EQ(dp, (r / k.mesh.tp) % k.mesh.dp);
      EXPECT_EQ(pp, r / (k.mesh.tp * k.mesh.dp));
      if (dp == 0) parameters_dp0 += params;
    }
    // One dp replica holds the whole model: the one-device count, plus the last stage's copy of
    // the tied wte and vocabulary padding.
    Gpt2Config m = model_config_of(c);
    EXPECT_GE(parameters_dp0, m.num_parameters());
    EXPECT_LE(parameters_dp0, m.num_parameters() + 2 * (m.vocab_size + m.max_seq_len) * m.d_model);
    const double ratio = static_cast<double>(s.expected_activation_bytes) /
                         static_cast<double>(s.activation_peak_bytes);
    EXPECT_GT(ratio, 0.6) << s.layout_report;
    EXPECT_LT(ratio, 1.4) << s.layout_report;
    fs::remove_all(root_ / name);
  }
}

}  // namespace
}  // namespace loom
