// End-to-end training on a synthetic corpus: loss falls, runs repeat bit for bit, a stopped and
// resumed run equals an uninterrupted one, and bad inputs give errors that name the culprit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <tuple>
#include <vector>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "device/allocator.h"
#include "device/cuda/cuda_backend.h"
#ifdef LOOM_CUDA_EMULATE
#include "comm/nccl/nccl_backend.h"  // nccl_host_waits
#include "device/cuda/emulator/sanitizers.h"  // LOOM_EMU_ASAN
#include "device/cuda/emulator/scheduler.h"
#endif
#include "harness/error_of.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm.h"
#include "kernels/op_profile.h"
#include "kernels/ops.h"
#include "models/gpt2.h"
#include "optim/adamw.h"
#include "train/benchmark.h"
#include "train/run_compare.h"
#include "train/train_data.h"
#include "train/trainer.h"

namespace loom {
namespace {

using testutil::error_of;
namespace fs = std::filesystem;

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_train_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    synthesize_addition((dir_ / "data").string(), 60000, 8000, 7);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Config config(int64_t steps) const {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 32
d_model = 32
n_layers = 2
n_heads = 2
[train]
batch_size = 8
micro_batch_size = 4
lr = 3e-3
warmup_steps = 3
eval_every = 4
eval_batches = 2
save_every = 0
seed = 11
[runtime]
threads_per_rank = 2
)", "test.toml");
    c.train.steps = steps;
    c.data.train = (dir_ / "data" / "train_*.bin").string();
    c.data.val = (dir_ / "data" / "val_*.bin").string();
    return c;
  }

  // The tensor-parallel GPU tests' Llama: 4 query heads of 64 (the flash kernels' size) sharing
  // 2 key/value heads — one of those a rank at tp 2 —, a SwiGLU 128 wide; on a GPU at bf16.
  Config gpu_llama(int64_t steps) const {
    Config c = config(steps);
    c.model.arch = "llama";
    c.model.d_model = 256;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.ffn_hidden = 128;
    c.runtime.device = "cuda";
    c.runtime.matmul_precision = "bf16";
    return c;
  }

  // c on two ranks as tp 2 with sequence parallelism.
  static Config tp2_sequence_parallel(Config c) {
    c.runtime.ranks = 2;
    c.parallel.tp = 2;
    c.parallel.dp = 1;
    c.parallel.sequence_parallel = true;
    return c;
  }

  TrainOptions options(const std::string& run) const {
    TrainOptions o;
    o.run_dir = (dir_ / run).string();
    o.progress = false;
    return o;
  }

  // Trains `run` to step `at` (a checkpoint), then resumes it to the end.
  void stop_and_resume(const Config& c, const std::string& run, int64_t at) const {
    TrainOptions stop = options(run);
    stop.stop_after = at;
    EXPECT_EQ(run_training(c, stop).last_step, at);
    TrainOptions resume = options(run);
    resume.resume = "auto";
    EXPECT_EQ(run_training(c, resume).start_step, at);
  }

  std::vector<nlohmann::json> metrics(const std::string& run) const {
    std::ifstream in(dir_ / run / "metrics.jsonl");
    std::vector<nlohmann::json> out;
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
    return out;
  }

  // Two thread ranks trace steps 2 and 3 of `c` (set so, and resolved) into run `run`; its
  // trace.json's events (none when it is missing: the callers' counts then fail).
  nlohmann::json traced_events(Config& c, const std::string& run) const {
    c.runtime.ranks = 2;
    c.runtime.threads_per_rank = 1;
    c.metrics.trace_from_step = 2;
    c.metrics.trace_steps = 2;
    resolve_layout(c);
    run_training(c, options(run));
    std::ifstream in(dir_ / run / "trace.json");
    EXPECT_TRUE(in) << "no trace.json";
    return in ? nlohmann::json::parse(in).at("traceEvents") : nlohmann::json::array();
  }

  // The error of resuming run `run`'s checkpoint of step `step` under `c`.
  std::string resume_error(const Config& c, const std::string& run, int step) const {
    TrainOptions r = options(run);
    r.resume = (dir_ / run / "checkpoints" / ("step_" + std::to_string(step))).string();
    return error_of([&] { run_training(c, r); });
  }

  // `c` on two data-parallel thread ranks as run `dp2`: its losses those of run `one` (`c` on one
  // rank, already run) to 1e-5, and stopped at step 3 and resumed (run `dp2_resumed`) bit for
  // bit run `dp2`'s.
  void expect_dp2_trains_one_ranks_run_and_resumes(const Config& c) const;

  // ZeroBubbleOn*GpusAtBf16IsOneFOneBBitForBit's check, below.
  void expect_zero_bubble_is_one_f_one_b_on_gpus(const std::string& arch, int tp);
  // Every step's loss, and validation loss where there is one, of run `got` within `tol`
  // (relative) of run `want`'s.
  void expect_losses_near(const std::string& want, const std::string& got, double tol) const;
  // c's one-device CPU run trained on one GPU at fp32 (to 1e-4) and at bf16 (to 2e-2), and
  // where there are two GPUs, at bf16 over two ranks laid out as `two_ranks` sets (to 2e-2).
  // Runs are named `name` + _cpu, _gpu, _gpu_bf16, _gpus_bf16.
  void expect_gpus_train_the_cpu_run(const Config& c, const std::string& name,
                                     const std::function<void(ParallelConfig&)>& two_ranks) const;

  fs::path dir_;
};

void TrainTest::expect_losses_near(const std::string& want, const std::string& got,
                                   double tol) const {
  const auto mw = metrics(want), mg = metrics(got);
  ASSERT_EQ(mg.size(), mw.size()) << got << " vs " << want;
  for (size_t i = 0; i < mw.size(); ++i)
    for (const char* key : {"loss", "val_loss"}) {
      ASSERT_EQ(mw[i].contains(key), mg[i].contains(key)) << key << ", step " << i + 1;
      if (!mw[i].contains(key)) continue;
      const double w = mw[i][key], g = mg[i][key];
      EXPECT_NEAR(g, w, tol * w) << got << " vs " << want << ": " << key << ", step " << i + 1;
    }
  // data.val_sets' losses, by name.
  for (size_t i = 0; i < mw.size(); ++i) {
    ASSERT_EQ(mw[i].contains("val_losses"), mg[i].contains("val_losses")) << "step " << i + 1;
    if (!mw[i].contains("val_losses")) continue;
    ASSERT_EQ(mg[i]["val_losses"].size(), mw[i]["val_losses"].size());
    for (const auto& [name, w] : mw[i]["val_losses"].items())
      EXPECT_NEAR(mg[i]["val_losses"].at(name).get<double>(), w.get<double>(),
                  tol * w.get<double>())
          << got << " vs " << want << ": val_losses." << name << ", step " << i + 1;
  }
}

// Run s's start-up estimate of its activations (train/layout_report.h) over their measured
// peak, expected within (low, high) and kept in the test's XML output as `property` (none: "").
double expect_activation_estimate(const TrainSummary& s, double low, double high,
                                  const std::string& property = "activation_estimate_ratio") {
  const double ratio = static_cast<double>(s.expected_activation_bytes) /
                       static_cast<double>(s.activation_peak_bytes);
  EXPECT_GT(ratio, low) << s.layout_report;
  EXPECT_LT(ratio, high) << s.layout_report;
  if (!property.empty()) ::testing::Test::RecordProperty(property, std::to_string(ratio));
  return ratio;
}

// A run with 16-bit activations' measured peak over its fp32 twin's, expected below `most` and
// kept in the test's XML output.
void expect_sixteen_bit_peak_below(const TrainSummary& s16, const TrainSummary& s32, double most) {
  const double kept = static_cast<double>(s16.activation_peak_bytes) /
                      static_cast<double>(s32.activation_peak_bytes);
  EXPECT_LT(kept, most) << "16-bit peak " << s16.activation_peak_bytes << " vs fp32 "
                        << s32.activation_peak_bytes;
  ::testing::Test::RecordProperty("bf16_over_fp32_activation_peak", std::to_string(kept));
}

// The fields that define the run (timing fields differ between runs by nature).
void expect_same_run(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* key : {"step", "loss", "lr", "grad_norm", "val_loss", "tokens"}) {
      ASSERT_EQ(a[i].contains(key), b[i].contains(key)) << key << " at line " << i;
      if (a[i].contains(key)) {
        EXPECT_EQ(a[i][key], b[i][key]) << key << " at line " << i;
      }
    }
  }
}

TEST_F(TrainTest, LossFallsAndMetricsAreComplete) {
  TrainSummary s = run_training(config(30), options("run"));
  EXPECT_EQ(s.last_step, 30);
  EXPECT_LT(s.last_loss, s.first_loss - 1.0) << "loss did not fall";
  auto m = metrics("run");
  ASSERT_EQ(m.size(), 30u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "data_ms",
                          "comm_ms", "compute_ms", "tflops", "mfu"})
    EXPECT_TRUE(m[0].contains(key)) << key;
  // Against the peak measured at start-up (one thread's FMA rate × threads per rank).
  EXPECT_GT(m[0]["mfu"].get<double>(), 0);
  EXPECT_TRUE(std::isfinite(m[0]["mfu"].get<double>()));
  EXPECT_TRUE(m[3].contains("val_loss"));   // step 4
  EXPECT_FALSE(m[4].contains("val_loss"));  // step 5
  EXPECT_TRUE(fs::exists(dir_ / "run" / "config.toml"));
  EXPECT_GT(s.peak_bytes, 0);
}

// metrics.trace_from_step: a timeline of the chosen steps, one row per rank, whose phases and
// waits lie inside their step; a run that ends inside the window writes what it has.
TEST_F(TrainTest, TraceHoldsTheChosenStepsOfEveryRank) {
  Config c = config(6);
  const nlohmann::json events = traced_events(c, "run");
  std::map<std::pair<int, std::string>, int> count;  // (rank, name up to a comma) -> spans
  std::map<int, std::vector<std::pair<double, double>>> steps;  // rank -> step spans
  for (const auto& e : events) {
    if (e["ph"] != "X") continue;
    const std::string name = e["name"];
    ++count[{e["pid"].get<int>(), name.substr(0, name.find(','))}];
    if (name.rfind("step ", 0) == 0)
      steps[e["pid"]].push_back(
          {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
  }
  const int64_t accum = c.grad_accum_steps();
  for (int rank : {0, 1}) {
    EXPECT_EQ((count[{rank, "step 2"}]), 1) << rank;
    EXPECT_EQ((count[{rank, "step 3"}]), 1) << rank;
    EXPECT_EQ((count[{rank, "step 1"}] + count[{rank, "step 4"}]), 0) << rank;
    EXPECT_EQ((count[{rank, "forward + backward"}]), 2 * accum) << rank;
    EXPECT_EQ((count[{rank, "optimizer"}]), 2) << rank;
    EXPECT_EQ((count[{rank, "data"}]), 2 * accum) << rank;
    EXPECT_GE((count[{rank, "wait: dp"}]), 2) << rank;  // at least the losses' all-reduces
  }
  // Phases lie inside a step of their own rank.
  for (const auto& e : events) {
    if (e["ph"] != "X" || e["name"].get<std::string>().rfind("step ", 0) == 0) continue;
    const double b = e["ts"].get<double>(), end = b + e["dur"].get<double>();
    bool inside = false;
    for (const auto& [sb, se] : steps[e["pid"]]) inside |= b >= sb - 1e-3 && end <= se + 1e-3;
    if (e["cat"] != "comm") {  // evaluation's waits come after its step
      EXPECT_TRUE(inside) << e.dump();
    }
  }
  // Stopped inside the window: the steps it ran.
  TrainOptions stop = options("stopped");
  stop.stop_after = 2;
  run_training(c, stop);
  std::ifstream stopped(dir_ / "stopped" / "trace.json");
  ASSERT_TRUE(stopped);
  EXPECT_NE(std::string((std::istreambuf_iterator<char>(stopped)), std::istreambuf_iterator<char>())
                .find("\"step 2\""),
            std::string::npos);
}

// On GPUs the timeline has a second row per rank (tid 1, "GPU stream"): the same phases between
// events the compute stream passed, and the stream's stalls on nccl ("wait: dp"), on the host's
// clock from an anchor; the stalls add up to the step's comm_ms.dp, and the stream runs a step no
// earlier than the host queued it.
TEST_F(TrainTest, TraceOfGpuRanksHasTheirStreamsRow) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = config(4);
  c.runtime.device = "cuda";
  c.parallel.zero = 2;
  c.train.eval_every = 0;
  const nlohmann::json events = traced_events(c, "run");
  struct Span {
    double begin, end;
  };
  // (rank, row, name up to a comma) -> spans
  std::map<std::tuple<int, int, std::string>, std::vector<Span>> spans;
  std::map<std::pair<int, int>, std::string> rows;  // (rank, tid) -> its name
  for (const auto& e : events) {
    if (e["ph"] == "M" && e["name"] == "thread_name")
      rows[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    const std::string name = e["name"];
    const double b = e["ts"].get<double>() / 1e3, end = b + e["dur"].get<double>() / 1e3;  // ms
    spans[{e["pid"].get<int>(), e["tid"].get<int>(), name.substr(0, name.find(','))}].push_back(
        {b, end});
  }
  const auto records = metrics("run");
  ASSERT_EQ(records.size(), 4u);
  const double comm_dp = records[1]["comm_ms"]["dp"].get<double>() +
                         records[2]["comm_ms"]["dp"].get<double>();
  const int64_t accum = c.grad_accum_steps();
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ((rows[{rank, 1}]), "GPU stream");
    for (const char* step : {"step 2", "step 3"}) {
      const auto& host = spans[{rank, 0, step}];
      const auto& gpu = spans[{rank, 1, step}];
      ASSERT_EQ(host.size(), 1u) << step;
      ASSERT_EQ(gpu.size(), 1u) << step;
      EXPECT_GE(gpu[0].begin, host[0].begin - 1e-3) << step;
      EXPECT_GE(gpu[0].end, gpu[0].begin) << step;
    }
    EXPECT_EQ((spans[{rank, 1, "forward + backward"}].size()), static_cast<size_t>(2 * accum));
    EXPECT_EQ((spans[{rank, 1, "optimizer"}].size()), 2u);
    EXPECT_EQ((spans[{rank, 1, "step 1"}].size() + spans[{rank, 1, "step 4"}].size()), 0u);
    const auto& stalls = spans[{rank, 1, "wait: dp"}];
    EXPECT_GE(stalls.size(), 2u);  // at least the gradients' reduce-scatters
    if (rank == 0) {  // the metrics are rank 0's
      double stalled = 0;
      for (const Span& s : stalls) stalled += s.end - s.begin;
      EXPECT_NEAR(stalled, comm_dp, 1e-3 + 1e-3 * comm_dp);
    }
    // The micro-batches one after the other on the stream.
    const auto& mbs = spans[{rank, 1, "forward + backward"}];
    for (size_t i = 1; i < mbs.size(); ++i) EXPECT_GE(mbs[i].begin, mbs[i - 1].end - 1e-3) << i;
  }
}

// Each step's time split into loader, communication per axis and compute, the model TFLOP/s and
// the MFU; with [metrics] on, the same records as TensorBoard scalars and Prometheus gauges.
TEST_F(TrainTest, MetricsSplitTheStepAndGoToTensorBoardAndPrometheus) {
  Config c = config(6);
  c.runtime.ranks = 2;  // dp 2: the gradients' all-reduce is communication to time
  c.runtime.threads_per_rank = 1;
  c.metrics.tensorboard = true;
  c.metrics.prometheus_textfile = true;
  c.metrics.peak_tflops = 0.5;  // per rank; measured at start-up when 0 (LossFallsAndMetrics...)
  resolve_layout(c);
  run_training(c, options("run"));
  const auto m = metrics("run");
  ASSERT_EQ(m.size(), 6u);
  double dp_ms = 0;
  for (const auto& r : m) {
    const double comm = r["comm_ms"]["dp"].get<double>() + r["comm_ms"]["pp"].get<double>() +
                        r["comm_ms"]["tp"].get<double>();
    const double parts = r["data_ms"].get<double>() + comm + r["compute_ms"].get<double>();
    EXPECT_NEAR(parts, r["step_ms"].get<double>(), 1e-6 * r["step_ms"].get<double>()) << r.dump();
    EXPECT_GT(r["data_ms"].get<double>(), 0) << r.dump();
    EXPECT_GT(r["compute_ms"].get<double>(), 0) << r.dump();
    EXPECT_EQ(r["comm_ms"]["tp"].get<double>(), 0) << r.dump();  // no tp axis to wait on
    dp_ms += r["comm_ms"]["dp"].get<double>();
    // tflops: the model's flops per token (6 per weight + attention) times tokens, over the step.
    const double flops = model_config_of(c).flops_per_token(c.model.seq_len) *
                         static_cast<double>(c.train.batch_size * c.model.seq_len);
    EXPECT_NEAR(r["tflops"].get<double>(), flops / (r["step_ms"].get<double>() * 1e-3) / 1e12, 1e-9)
        << r.dump();
    EXPECT_NEAR(r["mfu"].get<double>(), r["tflops"].get<double>() / (0.5 * 2), 1e-12) << r.dump();
  }
  EXPECT_GT(dp_ms, 0);  // the loss's and the gradients' all-reduces wait for the other rank
  // Prometheus: the last step's gauges.
  std::ifstream prom(dir_ / "run" / "metrics.prom");
  const std::string text((std::istreambuf_iterator<char>(prom)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\nloom_step 6\n"), std::string::npos) << text;
  EXPECT_NE(text.find("loom_comm_ms{axis=\"dp\"} "), std::string::npos) << text;
  // TensorBoard: one event file, a version event and one event per step (16 bytes of framing
  // around each).
  std::vector<fs::path> events;
  for (const auto& e : fs::directory_iterator(dir_ / "run" / "tensorboard"))
    events.push_back(e.path());
  ASSERT_EQ(events.size(), 1u);
  std::ifstream tb(events[0], std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(tb)), std::istreambuf_iterator<char>());
  int records = 0;
  for (size_t i = 0; i + 12 <= data.size(); ++records) {
    uint64_t length = 0;
    std::memcpy(&length, data.data() + i, 8);
    i += 12 + length + 4;
  }
  EXPECT_EQ(records, 7);
  EXPECT_NE(data.find("mfu"), std::string::npos);
}

void TrainTest::expect_dp2_trains_one_ranks_run_and_resumes(const Config& c) const {
  Config dp = c;
  dp.runtime.ranks = 2;
  dp.runtime.threads_per_rank = 1;
  dp.parallel.dp = 2;
  run_training(dp, options("dp2"));
  expect_losses_near("one", "dp2", 1e-5);
  stop_and_resume(dp, "dp2_resumed", 3);
  expect_same_run(metrics("dp2"), metrics("dp2_resumed"));
}

TEST_F(TrainTest, StopAndResumeIsBitwiseIdentical) {
  run_training(config(12), options("straight"));
  TrainOptions first = options("resumed");
  first.stop_after = 6;
  TrainSummary s1 = run_training(config(12), first);
  EXPECT_EQ(s1.last_step, 6);
  EXPECT_TRUE(fs::exists(dir_ / "resumed" / "checkpoints" / "step_6" / "model.safetensors"));
  TrainOptions second = options("resumed");
  second.resume = "auto";
  TrainSummary s2 = run_training(config(12), second);
  EXPECT_EQ(s2.start_step, 6);
  EXPECT_EQ(s2.last_step, 12);
  expect_same_run(metrics("straight"), metrics("resumed"));
}

// train.lr_schedule = "wsd": the logged rates are the schedule's (warm-up, stable, then a linear
// decay over the last quarter), and a run stopped in the decay resumes bit for bit.
TEST_F(TrainTest, WarmupStableDecayScheduleLogsItsRatesAndResumes) {
  Config c = config(12);
  c.train.lr_schedule = "wsd";
  c.train.lr_decay_fraction = 0.25;
  c.train.warmup_steps = 2;
  run_training(c, options("wsd_straight"));
  stop_and_resume(c, "wsd_resumed", 10);
  const auto straight = metrics("wsd_straight");
  expect_same_run(straight, metrics("wsd_resumed"));
  LrSchedule s;
  s.decay = LrDecay::kWsd;
  s.total = 12;
  s.warmup = 2;
  s.lr = static_cast<float>(c.train.lr);
  s.min_ratio = static_cast<float>(c.train.min_lr_ratio);
  s.decay_fraction = 0.25;
  ASSERT_EQ(straight.size(), 12u);
  for (size_t i = 0; i < straight.size(); ++i)
    EXPECT_FLOAT_EQ(straight[i]["lr"].get<float>(), s.at(static_cast<int64_t>(i))) << i;
  EXPECT_FLOAT_EQ(straight[8]["lr"].get<float>(), static_cast<float>(c.train.lr));  // stable
  EXPECT_LT(straight[11]["lr"].get<float>(), straight[9]["lr"].get<float>());       // decaying
}

// A layout of the fine-tuning tests: dp × tp × pp ranks at a ZeRO stage.
struct FineTuneLayout {
  const char* name;
  int dp, tp, pp, zero;
  void apply(Config& c) const {
    c.parallel.dp = dp;
    c.parallel.tp = tp;
    c.parallel.pp = pp;
    c.parallel.zero = zero;
    c.runtime.ranks = dp * tp * pp;
  }
};

// Fine-tuning: train.init_from starts a fresh run from a HuggingFace GPT-2 directory — here run A's
// checkpoint exported by `loom checkpoint export` — in every layout. With lr = 0 the first step
// leaves the weights as loaded, so the run's checkpoint holds A's weights bit for bit; its first
// loss is A's model's, not a fresh initialisation's. A directory of another shape is named.
TEST_F(TrainTest, InitFromAHuggingFaceDirectoryStartsEveryLayoutFromItsWeights) {
  Config a = config(4);
  a.train.save_every = 4;
  run_training(a, options("a"));
  const std::string a_step = (dir_ / "a" / "checkpoints" / "step_4").string();
  export_checkpoint(a_step, "hf", (dir_ / "hf").string());
  const auto one_step = [&] {
    Config c = config(1);
    c.train.warmup_steps = 0;
    return c;
  };
  run_training(one_step(), options("fresh"));
  for (const FineTuneLayout& l :
       {FineTuneLayout{"one", 1, 1, 1, 0}, FineTuneLayout{"tp2", 1, 2, 1, 0},
        FineTuneLayout{"pp2", 1, 1, 2, 0}, FineTuneLayout{"dp2z1", 2, 1, 1, 1}}) {
    Config b = one_step();
    b.train.init_from = (dir_ / "hf").string();
    b.train.lr = 0;
    b.train.save_every = 1;
    l.apply(b);
    run_training(b, options(l.name));
    const WeightsDeviation d =
        compare_weights(fs::path(a_step) / "model.safetensors",
                        dir_ / l.name / "checkpoints" / "step_1" / "model.safetensors");
    EXPECT_EQ(d.rel_l2, 0.0) << l.name << " (" << d.largest << ")";
    EXPECT_NE(metrics(l.name)[0]["loss"], metrics("fresh")[0]["loss"]) << l.name;
  }
  Config wrong = one_step();
  wrong.model.n_layers = 3;
  wrong.train.init_from = (dir_ / "hf").string();
  const std::string msg = error_of([&] { run_training(wrong, options("wrong")); });
  EXPECT_NE(msg.find("n_layer = 2 but model.n_layers = 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find((dir_ / "hf" / "config.json").string()), std::string::npos) << msg;
}

// Fine-tuning from a Loom checkpoint (train.init_from = a step_N, or a run directory: its newest):
// its weights only, read one parameter at a time — from a whole checkpoint or from the shards of
// a tp × dp run — with fresh moments, step 0 and the data from its start. The run is the one
// started from the checkpoint's HuggingFace export, loss for loss and weight for weight, in every
// layout. Another model's checkpoint is named: its architecture, or its first parameter of
// another shape.
TEST_F(TrainTest, InitFromALoomCheckpointIsInitFromItsExport) {
  Config a = config(4);
  a.train.save_every = 4;
  run_training(a, options("a_whole"));
  Config sharded = a;
  sharded.train.checkpoint_format = "sharded";
  FineTuneLayout{"dp2tp2z1", 2, 2, 1, 1}.apply(sharded);
  run_training(sharded, options("a_sharded"));
  const std::string whole_step = (dir_ / "a_whole" / "checkpoints" / "step_4").string();
  export_checkpoint(whole_step, "hf", (dir_ / "a_hf").string());
  for (const FineTuneLayout& l :
       {FineTuneLayout{"one", 1, 1, 1, 0}, FineTuneLayout{"tp2pp2", 1, 2, 2, 0},
        FineTuneLayout{"dp2z1", 2, 1, 1, 1}}) {
    const auto fine_tune = [&](const fs::path& from, const std::string& run) {
      Config b = config(3);
      b.train.warmup_steps = 1;
      b.train.init_from = from.string();
      b.train.save_every = 3;
      l.apply(b);
      run_training(b, options(run));
      return run;
    };
    SCOPED_TRACE(l.name);
    const std::string base = std::string("ft_") + l.name;
    const auto from_hf = metrics(fine_tune(dir_ / "a_hf", base + "_hf"));
    const auto from_step = metrics(fine_tune(whole_step, base + "_step"));
    const auto from_run = metrics(fine_tune(dir_ / "a_sharded", base + "_run"));  // its newest
    ASSERT_EQ(from_hf.size(), 3u);
    EXPECT_EQ(from_step[0]["step"], 1);
    for (size_t i = 0; i < from_hf.size(); ++i) {
      EXPECT_EQ(from_step[i]["loss"], from_hf[i]["loss"]) << "step " << i + 1;
      // The sharded run's weights are the whole run's within rounding (another layout).
      EXPECT_NEAR(from_run[i]["loss"].get<double>(), from_hf[i]["loss"].get<double>(),
                  1e-5 * from_hf[i]["loss"].get<double>())
          << "step " << i + 1;
    }
    const fs::path step_3 = fs::path("checkpoints") / "step_3" / "model.safetensors";
    EXPECT_EQ(
        compare_weights(dir_ / (base + "_hf") / step_3, dir_ / (base + "_step") / step_3).rel_l2,
        0.0);
  }
  Config wider = config(1);
  wider.train.warmup_steps = 0;
  wider.model.d_model = 48;
  wider.train.init_from = whole_step;
  std::string msg = error_of([&] { run_training(wider, options("wider")); });
  EXPECT_NE(msg.find("train.init_from: checkpoint " + whole_step + ": 'wte.weight' has shape"),
            std::string::npos)
      << msg;
  Config llama = config(1);
  llama.train.warmup_steps = 0;
  llama.model.arch = "llama";
  llama.train.init_from = whole_step;
  msg = error_of([&] { run_training(llama, options("llama")); });
  EXPECT_NE(msg.find("holds a gpt2 model, but model.arch = \"llama\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.init_from starts from a checkpoint of the config's model"),
            std::string::npos)
      << msg;
}

// bf16 GEMMs on CPU ranks (runtime.matmul_precision = "bf16") on two data-parallel ranks with
// ZeRO-1: the run stops and resumes bit for bit, and the process's GEMM precision is back at fp32
// after it (the run sets it for its scope only).
TEST_F(TrainTest, Bf16OnCpuRanksStopsAndResumesBitwise) {
  if (!cpu::has_avx512f()) GTEST_SKIP() << "bf16 GEMMs on CPU ranks need AVX-512";
  Config c = config(8);
  c.runtime.matmul_precision = "bf16";
  c.runtime.ranks = 2;
  c.parallel.dp = 2;
  c.parallel.zero = 1;
  run_training(c, options("bf16_straight"));
  EXPECT_EQ(cpu::matmul_precision(), cpu::CpuMatmulPrecision::kFp32);
  stop_and_resume(c, "bf16_resumed", 4);
  expect_same_run(metrics("bf16_straight"), metrics("bf16_resumed"));
  run_training(config(8), options("fp32"));
  const auto bf16 = metrics("bf16_straight"), fp32 = metrics("fp32");
  ASSERT_EQ(bf16.size(), fp32.size());
  double largest = 0;  // relative loss difference: rounded, yet close
  for (size_t i = 0; i < bf16.size(); ++i)
    largest = std::max(largest,
                       std::abs(bf16[i]["loss"].get<double>() / fp32[i]["loss"].get<double>() - 1));
  EXPECT_GT(largest, 1e-7);
  EXPECT_LT(largest, 1e-2);
}

// runtime.device = "cuda": on a machine with a GPU, the run (one rank: nccl as a group of one)
// matches the CPU's step for step (fp32 rounding, not bits) and stops and resumes there; without
// one, a clear error. Two data-parallel ranks, then two tensor-parallel ranks, on two GPUs match
// the same layouts on CPU ranks; with fewer GPUs than ranks the error says so.
TEST_F(TrainTest, CudaDeviceTrainsTheCpuRunOrSaysWhyNot) {
  Config c = config(8);
  c.runtime.device = "cuda";
  if (!cuda_available()) {
    try {
      run_training(c, options("gpu"));
      FAIL() << "training on cuda without a GPU did not fail";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("runtime.device = 'cuda'"), std::string::npos) << what;
      EXPECT_NE(what.find("no usable GPU"), std::string::npos) << what;
    }
    GTEST_SKIP() << "no GPU: checked the error only";
  }
  run_training(config(8), options("cpu"));
  stop_and_resume(c, "gpu", 4);
  const auto expect_same_losses = [&](const std::string& a, const std::string& b) {
    expect_losses_near(a, b, 1e-4);
  };
  expect_same_losses("cpu", "gpu");

  Config two = c;
  two.runtime.ranks = 2;
  if (cuda::device_count() < 2) {
    try {
      run_training(two, options("two_gpus"));
      FAIL() << "two GPU ranks ran on one GPU";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("only 1 GPU(s) are visible"), std::string::npos)
          << e.what();
    }
    return;
  }
  Config two_cpu = config(8);
  two_cpu.runtime.ranks = 2;
  run_training(two_cpu, options("two_cpus"));
  run_training(two, options("two_gpus"));
  expect_same_losses("two_cpus", "two_gpus");
  // Tensor parallelism (vocabulary-parallel head included) over the two GPUs.
  two_cpu.parallel.tp = two.parallel.tp = 2;
  two_cpu.parallel.dp = two.parallel.dp = 1;
  run_training(two_cpu, options("tp_cpus"));
  run_training(two, options("tp_gpus"));
  expect_same_losses("tp_cpus", "tp_gpus");
  // Pipeline parallelism: the pp axis's messages GPU to GPU over nccl (comm/directed_p2p.h).
  two_cpu.parallel.tp = two.parallel.tp = 1;
  two_cpu.parallel.pp = two.parallel.pp = 2;
  run_training(two_cpu, options("pp_cpus"));
  run_training(two, options("pp_gpus"));
  expect_same_losses("pp_cpus", "pp_gpus");
}

// runtime.backend = "local" on cuda: thread ranks share the GPUs there are (here all on GPU 0),
// every tensor staged through host memory (comm/staged.h). One GPU so checks every strategy's
// GPU path against the same layout on CPU ranks: ZeRO-3 data parallelism, tensor parallelism
// with sequence parallelism, 1F1B pipeline parallelism, and all three at once.
// Under nccl the pipeline's messages go GPU to GPU, one nccl communicator per direction
// (comm/directed_p2p.h), in every schedule: each trains as on CPU ranks. On the CUDA emulator,
// whose NCCL blocks a send until its receive runs, in issue order, as NCCL documents, a schedule
// that could deadlock on GPUs times out here instead. The GPU's stream, not the host, waits for
// the messages there: the bubble reported is its stalls on the pp axis over the step.
TEST_F(TrainTest, PipelineMessagesGoGpuToGpuOverNcclInEverySchedule) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs: " << cuda::unavailable_reason();
  struct Layout {
    int pp;
    const char* schedule;
    int virtual_stages;
  };
  for (const Layout& l : {Layout{2, "gpipe", 1}, Layout{2, "1f1b", 1}, Layout{2, "interleaved", 2},
                          Layout{2, "zb-h1", 1}, Layout{2, "zb-interleaved", 2},
                          Layout{2, "zb-v", 2}, Layout{4, "1f1b", 1}, Layout{4, "zb-v", 2}}) {
    if (cuda::device_count() < l.pp) continue;
    Config c = config(3);
    c.model.n_layers = l.pp * l.virtual_stages > 4 ? 8 : 4;
    c.train.micro_batch_size = 2;  // 4 micro-batches per step
    c.train.eval_every = 0;
    c.runtime.ranks = l.pp;
    c.parallel.pp = l.pp;
    c.parallel.dp = c.parallel.tp = 1;
    c.parallel.schedule = l.schedule;
    c.parallel.virtual_stages = l.virtual_stages;
    Config gpu = c;
    gpu.runtime.device = "cuda";
    const std::string name = std::string(l.schedule) + "_pp" + std::to_string(l.pp);
    run_training(c, options(name + "_cpus"));
    run_training(gpu, options(name + "_gpus"));
    const auto on_cpus = metrics(name + "_cpus"), on_gpus = metrics(name + "_gpus");
    ASSERT_EQ(on_cpus.size(), on_gpus.size()) << name;
    double stalled = 0;
    for (size_t i = 0; i < on_cpus.size(); ++i) {
      const double want = on_cpus[i]["loss"], got = on_gpus[i]["loss"];
      EXPECT_NEAR(got, want, 1e-4 * want) << name << ", step " << i + 1;
      const double bubble = on_gpus[i]["bubble"], pp_ms = on_gpus[i]["comm_ms"]["pp"],
                   step_ms = on_gpus[i]["step_ms"];
      EXPECT_NEAR(bubble, pp_ms / step_ms, 1e-9) << name << ", step " << i + 1;
      EXPECT_EQ(on_gpus[i]["comm_wait_ms"], pp_ms) << name << ", step " << i + 1;
      EXPECT_LE(bubble, 1.0) << name;
      EXPECT_EQ(on_gpus[i]["bubble_by_pp_rank"].size(), static_cast<size_t>(l.pp)) << name;
      stalled += pp_ms;
    }
    EXPECT_GT(stalled, 0) << name << ": the first stage never waited for the last";
  }
}

// zb-h1 on two GPUs (nccl) at bf16 — the flash kernels (heads of 64), the GELU in the GEMMs,
// 16-bit logits: B runs the 16-bit backward ops' input halves and W their weight halves
// (kernels/ops.h), so the run is 1F1B's bit for bit; and the first stage did keep weight
// gradients for its W (pp_deferred_mb: none were deferred on this path before). GPT-2, and Llama
// with recomputation (SwiGLU, RMSNorm, grouped-query heads). `tp`: each stage split over that
// many GPUs with sequence parallelism (a head and a key/value head a rank).
void TrainTest::expect_zero_bubble_is_one_f_one_b_on_gpus(const std::string& arch, int tp) {
  SCOPED_TRACE(arch + " tp " + std::to_string(tp));
  Config c = config(3);
  c.model.arch = arch;
  c.model.d_model = 128;
  c.model.n_heads = 2;
  c.model.n_layers = 4;
  if (arch == "llama") {
    c.model.n_kv_heads = tp > 1 ? 2 : 1;
    c.model.ffn_hidden = 128;
    c.parallel.recompute = "selective";
  }
  c.train.micro_batch_size = 2;  // 4 micro-batches per step
  c.train.eval_every = 0;
  c.runtime.ranks = 2 * tp;
  c.runtime.device = "cuda";
  c.runtime.matmul_precision = "bf16";
  c.parallel.pp = 2;
  c.parallel.dp = 1;
  c.parallel.tp = tp;
  c.parallel.sequence_parallel = tp > 1;
  std::vector<nlohmann::json> runs[2];
  int k = 0;
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    c.parallel.schedule = schedule;
    const std::string name = arch + "_tp" + std::to_string(tp) + "_gpus_bf16_" + schedule;
    run_training(c, options(name));
    runs[k++] = metrics(name);
  }
  ASSERT_EQ(runs[1].size(), runs[0].size());
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_EQ(runs[1][i]["loss"].get<double>(), runs[0][i]["loss"].get<double>())
        << "step " << i + 1;
    EXPECT_EQ(runs[1][i]["grad_norm"].get<double>(), runs[0][i]["grad_norm"].get<double>())
        << "step " << i + 1;
    EXPECT_FALSE(runs[0][i].contains("pp_deferred_mb"));
    EXPECT_GT(runs[1][i].value("pp_deferred_mb", 0.0), 0.0) << "step " << i + 1;
  }
}

TEST_F(TrainTest, ZeroBubbleOnGpusAtBf16IsOneFOneBBitForBit) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs: " << cuda::unavailable_reason();
  for (const char* arch : {"gpt2", "llama"}) expect_zero_bubble_is_one_f_one_b_on_gpus(arch, 1);
}

// The same with tensor-parallel stages (four GPUs): the tp block's 16-bit MLP and attention
// backward (ColumnParallelLinear / RowParallelLinear's 16-bit ops) defer their weight halves too.
TEST_F(TrainTest, ZeroBubbleOnTensorParallelGpusAtBf16IsOneFOneBBitForBit) {
  if (cuda::device_count() < 4) GTEST_SKIP() << "needs 4 GPUs: " << cuda::unavailable_reason();
  for (const char* arch : {"gpt2", "llama"}) expect_zero_bubble_is_one_f_one_b_on_gpus(arch, 2);
}

// Expert parallelism on two GPUs over nccl (parallel/expert_parallel.h): a Llama mixture's
// experts split over the two, the tokens gathered GPU to GPU and the outputs reduce-scattered
// back; with the validation every rank runs. The run is the CPU ranks' (losses, gradient norms,
// the validation loss); at bf16 within 1%; and with the all-to-all dispatcher. Then tensor
// parallelism (the experts' widths split over the two) and context parallelism.
TEST_F(TrainTest, MixtureSplitOverTwoGpusByExpertsWidthsOrPositionsTrainsAsOnCpuRanks) {
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs: " << cuda::unavailable_reason();
  Config c = config(4);
  c.model.arch = "llama";
  c.model.n_kv_heads = 1;
  c.model.ffn_hidden = 32;
  c.model.moe_experts = 4;
  c.model.moe_top_k = 2;
  c.model.moe_aux_loss_coef = 0.1f;
  c.train.micro_batch_size = 2;
  c.runtime.ranks = 2;
  c.runtime.threads_per_rank = 1;
  c.parallel.dp = 2;
  c.parallel.ep = 2;
  c.parallel.zero = 1;
  run_training(c, options("ep2_cpus"));
  c.runtime.device = "cuda";
  run_training(c, options("ep2_gpus"));
  const auto on_cpus = metrics("ep2_cpus"), on_gpus = metrics("ep2_gpus");
  ASSERT_EQ(on_cpus.size(), 4u);
  ASSERT_EQ(on_gpus.size(), 4u);
  for (size_t i = 0; i < on_cpus.size(); ++i)
    for (const char* key : {"loss", "grad_norm"}) {
      const double want = on_cpus[i][key], got = on_gpus[i][key];
      EXPECT_NEAR(got, want, 1e-4 * want) << key << ", step " << i + 1;
    }
  ASSERT_TRUE(on_gpus[3].contains("val_loss"));
  const double val = on_cpus[3]["val_loss"];
  EXPECT_NEAR(on_gpus[3]["val_loss"].get<double>(), val, 1e-4 * val);
  // Another GPU run's losses against CPU ranks' (`reference`, by default the run above), within
  // `tolerance` (relative).
  const auto expect_losses = [&](const Config& run, const std::string& name, double tolerance,
                                 const std::vector<nlohmann::json>* reference = nullptr) {
    const auto& want = reference != nullptr ? *reference : on_cpus;
    run_training(run, options(name));
    const auto got = metrics(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i]["loss"].get<double>(), want[i]["loss"].get<double>(),
                  tolerance * want[i]["loss"].get<double>())
          << name << ", step " << i + 1;
  };
  // At bf16 the experts' gathered inputs cross in the 16 bits the norm wrote: within 1%.
  Config bf16 = c;
  bf16.runtime.matmul_precision = "bf16";
  expect_losses(bf16, "ep2_gpus_bf16", 1e-2);
  // The all-to-all dispatcher at fp32: the padded rows, their experts' indices (i32) and the
  // outputs through NCCL's all-to-all.
  Config dispatched = c;
  dispatched.parallel.ep_dispatch = "all_to_all";
  expect_losses(dispatched, "ep2_gpus_all_to_all", 1e-4);
  // Balancing biases (model.moe_bias_update_rate): the choice on the GPU by p + bias, the biases
  // moved between steps from the counts as on the CPU ranks.
  // A run on CPU ranks (NAME_cpus) and on the GPUs (NAME_gpus), the same within 1e-4.
  const auto expect_gpus_as_cpus = [&](Config run, const std::string& name) {
    run.runtime.device = "cpu";
    run_training(run, options(name + "_cpus"));
    const auto on_cpu_ranks = metrics(name + "_cpus");
    run.runtime.device = "cuda";
    expect_losses(run, name + "_gpus", 1e-4, &on_cpu_ranks);
  };
  Config biased = c;
  biased.model.moe_bias_update_rate = 0.01;
  expect_gpus_as_cpus(biased, "bias");
  // Expert capacity (model.moe_capacity_factor): the routing weights come to the host, which
  // drops the pairs beyond it; the all-to-all sends only the pairs kept. With DeepSeek-V3's
  // router — sigmoid scores, groups (a token's pair from one GPU's experts), weights × 2.5 —,
  // routed and differentiated on the GPU.
  Config capped = dispatched;
  capped.model.moe_capacity_factor = 0.75;
  capped.model.moe_router_score_function = "sigmoid";
  capped.model.moe_router_num_groups = 2;
  capped.model.moe_router_group_topk = 1;
  capped.model.moe_router_topk_scaling_factor = 2.5;
  expect_gpus_as_cpus(capped, "capacity");
  // Tensor parallelism (sequence parallel; two key/value heads, one a GPU): each GPU a half of
  // every expert's width, the partial outputs reduce-scattered and the routing weights'
  // gradients all-reduced over NCCL, against the same layout on CPU ranks; at bf16 the norm's
  // rows gathered in its 16 bits.
  Config tp = c;
  tp.model.n_kv_heads = 2;
  tp.parallel.dp = 1;
  tp.parallel.ep = 1;
  tp.parallel.tp = 2;
  tp.parallel.sequence_parallel = true;
  tp.train.micro_batch_size = 4;
  tp.runtime.device = "cpu";
  run_training(tp, options("tp2_cpus"));
  const auto tp_on_cpus = metrics("tp2_cpus");
  ASSERT_EQ(tp_on_cpus.size(), 4u);
  tp.runtime.device = "cuda";
  // And context parallelism: each GPU half of every sequence, the balance loss's counts summed
  // over the two (fp32: the same run as tp's on CPU ranks).
  Config cp = tp;
  cp.parallel.tp = 1;
  cp.parallel.sequence_parallel = false;
  cp.parallel.cp = 2;
  for (const auto& [run, precision] :
       {std::pair<Config, const char*>{tp, "fp32"}, {tp, "bf16"}, {cp, "fp32"}}) {
    Config gpu_run = run;
    gpu_run.runtime.matmul_precision = precision;
    expect_losses(gpu_run, std::string(run.parallel.cp > 1 ? "cp2_gpus_" : "tp2_gpus_") + precision,
                  std::string(precision) == "bf16" ? 1e-2 : 1e-4, &tp_on_cpus);
  }
}

TEST_F(TrainTest, EveryStrategyRunsOnOneGpuThroughHostStaging) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  struct Layout {
    const char* name;
    int dp, tp, pp, zero;
    bool sp;
    int cp = 1;
    const char* cp_comm = "all_gather";
  };
  for (const Layout& l : {Layout{"dp2_zero3", 2, 1, 1, 3, false}, Layout{"tp2_sp", 1, 2, 1, 0, true},
                          Layout{"pp2", 1, 1, 2, 0, false}, Layout{"dp2_pp2_tp2", 2, 2, 2, 1, false},
                          Layout{"cp2", 1, 1, 1, 0, false, 2}, Layout{"dp2_cp2_zero1", 2, 1, 1, 1, false, 2},
                          Layout{"cp2_ring", 1, 1, 1, 0, false, 2, "ring"}}) {
    SCOPED_TRACE(l.name);
    Config c = config(6);
    c.runtime.ranks = l.dp * l.tp * l.pp * l.cp;
    c.runtime.threads_per_rank = 1;
    c.parallel.dp = l.dp;
    c.parallel.tp = l.tp;
    c.parallel.pp = l.pp;
    c.parallel.cp = l.cp;
    c.parallel.cp_comm = l.cp_comm;
    c.parallel.zero = l.zero;
    c.parallel.sequence_parallel = l.sp;
    c.train.micro_batch_size = 8 / (2 * l.dp);  // two micro-batches per step: pipelines fill
    const std::string cpu = std::string(l.name) + "_cpu", gpu = std::string(l.name) + "_gpu";
    run_training(c, options(cpu));
    c.runtime.device = "cuda";
    c.runtime.backend = "local";
    run_training(c, options(gpu));
    const auto want = metrics(cpu), got = metrics(gpu);
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const double a = want[i]["loss"], b = got[i]["loss"];
      EXPECT_NEAR(b, a, 1e-4 * a) << "step " << i + 1;
    }
  }
}

// Loss scaling by a power of two is exact: with no overflow, every layout's run under static or
// dynamic scaling is bit for bit its unscaled run (losses, gradient norms, validation), while the
// dynamic scale doubles every train.loss_scale_window steps. A stopped and resumed run keeps the
// scaler's state (scale and the steps counted towards the next doubling).
TEST_F(TrainTest, LossScalingKeepsEveryLayoutsRunBitForBit) {
  struct Layout {
    const char* name;
    int ranks, dp, tp, pp, zero;
  };
  for (const Layout& l : {Layout{"one", 1, 1, 1, 1, 0}, Layout{"dp2_zero2", 2, 2, 1, 1, 2},
                          Layout{"pp2", 2, 1, 1, 2, 0}, Layout{"tp2", 2, 1, 2, 1, 0}}) {
    Config c = config(8);
    c.runtime.ranks = l.ranks;
    c.runtime.threads_per_rank = 1;
    c.parallel.dp = l.dp;
    c.parallel.tp = l.tp;
    c.parallel.pp = l.pp;
    c.parallel.zero = l.zero;
    c.train.loss_scale = "none";
    const std::string plain = std::string(l.name) + "_none";
    run_training(c, options(plain));
    for (const char* mode : {"static", "dynamic"}) {
      c.train.loss_scale = mode;
      c.train.loss_scale_init = 1 << 20;
      c.train.loss_scale_window = 3;
      const std::string scaled = std::string(l.name) + "_" + mode;
      SCOPED_TRACE(scaled);
      const TrainSummary s = run_training(c, options(scaled));
      EXPECT_EQ(s.skipped_steps, 0) << scaled;
      expect_same_run(metrics(plain), metrics(scaled));
      const auto m = metrics(scaled);
      ASSERT_EQ(m.size(), 8u) << scaled;
      for (size_t i = 0; i < m.size(); ++i) {
        const double want = std::string(mode) == "static" ? 1 << 20 : (1 << 20) << (i / 3);
        EXPECT_EQ(m[i]["loss_scale"].get<double>(), want) << scaled << " step " << i + 1;
        EXPECT_FALSE(m[i].contains("skipped")) << scaled << " step " << i + 1;
      }
      EXPECT_FALSE(metrics(plain)[0].contains("loss_scale"));
    }
  }
  // Stop after step 4 (scale 2^21, one step towards the next doubling) and resume.
  Config c = config(8);
  c.runtime.threads_per_rank = 1;  // as "one_dynamic" ran
  c.train.loss_scale = "dynamic";
  c.train.loss_scale_init = 1 << 20;
  c.train.loss_scale_window = 3;
  stop_and_resume(c, "resumed", 4);
  const auto straight = metrics("one_dynamic"), resumed = metrics("resumed");
  expect_same_run(straight, resumed);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i)
    EXPECT_EQ(resumed[i]["loss_scale"], straight[i]["loss_scale"]) << "step " << i + 1;
}

// fp16 GEMM operands on a GPU with dynamic loss scaling from 2^32: the first steps' scaled
// gradients overflow fp16 (65504) and are skipped while the scale halves; then the run trains.
TEST_F(TrainTest, Fp16GemmsWithDynamicLossScalingTrainOnTheGpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(30);
  c.runtime.device = "cuda";
  c.runtime.matmul_precision = "fp16";  // train.loss_scale = "auto": dynamic
  c.train.loss_scale_init = 4294967296.0;
  const TrainSummary s = run_training(c, options("fp16"));
  const auto m = metrics("fp16");
  ASSERT_EQ(m.size(), 30u);
  EXPECT_TRUE(m[0].value("skipped", false)) << "2^32 × the gradients must overflow fp16";
  EXPECT_EQ(m[1]["loss_scale"].get<double>(), 2147483648.0) << "halved after the overflow";
  EXPECT_GE(s.skipped_steps, 1);
  EXPECT_LE(s.skipped_steps, 25);
  EXPECT_FALSE(m[29].value("skipped", false));
  // ~10-15 of the 30 steps are skipped (2^32 down to where the largest scaled gradient fits
  // fp16), so the loss falls less than the 30-step CPU run's (> 1.0,
  // LossFallsAndMetricsAreComplete).
  EXPECT_LT(s.last_loss, s.first_loss - 0.3) << "fp16 with loss scaling did not train";
  // The layout report's activation estimate counts the activations kept in 16 bits as such
  // (1.10 of the measured peak here; 1.37 when it counted them as fp32).
  expect_activation_estimate(s, 0.8, 1.2, "");
}

// Tensor parallelism on GPUs at bf16 (two GPUs, sequence parallelism): the norms write their
// outputs in bf16 as the column-parallel layers keep them (this rank's rows, gathered again in
// backward); each rank's heads'
// attention runs as one GPU's does — qkv written in bf16 for the flash kernels, the output as
// proj's rounded input, dO and dqkv likewise —; and so does its slice of the MLP — fc's output
// and the GELU's in bf16 from the GEMM's epilogue, the gradient at the GELU's input from proj's
// (a Llama's SwiGLU in 16 bits). That lowers the measured activation peak against the fp32 run
// (0.85 of it with the norms alone, 0.77 with the attention too, 0.70 with the MLP, 0.64 with
// the rows kept un-gathered), and the layout report counts it (its estimate 1.03 of the peak
// then, 1.20 now: its backward working set — one block's activations and the gathered rows — is
// over what GPT-2's backward holds here; a Llama's cp × tp below is within 1 %). The run stays
// near one GPU's bf16 run.
// Selective recomputation rebuilds the norm outputs in fp32 (rounded by the GEMMs: bit for bit)
// and the GELU's output from its bf16 input (to an ulp of the epilogue's, which took the GELU
// before rounding, as on one GPU): near the stored run; a Llama (grouped-query heads, the
// rotation turned in 16 bits, the SwiGLU rebuilt from the same bf16 input) bit for bit.
TEST_F(TrainTest, TensorParallelGpusAtBf16KeepTheNormOutputsInSixteenBits) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = config(3);
  c.runtime.device = "cuda";
  c.runtime.matmul_precision = "bf16";
  c.model.d_model = 128;  // heads of 64: the flash kernels' size, on one GPU and one head a rank
  run_training(c, options("one_gpu"));
  Config tp = tp2_sequence_parallel(c);
  const TrainSummary bf16 = run_training(tp, options("tp_bf16"));
  // The backward's collectives waited for at once instead of after the weight gradients
  // (parallel/tp_backward_overlap.h): the same bits.
  tp.parallel.tp_backward_overlap = "off";  // ("auto": on, on GPUs)
  run_training(tp, options("tp_bf16_no_overlap"));
  expect_same_run(metrics("tp_bf16"), metrics("tp_bf16_no_overlap"));
  tp.parallel.tp_backward_overlap = "auto";
  tp.parallel.recompute = "selective";
  run_training(tp, options("tp_bf16_selective"));
  tp.parallel.recompute = "none";
  tp.runtime.matmul_precision = "fp32";
  const TrainSummary fp32 = run_training(tp, options("tp_fp32"));
  expect_losses_near("one_gpu", "tp_bf16", 2e-2);
  expect_losses_near("tp_bf16", "tp_bf16_selective", 1e-3);
  const auto two = metrics("tp_bf16"), selective = metrics("tp_bf16_selective");
  for (size_t i = 0; i < two.size(); ++i) {
    const double want = two[i]["grad_norm"], got = selective[i]["grad_norm"];
    EXPECT_NEAR(got, want, 1e-3 * want) << "selective, grad_norm at step " << i + 1;
  }
  expect_sixteen_bit_peak_below(bf16, fp32, 0.74);
  EXPECT_LT(bf16.expected_activation_bytes, fp32.expected_activation_bytes);
  expect_activation_estimate(bf16, 0.7, 1.4);

  const Config llama = gpu_llama(3);
  run_training(llama, options("llama_one_gpu"));
  Config llama_tp = tp2_sequence_parallel(llama);
  run_training(llama_tp, options("llama_tp_bf16"));
  llama_tp.parallel.recompute = "selective";
  run_training(llama_tp, options("llama_tp_bf16_selective"));
  expect_losses_near("llama_one_gpu", "llama_tp_bf16", 2e-2);
  expect_same_run(metrics("llama_tp_bf16"), metrics("llama_tp_bf16_selective"));
  if (cuda::device_count() < 4) return;
  // tp 2 × cp 2 on four GPUs: each rank's rows of the sequence, its query heads and their
  // key/value head on the flash kernels' rows, qkv written in bf16 and turned in 16 bits, the
  // output kept as proj's rounded input (the layout report's estimate counts them so).
  llama_tp.runtime.ranks = 4;
  llama_tp.parallel.cp = 2;
  llama_tp.parallel.recompute = "none";
  const TrainSummary cp_tp = run_training(llama_tp, options("llama_cp_tp_bf16"));
  expect_losses_near("llama_one_gpu", "llama_cp_tp_bf16", 2e-2);
  expect_activation_estimate(cp_tp, 0.9, 1.2, "llama_cp_tp_activation_estimate_ratio");
}

// Qwen 3's per-head query/key norms (model.qk_norm) on heads of 128 from 256 channels
// (model.head_dim) at bf16: qkv in fp32, normalised and turned there, the flash kernels rounding
// it as they load it, their bf16 dqkv widened for the norms' backward — one GPU within bf16's
// tolerance of its fp32 run, and tp 2 (each rank's heads normalised, the gains' gradients summed
// over tp) of the one GPU's. OLMo 2's norms over all the heads (and post-norms) under tp 2 + sp,
// their rows' sums all-reduced over tp (nn/split_rms_norm.h), at fp32 to 1e-5 of one GPU (with
// the forward's sums left un-reduced the losses move by 1e-2 of themselves, with the backward's
// by 4e-4: both under bf16's tolerance, over this one's; measured 1e-7); Gemma 3's parts so too.
TEST_F(TrainTest, Qwen3NormsOnGpusAtBf16TrainAsTheFp32Run) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config qwen3 = gpu_llama(3);
  qwen3.model.head_dim = 128;
  qwen3.model.qk_norm = true;
  qwen3.runtime.matmul_precision = "fp32";
  run_training(qwen3, options("qwen3_one_gpu_fp32"));
  qwen3.runtime.matmul_precision = "bf16";
  run_training(qwen3, options("qwen3_one_gpu"));
  run_training(tp2_sequence_parallel(qwen3), options("qwen3_tp_bf16"));
  expect_losses_near("qwen3_one_gpu_fp32", "qwen3_one_gpu", 2e-2);
  expect_losses_near("qwen3_one_gpu", "qwen3_tp_bf16", 2e-2);
  EXPECT_FALSE(metrics("qwen3_one_gpu_fp32") == metrics("qwen3_one_gpu"));  // bf16 did round
  Config olmo2 = qwen3;
  olmo2.model.norm_placement = "post";
  olmo2.model.qk_norm_scope = "full";
  olmo2.runtime.matmul_precision = "fp32";
  run_training(olmo2, options("olmo2_one_gpu"));
  run_training(tp2_sequence_parallel(olmo2), options("olmo2_tp"));
  expect_losses_near("olmo2_one_gpu", "olmo2_tp", 1e-5);
  EXPECT_FALSE(metrics("olmo2_one_gpu") == metrics("qwen3_one_gpu_fp32"));  // another model
  // Gemma 3's parts under tp 2 + sp at fp32 (heads of 64, two steps: short under the
  // sanitizers): sandwich norms on each rank's rows, GeGLU on its slice, the embedding scaled
  // after the vocabulary-parallel sum, a window of 9 in every other block turned by its own base,
  // the others' frequencies divided by 4 and the scores scaled by 1/√96 (each rank's queries).
  Config gemma = gpu_llama(2);
  gemma.train.warmup_steps = 1;
  gemma.model.qk_norm = true;
  gemma.runtime.matmul_precision = "fp32";
  gemma.model.norm_placement = "sandwich";
  gemma.model.ffn_activation = "gelu_tanh";
  gemma.model.embedding_multiplier = 16;
  gemma.model.sliding_window = 9;
  gemma.model.full_attention_every = 2;
  gemma.model.rope_local_theta = 100;
  gemma.model.rope_scaling = "linear";
  gemma.model.rope_scaling_factor = 4;
  gemma.model.query_pre_attn_scalar = 96;
  run_training(gemma, options("gemma_one_gpu"));
  run_training(tp2_sequence_parallel(gemma), options("gemma_tp"));
  expect_losses_near("gemma_one_gpu", "gemma_tp", 1e-5);
  EXPECT_FALSE(metrics("gemma_one_gpu") == metrics("qwen3_one_gpu_fp32"));
}

// OLMo 2's post-norm blocks on two GPUs at bf16 with sequence parallelism: the column-parallel
// qkv and fc read the fp32 residual stream, so each rank rounds its rows before the all-gather
// (ops::round_for_matmul) and keeps them so, gathering them again in backward — within bf16's
// tolerance of one GPU's run; selective recomputation, which drops the SwiGLU output alone,
// bit for bit the stored run.
TEST_F(TrainTest, PostNormsOnSequenceParallelGpusAtBf16TrainAsOneGpu) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = gpu_llama(3);  // heads of 64: the flash kernels read qkv in bf16
  c.model.norm_placement = "post";
  run_training(c, options("post_one_gpu"));
  Config tp = tp2_sequence_parallel(c);
  run_training(tp, options("post_tp_sp"));
  tp.parallel.recompute = "selective";
  run_training(tp, options("post_tp_sp_selective"));
  expect_losses_near("post_one_gpu", "post_tp_sp", 2e-2);
  expect_same_run(metrics("post_tp_sp"), metrics("post_tp_sp_selective"));
}

// The vocabulary-parallel head at bf16 keeps its shard of the logits, and their gradient over
// them, in 16 bits, as the unsharded head does: with a vocabulary large enough for the logits to
// be most of a step's activations, tp 2 at bf16 peaks at well under its fp32 run (0.55 of it
// here; with fp32 logits, which the backward's GEMMs then read through a rounded copy, the bf16
// run peaked at 1.26 times it), trains the one GPU's run to bf16's tolerance, and the layout
// report's estimate counts the logits so.
TEST_F(TrainTest, TensorParallelHeadAtBf16KeepsItsLogitsInSixteenBits) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = config(3);
  c.model.vocab_size = 8192;
  c.model.d_model = 128;  // heads of 64: the flash kernels' size
  c.model.n_heads = 2;
  c.model.n_layers = 1;
  c.train.eval_every = 0;
  c.runtime.device = "cuda";
  c.runtime.matmul_precision = "bf16";
  run_training(c, options("head_one_gpu"));
  Config tp = c;
  tp.runtime.ranks = 2;
  tp.parallel.tp = 2;
  tp.parallel.dp = 1;
  const TrainSummary bf16 = run_training(tp, options("head_tp_bf16"));
  tp.runtime.matmul_precision = "fp32";
  const TrainSummary fp32 = run_training(tp, options("head_tp_fp32"));
  expect_losses_near("head_one_gpu", "head_tp_bf16", 2e-2);
  expect_sixteen_bit_peak_below(bf16, fp32, 0.65);
  expect_activation_estimate(bf16, 0.7, 1.4);
}

// Data parallelism over two GPUs (nccl) with the gradients reduced in bf16 and ZeRO-3's
// parameters gathered in bf16: the GPUs' rounding and nccl's bf16 collectives train the CPU
// ranks' run of the same settings (1e-4: the sums' order differs), with half the bytes; and two
// pipeline stages sending in bf16 likewise.
TEST_F(TrainTest, Bf16GradientsAndGathersOverTwoGpusTrainTheCpuRanksRun) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = config(4);
  c.runtime.ranks = 2;
  c.runtime.threads_per_rank = 1;
  c.parallel.zero = 3;
  c.parallel.grad_reduce_dtype = "bf16";
  c.parallel.param_gather_dtype = "bf16";
  run_training(c, options("bf16_cpus"));
  Config gpus = c;
  gpus.runtime.device = "cuda";
  run_training(gpus, options("bf16_gpus"));
  gpus.parallel.grad_reduce_dtype = gpus.parallel.param_gather_dtype = "fp32";
  run_training(gpus, options("fp32_gpus"));
  const auto cpu = metrics("bf16_cpus"), gpu = metrics("bf16_gpus"), gpu32 = metrics("fp32_gpus");
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double want = cpu[i]["loss"], got = gpu[i]["loss"];
    EXPECT_NEAR(got, want, 1e-4 * want) << "step " << i + 1;
    EXPECT_NEAR(gpu[i]["comm_bytes"]["dp"].get<double>() / gpu32[i]["comm_bytes"]["dp"].get<double>(),
                0.5, 0.01)
        << "step " << i + 1;
    // The host does not wait for ZeRO-3's gathers and reductions, the GPU's stream does.
    EXPECT_EQ(gpu[i]["comm_wait_ms"], gpu[i]["comm_ms"]["dp"]) << "step " << i + 1;
  }
  // Pipeline stages sending in bf16 (parallel.pp_send_dtype) GPU to GPU over nccl.
  Config pp = config(4);
  pp.runtime.ranks = 2;
  pp.runtime.threads_per_rank = 1;
  pp.parallel.pp = 2;
  pp.parallel.dp = 1;
  pp.parallel.pp_send_dtype = "bf16";
  run_training(pp, options("pp16_cpus"));
  pp.runtime.device = "cuda";
  run_training(pp, options("pp16_gpus"));
  const auto pcpu = metrics("pp16_cpus"), pgpu = metrics("pp16_gpus");
  ASSERT_EQ(pgpu.size(), pcpu.size());
  for (size_t i = 0; i < pcpu.size(); ++i) {
    const double want = pcpu[i]["loss"], got = pgpu[i]["loss"];
    EXPECT_NEAR(got, want, 1e-4 * want) << "pp, step " << i + 1;
  }
}

// Hybrid sharding over four GPUs (nccl): ZeRO-3's state sharded over two pairs of GPUs, each
// pair's reduced gradient chunks all-reduced with the other pair's — the CPU ranks' run of the
// same layout (1e-4: the sums' order differs), the same bytes between the replicas, and the host
// waiting for none of it (the GPU's stream does).
TEST_F(TrainTest, HybridShardedGpusTrainTheCpuRanksRun) {
  if (!cuda_available() || cuda::device_count() < 4) GTEST_SKIP() << "needs four GPUs";
  // And ZeRO-1 in pairs: each unit reduce-scattered within a pair once a step, its chunk
  // all-reduced with the other pair's (the reduced chunk copied over the rank's part of the
  // whole gradient in the GPU's stream).
  for (const int zero : {3, 1}) {
    SCOPED_TRACE(::testing::Message() << "ZeRO-" << zero);
    const std::string name = "hsdp" + std::to_string(zero);
    Config c = config(4);
    c.runtime.ranks = 4;
    c.runtime.threads_per_rank = 1;
    c.train.micro_batch_size = 2;
    c.parallel.zero = zero;
    c.parallel.dp_shard = 2;
    run_training(c, options(name + "_cpus"));
    Config gpus = c;
    gpus.runtime.device = "cuda";
    run_training(gpus, options(name + "_gpus"));
    const auto cpu = metrics(name + "_cpus"), gpu = metrics(name + "_gpus");
    ASSERT_EQ(gpu.size(), cpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) {
      const double want = cpu[i]["loss"], got = gpu[i]["loss"];
      EXPECT_NEAR(got, want, 1e-4 * want) << "step " << i + 1;
      EXPECT_GT(gpu[i]["comm_bytes"]["dp_replicate"].get<int64_t>(), 0) << "step " << i + 1;
      EXPECT_EQ(gpu[i]["comm_bytes"]["dp_replicate"], cpu[i]["comm_bytes"]["dp_replicate"])
          << "step " << i + 1;
      EXPECT_EQ(gpu[i]["comm_wait_ms"], gpu[i]["comm_ms"]["dp"]) << "step " << i + 1;
    }
  }
}

// `loom bench train --device cuda --ranks 2`: thread ranks on GPUs 0 and 1, gradients (ZeRO-2's
// reduce-scatters and gathers) over nccl; the tokens of both ranks counted; more ranks than GPUs
// refused, naming the count.
TEST_F(TrainTest, BenchTrainRunsDataParallelGpus) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  BenchOptions o;
  o.device = "cuda";
  o.ranks = 2;
  o.zero = 2;
  o.steps = 2;
  o.warmup = 1;
  const BenchResult r = benchmark_training(find_bench_shape("tiny"), o);
  EXPECT_EQ(r.ranks, 2);
  EXPECT_NEAR(r.tokens_per_s * r.step_ms / 1e3, 2.0 * r.batch * r.seq_len, 1e-6 * r.batch * r.seq_len);
  EXPECT_GE(r.comm_wait_ms, 0);
  EXPECT_GT(r.peak_alloc_mb, 0);
  o.ranks = cuda::device_count() + 1;
  EXPECT_NE(testutil::error_of([&] { (void)benchmark_training(find_bench_shape("tiny"), o); })
                .find("one GPU per rank, and only " + std::to_string(cuda::device_count()) +
                      " GPU(s) are visible"),
            std::string::npos);
}

// train.async_checkpoint on a GPU: the staged copies come from device memory; the files are the
// synchronous saves' byte for byte (their digests), sharded and whole.
TEST_F(TrainTest, AsyncCheckpointsFromAGpuAreTheSynchronousOnes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  for (const std::string format : {"whole", "sharded"}) {
    SCOPED_TRACE(format);
    Config c = config(4);
    c.runtime.device = "cuda";
    c.train.save_every = 2;
    c.train.checkpoint_format = format;
    run_training(c, options("gpu_sync_" + format));
    c.train.async_checkpoint = true;
    run_training(c, options("gpu_async_" + format));
    for (int step : {2, 4}) {
      const auto files = [&](const std::string& run) {
        std::ifstream in(dir_ / run / "checkpoints" / ("step_" + std::to_string(step)) /
                         "state.json");
        EXPECT_TRUE(in.good()) << run << " step " << step;
        return in.good() ? nlohmann::json::parse(in)["files"] : nlohmann::json();
      };
      const nlohmann::json a = files("gpu_async_" + format), b = files("gpu_sync_" + format);
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(a, b) << "step " << step;
    }
  }
}

// runtime.matmul_precision = "fp8" on a GPU: the Linears' operands quantized in blocks as on CPU
// ranks (here of 16), on the bf16 GEMM. The run trains the CPU ranks' fp8 run (to fp32 rounding:
// 1e-3), and is not the GPU's bf16 run.
TEST_F(TrainTest, Fp8OnTheGpuTrainsTheCpusFp8Run) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  if (!cpu::has_avx512f()) GTEST_SKIP() << "fp8 needs AVX-512 on the CPU side";
  Config c = config(6);
  c.runtime.matmul_precision = "fp8";
  c.runtime.fp8_block = 16;
  const TrainSummary on_cpu = run_training(c, options("fp8_cpu"));
  EXPECT_LT(on_cpu.last_loss, on_cpu.first_loss - 0.3) << "fp8 did not train";
  Config gpu = c;
  gpu.runtime.device = "cuda";
  run_training(gpu, options("fp8_gpu"));
  gpu.runtime.matmul_precision = "bf16";
  run_training(gpu, options("bf16_gpu"));
  const auto cpu8 = metrics("fp8_cpu"), gpu8 = metrics("fp8_gpu"), gpu16 = metrics("bf16_gpu");
  ASSERT_EQ(gpu8.size(), cpu8.size());
  double from_bf16 = 0;
  for (size_t i = 0; i < cpu8.size(); ++i) {
    const double want = cpu8[i]["loss"], got = gpu8[i]["loss"], other = gpu16[i]["loss"];
    EXPECT_NEAR(got, want, 1e-3 * want) << "step " << i + 1;
    from_bf16 = std::max(from_bf16, std::abs(got - other));
  }
  EXPECT_GT(from_bf16, 1e-5) << "the fp8 GPU run is the bf16 one";
  // In blocks of 128 the Linears may run on the E4M3 tensor cores (ops::set_fp8_tensor_cores):
  // the same quantized products summed in another order, so the run is the bf16 GEMMs' to fp32
  // rounding (1e-4) and the CPU's (1e-3).
  Config wide = config(3);
  wide.runtime.matmul_precision = "fp8";
  wide.model.d_model = 128;
  wide.model.n_heads = 2;
  wide.model.n_layers = 1;
  wide.train.eval_every = 0;
  wide.runtime.fp8_block = 128;
  run_training(wide, options("fp8_128_cpu"));
  wide.runtime.device = "cuda";
  run_training(wide, options("fp8_128_gpu"));
  struct Restore {
    ~Restore() { ops::set_fp8_tensor_cores(false); }
  } restore;
  ops::set_fp8_tensor_cores(true);
  run_training(wide, options("fp8_128_gpu_tensor_cores"));
  expect_losses_near("fp8_128_gpu", "fp8_128_gpu_tensor_cores", 1e-4);
  expect_losses_near("fp8_128_cpu", "fp8_128_gpu_tensor_cores", 1e-3);
}

// A Llama (model.arch = "llama") trains through the same loop: the loss falls, evaluation runs,
// the layout report's activation estimate is near the measured peak, and a Llama checkpoint
// resumes bit for bit.
TEST_F(TrainTest, LlamaTrainsEvaluatesAndResumes) {
  Config c = config(8);
  c.model.arch = "llama";
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 64;
  const TrainSummary s = run_training(c, options("llama"));
  EXPECT_LT(s.last_loss, s.first_loss - 0.5) << "the Llama did not train";
  EXPECT_GT(s.last_val_loss, 0);
  // The estimate over the measured peak: as close as GPT-2's on the same sizes (1.31 here: two
  // small blocks, where the one block's worth the estimate adds on top weighs most).
  Config gpt2 = config(3);
  gpt2.model.n_heads = 4;
  const double ratio = expect_activation_estimate(s, 0.8, 1.4);
  const double gpt2_ratio =
      expect_activation_estimate(run_training(gpt2, options("gpt2")), 0.8, 1.4, "");
  EXPECT_NEAR(ratio, gpt2_ratio, 0.1) << s.layout_report;
  stop_and_resume(c, "llama_resumed", 4);
  expect_same_run(metrics("llama"), metrics("llama_resumed"));
}

// OLMo 2's norms (post-norms, full-width query/key norms) with selective recomputation, which
// keeps the branches' inputs beside the norms' (train/layout_report.cc): the estimate over the
// measured peak as near as the pre-norm Llama's is, both recomputed so; and the run trains. So
// too Gemma's sandwich norms, whose output norms keep the branches' outputs.
TEST_F(TrainTest, PostAndSandwichNormsAreCountedInTheActivationEstimate) {
  Config c = config(3);
  c.model.arch = "llama";
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 64;
  c.parallel.recompute = "selective";
  const double llama = expect_activation_estimate(run_training(c, options("llama")), 0.8, 1.4, "");
  for (const std::string placement : {"post", "sandwich"}) {  // OLMo 2's with its qk norms
    c.model.norm_placement = placement;
    c.model.qk_norm = placement == "post";
    c.model.qk_norm_scope = placement == "post" ? "full" : "head";
    const TrainSummary s = run_training(c, options(placement));
    EXPECT_LT(s.last_loss, s.first_loss) << placement << " did not train";
    EXPECT_NEAR(expect_activation_estimate(s, 0.8, 1.4), llama, 0.1) << s.layout_report;
  }
}

// At bf16 on a GPU a Llama keeps its activations in 16 bits as its GEMMs read them (RMSNorm,
// attention and SwiGLU outputs, fc's output, and with heads of 64 the flash kernels' qkv): it
// trains the fp32 GPU run's losses to bf16's rounding, its measured activation peak is well
// under that run's, and the layout report's estimate counts them as kept (near the peak).
TEST_F(TrainTest, LlamaAtBf16OnTheGpuKeepsItsActivationsInSixteenBits) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(6);
  c.model.arch = "llama";
  c.model.d_model = 128;
  c.model.n_heads = 2;  // heads of 64: the flash kernels at bf16
  c.model.n_kv_heads = 1;
  c.model.ffn_hidden = 128;
  c.runtime.device = "cuda";
  const TrainSummary fp32 = run_training(c, options("gpu_fp32"));
  c.runtime.matmul_precision = "bf16";
  const TrainSummary bf16 = run_training(c, options("gpu_bf16"));
  const auto m32 = metrics("gpu_fp32"), m16 = metrics("gpu_bf16");
  ASSERT_EQ(m16.size(), m32.size());
  for (size_t i = 0; i < m32.size(); ++i) {
    const double want = m32[i]["loss"], got = m16[i]["loss"];
    EXPECT_NEAR(got, want, 2e-2 * want) << "step " << i + 1;
  }
  EXPECT_LT(bf16.last_loss, bf16.first_loss - 0.3) << "the bf16 Llama did not train";
  expect_sixteen_bit_peak_below(bf16, fp32, 0.75);
  // (1.22 since the emulator's 16-bit-output GEMMs stopped counting an fp32 accumulator that a GPU
  // holds in registers: the estimate's block inventory runs above this small model's peak.)
  expect_activation_estimate(bf16, 0.8, 1.3);
}

#ifdef LOOM_CUDA_EMULATE
// How often a GPU step makes the host wait for the GPU (a drain: the compute stream runs dry
// until the host queues more), counted by the CUDA emulator (cuda_emu::host_activity) and, for
// the host's waits on communication, by the nccl backend (nccl_host_waits). A step
// waits for its micro-batches' losses once, at its end (nn/step_losses.h), for the loss over the
// ranks and for the gradient norm; a micro-batch does not wait for its loss nor for checks of
// its token ids (the loader checked them on the host: kernels/exec.h), and nothing waits per
// layer or per parameter: a layer's tensor-parallel all-reduce, a gradient bucket, ZeRO's gathers,
// a ring step and a pipeline's messages are waited for by the GPU's stream, not by the host
// (Work::wait_on_device). So the count grows neither with the depth nor with the micro-batches,
// on one GPU and under ZeRO-2, pipeline and tensor parallelism (the vocabulary-parallel head's
// loss summed on the GPU too) and the context-parallel ring. (A norm's sums of many parameters or
// ranges come back in one copy; ZeRO's chunks are copied in the stream's order; a received
// message's header is read on a stream of its own; the batches go up without a wait,
// copy_from_host_queued.) Under AddressSanitizer (CI's emulated GPUs, ~15× slower here) two
// layouts, the ring (which waited most per layer) and ZeRO-2 over dp 2. The weights' 16-bit copies
// on GPUs at bf16 (nn/rounded_weights.h, kept by the engines, made again after each optimizer
// step): every layout trains bit for bit the run whose GEMMs cast the fp32 weights themselves
// (LOOM_CUDA_WEIGHT_COPIES=0) — one GPU with two micro-batches a step and an evaluation between
// steps, ZeRO-1 over two GPUs (the values all-gathered after the update), a zero-bubble pipeline
// (the weight-gradient halves run later), tensor parallelism with sequence parallelism, ZeRO-3
// lending its bf16 gathers as the copies — and the copies are counted in mem_params_mb (none of
// its own at ZeRO-3).
TEST_F(TrainTest, GpuWeightCopiesTrainEveryLayoutsRunBitForBit) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  struct Layout {
    const char* name;
    int dp, pp, tp, zero;
  };
  struct NoCopies {
    NoCopies() { setenv("LOOM_CUDA_WEIGHT_COPIES", "0", 1); }
    ~NoCopies() { unsetenv("LOOM_CUDA_WEIGHT_COPIES"); }
  };
  for (const Layout& l : {Layout{"one_gpu", 1, 1, 1, 0}, Layout{"zero1", 2, 1, 1, 1},
                          Layout{"zb_pipeline", 1, 2, 1, 0}, Layout{"tp_sp", 1, 1, 2, 0},
                          Layout{"zero3_bf16_gathers", 2, 1, 1, 3}}) {
    SCOPED_TRACE(l.name);
    Config c = config(2);
    c.runtime.device = "cuda";
    c.runtime.matmul_precision = "bf16";
    c.train.warmup_steps = 1;
    c.train.eval_every = 1;
    c.train.batch_size = 4 * l.dp;
    c.train.micro_batch_size = 2;  // two micro-batches a step
    c.runtime.ranks = l.dp * l.pp * l.tp;
    c.parallel.dp = l.dp;
    c.parallel.pp = l.pp;
    c.parallel.tp = l.tp;
    c.parallel.zero = l.zero;
    c.parallel.sequence_parallel = l.tp > 1;
    if (l.pp > 1) c.parallel.schedule = "zb-h1";
    const bool lent = std::string(l.name) == "zero3_bf16_gathers";
    if (lent) c.parallel.param_gather_dtype = "bf16";
    const std::string copied = std::string(l.name) + "_copies",
                      cast = std::string(l.name) + "_cast";
    // The copies made, counted by the op profile (process-wide: every rank's).
    const auto roundings = [] {
      int64_t calls = 0;
      for (const ops::OpTime& t : ops::stop_profile())
        if (t.name == "round_weight") calls += t.calls;
      return calls;
    };
    // The weight operands the GEMM ops read as copies (ops::weight_copy_reads): ZeRO-3's too
    // where its bf16 gathers are lent as the copies.
    ops::start_profile();
    int64_t read_before = ops::weight_copy_reads();
    run_training(c, options(copied));
    const int64_t made = roundings(), reads = ops::weight_copy_reads() - read_before;
    {
      NoCopies off;
      ops::start_profile();
      read_before = ops::weight_copy_reads();
      run_training(c, options(cast));
      EXPECT_EQ(roundings(), 0);
      EXPECT_EQ(ops::weight_copy_reads(), read_before);
    }
    // One GPU: 9 weights (4 Linears a block, the head) read by the forward and the backward of 4
    // micro-batches and by the forward of 4 validation batches (2 after each step).
    if (std::string(l.name) == "one_gpu")
      EXPECT_EQ(reads, 9 * (2 * 4 + 4));
    else
      EXPECT_GT(reads, 0);
    // One GPU: its 9 weights copied for step 1, for the evaluation after step 1 (step 2 reads the
    // same weights) and for the one after step 2: 27, where the GEMMs cast each weight 4 times a
    // step (forward and input gradient of two micro-batches) and once an evaluation batch.
    if (std::string(l.name) == "one_gpu") {
      EXPECT_EQ(made, 27);
    } else if (l.zero == 3) {
      EXPECT_EQ(made, 0);
    } else {
      EXPECT_GT(made, 0);
    }
    const auto with = metrics(copied), without = metrics(cast);
    expect_same_run(with, without);
    ASSERT_FALSE(with.empty());
    EXPECT_TRUE(with.back().contains("val_loss"));
    // Rank 0's copies: its Linears' weights (its stage's blocks, the tp shards) and, on one GPU
    // or the last stage, the LM head's (its vocabulary rows under tp): 2 bytes a value.
    const double d = 32, V = 256, blocks = 2.0 / l.pp, weights_per_block = 12 * d * d / l.tp;
    const double head = l.pp == 1 ? V / l.tp * d : 0;
    const double copies_mb = 2 * (blocks * weights_per_block + head) / 1048576.0;
    const double extra =
        with.back()["mem_params_mb"].get<double>() - without.back()["mem_params_mb"].get<double>();
    if (l.zero == 3)
      EXPECT_EQ(extra, 0);
    else
      EXPECT_NEAR(extra, copies_mb, 1e-9) << "mem_params_mb";
  }
}

TEST_F(TrainTest, GpuStepsWaitForTheGpuAFewTimesWhateverTheDepth) {
  struct Layout {
    const char* name;
    int dp, pp, tp, cp, zero;
  };
  // Waits per step and rank: a 2-step run's less a 1-step run's (start-up apart). Small, as it
  // runs under ASan in CI: 16 positions, micro-batches of 2 sequences.
  const auto waits_per_step = [&](const Layout& l, int64_t layers, int64_t micro_batches) {
    double waits[2] = {0, 0};
    for (int64_t steps : {1, 2}) {
      Config c = config(steps);
      c.runtime.device = "cuda";
      c.runtime.matmul_precision = "bf16";
      c.train.warmup_steps = 0;
      c.train.eval_every = 0;
      c.train.batch_size = 2 * micro_batches * l.dp;
      c.train.micro_batch_size = 2;
      c.model.seq_len = 16;
      c.model.n_layers = layers;
      c.runtime.ranks = l.dp * l.pp * l.tp * l.cp;
      c.parallel.dp = l.dp;
      c.parallel.pp = l.pp;
      c.parallel.tp = l.tp;
      c.parallel.cp = l.cp;
      c.parallel.cp_comm = "ring";
      c.parallel.zero = l.zero;
      const int64_t before = cuda_emu::host_activity().host_waits + nccl_host_waits();
      run_training(c, options(std::string(l.name) + "_" + std::to_string(layers) + "_" +
                              std::to_string(micro_batches) + "_" + std::to_string(steps)));
      waits[steps - 1] = static_cast<double>(cuda_emu::host_activity().host_waits +
                                             nccl_host_waits() - before) /
                         c.runtime.ranks;
    }
    return waits[1] - waits[0];
  };
#ifdef LOOM_EMU_ASAN
  const std::vector<Layout> layouts = {{"cp2_ring", 1, 1, 1, 2, 0}, {"dp2_zero2", 2, 1, 1, 1, 2}};
#else
  const std::vector<Layout> layouts = {{"one_gpu", 1, 1, 1, 1, 0}, {"dp2_zero2", 2, 1, 1, 1, 2},
                                       {"pp2", 1, 2, 1, 1, 0}, {"tp2", 1, 1, 2, 1, 0},
                                       {"cp2_ring", 1, 1, 1, 2, 0}};
#endif
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    const int64_t layers = l.pp;  // at least one a stage
    const double shallow = waits_per_step(l, layers, 1), deep = waits_per_step(l, layers + 1, 1),
                 more = waits_per_step(l, layers, 3);
    EXPECT_EQ(deep, shallow) << "waits that grow with the layers";
    EXPECT_EQ(more, shallow) << "waits that grow with the micro-batches";
    EXPECT_LE(shallow, 6);
    EXPECT_GE(shallow, 1);  // the loss comes back
    RecordProperty(std::string(l.name) + "_host_waits_per_step", std::to_string(shallow));
    RecordProperty(std::string(l.name) + "_host_waits_per_step_3_micro_batches",
                   std::to_string(more));
  }
}

// Evaluation on a GPU: its batches go up queued, their ids were checked by its loader and their
// losses are queued where the head computes them and read once after the last batch, so a
// validation batch makes the host wait for nothing (1 while each loss was read at once, 3 before
// that: synchronous uploads and the embedding kernel's own id check too). From 1-step runs
// evaluating 1 and 3 batches.
TEST_F(TrainTest, GpuEvaluationBatchesDoNotWaitForTheGpu) {
  const auto waits = [&](const std::string& axis, int ranks, int64_t batches) {
    Config c = config(1);
    c.runtime.device = "cuda";
    c.runtime.ranks = ranks;
    c.parallel.pp = axis == "pp" ? ranks : 1;
    c.parallel.cp = axis == "cp" ? ranks : 1;
    c.parallel.dp = 1;
    c.train.warmup_steps = 0;
    c.train.eval_every = 1;
    c.train.eval_batches = batches;
    const int64_t before = cuda_emu::host_activity().host_waits + nccl_host_waits();
    run_training(c,
                 options("eval_" + axis + std::to_string(ranks) + "_" + std::to_string(batches)));
    return cuda_emu::host_activity().host_waits + nccl_host_waits() - before;
  };
  const double per_batch = static_cast<double>(waits("pp", 1, 3) - waits("pp", 1, 1)) / 2;
  EXPECT_EQ(per_batch, 0.0);
  RecordProperty("host_waits_per_validation_batch", std::to_string(per_batch));
  // A pipeline's last stage queues them too, summed over pp once, and a cp group's ranks their
  // positions' (cut on the host and uploaded queued), averaged over cp once: none a batch either
  // (both ranks' waits counted). The validation losses are one GPU's.
  if (cuda::device_count() < 2) return;
  for (const std::string axis : {"pp", "cp"}) {
    const double two = static_cast<double>(waits(axis, 2, 3) - waits(axis, 2, 1)) / 2;
    EXPECT_EQ(two, 0.0) << axis;
    RecordProperty(axis + "2_host_waits_per_validation_batch", std::to_string(two));
    expect_losses_near("eval_pp1_3", "eval_" + axis + "2_3", 1e-5);
  }
}
#endif

// A Llama on runtime.device = "cuda" (one rank: nccl as a group of one) trains the CPU's run step
// for step (fp32 rounding, not bits; validation too), and with selective recomputation — the
// RMSNorm and SwiGLU outputs dropped and rebuilt on the GPU — bit for bit its own run. On two
// GPUs, tensor parallelism (one key/value head and its two query heads per rank) matches the
// same layout on CPU ranks.
TEST_F(TrainTest, LlamaOnTheGpuTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(6);
  c.model.arch = "llama";
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.ffn_hidden = 64;
  const auto expect_same_losses = [&](const std::string& a, const std::string& b) {
    expect_losses_near(a, b, 1e-4);
  };
  const TrainSummary on_cpu = run_training(c, options("cpu"));
  EXPECT_LT(on_cpu.last_loss, on_cpu.first_loss - 0.3) << "the Llama did not train";
  Config gpu = c;
  gpu.runtime.device = "cuda";
  run_training(gpu, options("gpu"));
  expect_same_losses("cpu", "gpu");
  gpu.parallel.recompute = "selective";
  run_training(gpu, options("gpu_selective"));
  expect_same_run(metrics("gpu"), metrics("gpu_selective"));
  if (cuda::device_count() < 2) return;
  Config tp_cpu = c;
  tp_cpu.runtime.ranks = 2;
  tp_cpu.parallel.tp = 2;
  tp_cpu.parallel.dp = 1;
  Config tp_gpu = tp_cpu;
  tp_gpu.runtime.device = "cuda";
  run_training(tp_cpu, options("tp_cpus"));
  run_training(tp_gpu, options("tp_gpus"));
  expect_same_losses("tp_cpus", "tp_gpus");
}

// Document masking on GPUs (data.document_mask; each "a+b=c\n" problem a document ending at its
// newline): the starts uploaded with each micro-batch; one GPU trains the CPU's masked run, at
// fp32 on the batched attention and at bf16 on the flash kernels (head size 64) within bf16's
// rounding; two GPUs under cp 2 (the rows' flash kernels masked by position) likewise.
// train.batch_rampup on GPUs: the ramp's smaller steps from the same device buffers, one GPU and a
// pipeline over two (each step's schedule for its micro-batches), against the CPU's ramped run.
TEST_F(TrainTest, BatchRampupOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(6);
  c.model.n_layers = 2;
  c.train.batch_size = 16;
  c.train.micro_batch_size = 2;
  c.train.batch_rampup = "4 4 24";  // 4 4 8 12 16 16
  c.train.eval_every = 0;
  run_training(c, options("ramp_cpu"));
  Config gpu = c;
  gpu.runtime.device = "cuda";
  run_training(gpu, options("ramp_gpu"));
  expect_losses_near("ramp_cpu", "ramp_gpu", 1e-4);
  const auto records = metrics("ramp_gpu");
  ASSERT_EQ(records.size(), 6u);
  EXPECT_EQ(records[2].at("batch_size").get<int64_t>(), 8);
  if (cuda::device_count() < 2) return;
  gpu.runtime.ranks = 2;
  gpu.parallel.pp = 2;
  run_training(gpu, options("ramp_gpus_pp2"));
  expect_losses_near("ramp_cpu", "ramp_gpus_pp2", 1e-4);
}

void TrainTest::expect_gpus_train_the_cpu_run(
    const Config& c, const std::string& name,
    const std::function<void(ParallelConfig&)>& two_ranks) const {
  run_training(c, options(name + "_cpu"));
  Config gpu = c;
  gpu.runtime.device = "cuda";
  run_training(gpu, options(name + "_gpu"));
  expect_losses_near(name + "_cpu", name + "_gpu", 1e-4);
  gpu.runtime.matmul_precision = "bf16";
  run_training(gpu, options(name + "_gpu_bf16"));
  expect_losses_near(name + "_cpu", name + "_gpu_bf16", 2e-2);
  if (cuda::device_count() < 2) return;
  gpu.runtime.ranks = 2;
  gpu.parallel.dp = 1;
  two_ranks(gpu.parallel);
  run_training(gpu, options(name + "_gpus_bf16"));
  expect_losses_near(name + "_cpu", name + "_gpus_bf16", 2e-2);
}

TEST_F(TrainTest, DocumentMaskOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(4);
  c.model.d_model = 128;  // head size 64: the flash kernels at bf16
  c.data.document_mask = true;
  c.data.eot_token = '\n';
  expect_gpus_train_the_cpu_run(c, "doc", [](ParallelConfig& p) { p.cp = 2; });
}

// data.eod_mask_loss on GPUs: the cross-entropy kernels skip the ignored rows (fp32 logits, and
// the 16-bit logits at bf16), the vocabulary-parallel head's too under tp 2 on two GPUs; the
// runs train the CPU's masked run.
TEST_F(TrainTest, EodMaskLossOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(4);
  c.data.eod_mask_loss = true;
  c.data.eot_token = '\n';
  expect_gpus_train_the_cpu_run(c, "eod", [](ParallelConfig& p) { p.tp = 2; });
}

// data.reset_position_ids on GPUs: each token's place in its document found on the GPU, its row of
// wpe added and the rows' gradient summed in token order (no atomics); under cp 2 and tp 2 on
// two GPUs (a shard's places, the vocabulary-parallel embedding) too.
TEST_F(TrainTest, ResetPositionIdsOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(4);
  c.data.document_mask = true;
  c.data.reset_position_ids = true;
  c.data.eot_token = '\n';
  expect_gpus_train_the_cpu_run(c, "reset", [](ParallelConfig& p) { p.cp = 2; });
  Config tp = c;
  tp.runtime.device = "cuda";
  tp.runtime.ranks = 2;
  tp.parallel.tp = 2;
  if (cuda::device_count() < 2) return;
  run_training(tp, options("reset_gpus_tp2"));
  expect_losses_near("reset_cpu", "reset_gpus_tp2", 1e-4);
}

// data.loss_mask on GPUs: the loader's masked targets (only the answers of the addition corpus)
// through the GPU's cross-entropy kernels — fp32 and 16-bit logits, the vocabulary-parallel head
// under tp 2 on two GPUs — and validation by its shards' masks: the CPU's run.
TEST_F(TrainTest, LossMaskOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  for (const char* split : {"train_*.bin", "val_*.bin"})
    write_addition_answer_masks(resolve_shards((dir_ / "data" / split).string(), "test data"));
  Config c = config(4);
  c.data.loss_mask = true;
  c.train.eval_every = 2;
  expect_gpus_train_the_cpu_run(c, "loss_mask", [](ParallelConfig& p) { p.tp = 2; });
}

// train.z_loss on GPUs: the cross-entropy backwards' softmax term × (1 + 2 z lse) — fp32 logits,
// 16-bit logits at bf16, and the vocabulary-parallel head's shards under tp 2 on two GPUs.
TEST_F(TrainTest, ZLossOnGpusTrainsTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Config c = config(4);
  c.train.z_loss = 0.01;
  expect_gpus_train_the_cpu_run(c, "z_loss", [](ParallelConfig& p) { p.tp = 2; });
}

// Context parallelism on GPUs: each rank's positions on its own GPU, the keys and values
// all-gathered and their gradients reduce-scattered over nccl, the attention of the rank's query
// rows in the CUDA kernels (cuda::attention_gqa_*_rows), the position embedding's rows on the
// device. GPT-2 and Llama train the CPU's one-device run, validation included; at bf16 GEMMs the
// run stays within bf16's rounding of it, and so does GPT-2 under cp 2 × tp 2 on four GPUs (the
// tensor-parallel block's attention, a head a rank, on the flash kernels' rows: qkv written in
// bf16 and the output kept so, which the layout report's estimate counts; a Llama's in
// TensorParallelGpusAtBf16KeepTheNormOutputsInSixteenBits).
TEST_F(TrainTest, ContextParallelGpusTrainTheCpuRun) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  for (const char* arch : {"gpt2", "llama"}) {
    SCOPED_TRACE(arch);
    // Head size 64: at bf16 the rows' attention takes the flash kernels (at fp32 the GEMMs).
    Config c = config(4);
    c.model.arch = arch;
    c.model.d_model = 128;
    if (c.model.arch == "llama") {
      c.model.n_kv_heads = 1;
      c.model.ffn_hidden = 64;
    }
    c.runtime.threads_per_rank = 1;
    const std::string one = std::string("cp_cpu_") + arch;
    run_training(c, options(one));
    Config cp = c;
    cp.runtime.ranks = 2;
    cp.runtime.device = "cuda";
    cp.parallel.cp = 2;
    cp.parallel.dp = 1;
    const std::string gpus = std::string("cp_gpus_") + arch;
    const TrainSummary s32 = run_training(cp, options(gpus));
    cp.runtime.matmul_precision = "bf16";
    const std::string bf16 = std::string("cp_gpus_bf16_") + arch;
    const TrainSummary s16 = run_training(cp, options(bf16));
    // At bf16 the queries and the gathered keys/values are kept in bf16 with the other 16-bit
    // activations: the peak falls, and the start-up table's estimate, which counts them so, is
    // near it (kept in fp32 they would put it under 0.9).
    const auto peak = [](const TrainSummary& t) {
      return static_cast<double>(t.activation_peak_bytes);
    };
    EXPECT_LT(peak(s16), 0.75 * peak(s32));
    expect_activation_estimate(s16, 0.95, 1.15, "");
    const auto want = metrics(one), got = metrics(gpus), got16 = metrics(bf16);
    ASSERT_EQ(got.size(), want.size());
    ASSERT_EQ(got16.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      for (const char* key : {"loss", "val_loss"}) {
        ASSERT_EQ(got[i].contains(key), want[i].contains(key)) << key << ", step " << i + 1;
        if (!want[i].contains(key)) continue;
        const double w = want[i][key];
        EXPECT_NEAR(got[i][key].get<double>(), w, 1e-4 * w) << key << ", step " << i + 1;
        EXPECT_NEAR(got16[i][key].get<double>(), w, 2e-2 * w)
            << "bf16 " << key << ", step " << i + 1;
      }
      EXPECT_GT(got[i]["comm_bytes"]["cp"].get<double>(), 0) << "step " << i + 1;
      // At bf16 the keys and values cross in bf16 (the flash kernels' rows), their gradients in
      // fp32. The counter counts a collective's input — the all-gather's local rows, the
      // reduce-scatter's cp × as many — so at cp 2: fp32 1 + 2, bf16 1/2 + 2, a ratio of 5/6.
      const double ratio = got16[i]["comm_bytes"]["cp"].get<double>() /
                           got[i]["comm_bytes"]["cp"].get<double>();
      EXPECT_NEAR(ratio, 5.0 / 6.0, 1e-12) << "bf16 keys and values, step " << i + 1;
    }
    if (c.model.arch != "gpt2" || cuda::device_count() < 4) continue;
    Config tp = cp;
    tp.runtime.ranks = 4;
    tp.parallel.tp = 2;
    const std::string cp_tp = "cp_tp_gpus_bf16";
    const TrainSummary s_tp = run_training(tp, options(cp_tp));
    // GPT-2's peak here was 659456 B when the tp block kept its qkv and output in fp32 under cp
    // (estimate 1.11 of it), 643072 B after (1.10), 676352 B on 2026-12-07 (1.02; the same
    // before and after sequence parallelism kept its rows, which this layout does not use).
    expect_activation_estimate(s_tp, 0.95, 1.15, cp_tp + "_estimate_ratio");
    RecordProperty(cp_tp + "_activation_peak", std::to_string(peak(s_tp)));
    const auto got_tp = metrics(cp_tp);
    ASSERT_EQ(got_tp.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const double w = want[i]["loss"];
      EXPECT_NEAR(got_tp[i]["loss"].get<double>(), w, 2e-2 * w) << "cp × tp, step " << i + 1;
      // A rank's keys and values are its half of the heads: half the cp bytes of cp 2 alone.
      EXPECT_NEAR(got_tp[i]["comm_bytes"]["cp"].get<double>() /
                      got16[i]["comm_bytes"]["cp"].get<double>(),
                  0.5, 1e-12)
          << "cp × tp bytes, step " << i + 1;
    }
  }
}

// Context parallelism's ring (parallel.cp_comm = "ring") on GPUs: each rank's block of keys and
// values passed round over nccl (send and recv in one group), the flash kernels (bf16, head size
// 64) or the batched GEMMs (fp32) taking a block's key positions — the CPU run's losses, at cp 2
// and, with 4 GPUs, cp 4. The bytes say what crossed: per layer at cp 2 the forward's block and
// the backward's again, and the gradients' two sends (the share on, the sum home) — 4 block-sized
// messages in fp32 against the all-gather's 3 (1 gathered + 2 reduce-scattered); at bf16 the
// blocks cross in bf16 and their gradients in fp32 (0.5 + 0.5 + 2 = 3 of 4).
TEST_F(TrainTest, ContextParallelRingOnGpusTrainsTheCpuRun) {
  if (!cuda_available() || cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Config c = config(3);
  c.model.d_model = 128;
  c.runtime.threads_per_rank = 1;
  run_training(c, options("ring_cpu"));
  const auto want = metrics("ring_cpu");
  Config cp = c;
  cp.runtime.ranks = 2;
  cp.runtime.device = "cuda";
  cp.parallel.cp = 2;
  cp.parallel.dp = 1;
  run_training(cp, options("gather_gpus"));
  cp.parallel.cp_comm = "ring";
  const TrainSummary s32 = run_training(cp, options("ring_gpus"));
  cp.runtime.matmul_precision = "bf16";
  const TrainSummary s16 = run_training(cp, options("ring_gpus_bf16"));
  EXPECT_LT(static_cast<double>(s16.activation_peak_bytes),
            0.9 * static_cast<double>(s32.activation_peak_bytes))
      << "bf16 blocks";
  const auto gather = metrics("gather_gpus"), got = metrics("ring_gpus"),
             got16 = metrics("ring_gpus_bf16");
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(got16.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i]["loss"];
    EXPECT_NEAR(got[i]["loss"].get<double>(), w, 1e-4 * w) << "step " << i + 1;
    EXPECT_NEAR(got16[i]["loss"].get<double>(), w, 2e-2 * w) << "bf16, step " << i + 1;
    const double ring = got[i]["comm_bytes"]["cp"].get<double>();
    EXPECT_NEAR(ring / gather[i]["comm_bytes"]["cp"].get<double>(), 4.0 / 3.0, 1e-12)
        << "ring against all-gather bytes, step " << i + 1;
    EXPECT_NEAR(got16[i]["comm_bytes"]["cp"].get<double>() / ring, 3.0 / 4.0, 1e-12)
        << "bf16 blocks, step " << i + 1;
  }
  if (cuda::device_count() < 4) return;
  cp.runtime.ranks = 4;
  cp.parallel.cp = 4;
  run_training(cp, options("ring_gpus_cp4"));
  const auto got4 = metrics("ring_gpus_cp4");
  ASSERT_EQ(got4.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i]["loss"];
    EXPECT_NEAR(got4[i]["loss"].get<double>(), w, 2e-2 * w) << "cp 4 bf16, step " << i + 1;
  }
}

// With the corpus in shards of 1000 tokens a shard's end falls inside a step, every few steps.
// Layouts that split a step's sequences differently read the same ones there too: one rank
// accumulating two micro-batches of 4 sequences trains two data-parallel ranks' run of one
// micro-batch each (a loader reading whole steps would skip a shard's tail of a length that
// depends on the layout: 28 sequences of each shard for the one, 24 for the two).
TEST_F(TrainTest, EveryLayoutReadsTheSameSequencesAcrossShardEnds) {
  const std::vector<uint16_t> corpus = read_shard((dir_ / "data" / "train_000000.bin").string());
  fs::create_directories(dir_ / "small");
  for (size_t k = 0; k < 20; ++k)
    write_shard((dir_ / "small" / shard_file_name("train", static_cast<int64_t>(k))).string(),
                std::vector<uint16_t>(corpus.begin() + static_cast<ptrdiff_t>(k * 1000),
                                      corpus.begin() + static_cast<ptrdiff_t>((k + 1) * 1000)));
  Config c = config(12);
  c.data.train = (dir_ / "small" / "train_*.bin").string();
  c.train.eval_every = 0;
  c.train.save_every = 5;
  run_training(c, options("one"));
  expect_dp2_trains_one_ranks_run_and_resumes(c);
}

// data.blend mixes two corpora by weight into one stream of sequences that every layout reads
// alike: two data-parallel ranks train one rank's run; a checkpoint holds each source's position
// and resumes bit for bit under its layout and to rounding under another; a blended checkpoint
// resumed with data.train (or the other way round) is an error naming both.
TEST_F(TrainTest, DataBlendTrainsEveryLayoutOnOneStreamAndResumes) {
  synthesize_addition((dir_ / "data2").string(), 30000, 4000, 8);
  Config c = config(6);
  c.train.eval_every = 3;
  // Each corpus' validation loss on its own (data.val_sets), beside data.val's.
  c.data.val_sets = "addition=" + (dir_ / "data" / "val_*.bin").string() +
                    " other=" + (dir_ / "data2" / "val_*.bin").string();
  c.data.train.clear();
  c.data.blend = "3 " + (dir_ / "data" / "train_*.bin").string() + " 1 " +
                 (dir_ / "data2" / "train_*.bin").string();
  c.train.save_every = 3;
  const TrainSummary one = run_training(c, options("one"));
  EXPECT_NE(one.layout_report.find("data.blend source 2:  25.0% of the sequences"),
            std::string::npos)
      << one.layout_report;
  const auto records = metrics("one");
  ASSERT_EQ(records.size(), 6u);
  for (const size_t i : {2u, 5u}) {  // steps 3 and 6
    ASSERT_TRUE(records[i].contains("val_losses")) << records[i];
    // data.val's shards again: its loss to the bit.
    EXPECT_EQ(records[i]["val_losses"]["addition"], records[i]["val_loss"]);
    EXPECT_NE(records[i]["val_losses"]["other"], records[i]["val_loss"]);
  }
  EXPECT_FALSE(records[0].contains("val_losses"));
  // Each source's epochs read: 36 of 59999 / 32 = 1874 windows, 12 of 29999 / 32 = 937.
  EXPECT_DOUBLE_EQ(records[5].at("data_epochs").at("1").get<double>(), 36.0 / 1874);
  EXPECT_DOUBLE_EQ(records[5].at("data_epochs").at("2").get<double>(), 12.0 / 937);
  EXPECT_EQ(one.last_val_losses.at("other"), records[5]["val_losses"]["other"].get<double>());
  // The checkpoint's positions: 48 sequences, three in four from the first corpus.
  std::ifstream in(dir_ / "one" / "checkpoints" / "step_6" / "state.json");
  const nlohmann::json sources = nlohmann::json::parse(in).at("loader").at("sources");
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_EQ(sources[0].at("sequences"), 36);
  EXPECT_EQ(sources[1].at("sequences"), 12);
  EXPECT_EQ(sources[1].at("offset"), 12 * 32);  // 12 windows of T = 32 into its first shard

  expect_dp2_trains_one_ranks_run_and_resumes(c);
  // dp 2's step-3 checkpoint, resumed on one rank.
  fs::create_directories(dir_ / "moved" / "checkpoints");
  fs::copy(dir_ / "dp2" / "checkpoints" / "step_3", dir_ / "moved" / "checkpoints" / "step_3",
           fs::copy_options::recursive);
  TrainOptions moved = options("moved");
  moved.resume = "auto";
  EXPECT_EQ(run_training(c, moved).start_step, 3);
  const auto mo = metrics("moved"), mw = metrics("one");
  ASSERT_EQ(mo.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(mo[i].at("loss").get<double>(), mw[i + 3].at("loss").get<double>(), 1e-5)
        << "step " << i + 4;

  Config single = config(6);
  const std::string e = resume_error(single, "one", 3);
  EXPECT_NE(e.find("step_3 was written by a run reading data.blend (2 sources), in order; this run "
                   "reads data.train, in order"),
            std::string::npos)
      << e;
  TrainOptions plain_run = options("plain");
  plain_run.stop_after = 3;
  run_training(single, plain_run);
  EXPECT_NE(resume_error(c, "plain", 3)
                .find("reading data.train, in order; this run reads data.blend (2 sources)"),
            std::string::npos);
}

// A run resumed with other data.blend weights (a new mix for its next phase, as an annealing
// phase's) mixes the sequences from there on at the new shares, each source going on from its
// position; the same shares written otherwise (6:2 for 3:1) resume bit for bit.
TEST_F(TrainTest, ANewDataMixOnResumeHoldsFromThere) {
  synthesize_addition((dir_ / "data2").string(), 30000, 0, 8);
  const std::string a = (dir_ / "data" / "train_*.bin").string();
  const std::string b = (dir_ / "data2" / "train_*.bin").string();
  Config c = config(6);
  c.train.eval_every = 0;
  c.train.save_every = 3;
  c.data.train.clear();
  c.data.blend = "3 " + a + " 1 " + b;
  run_training(c, options("straight"));
  TrainOptions stop = options("rewritten");
  stop.stop_after = 3;
  run_training(c, stop);
  stop.run_dir = (dir_ / "remixed").string();
  run_training(c, stop);

  Config rewritten = c;
  rewritten.data.blend = "6 " + a + " 2 " + b;
  TrainOptions resume = options("rewritten");
  resume.resume = "auto";
  run_training(rewritten, resume);
  expect_same_run(metrics("straight"), metrics("rewritten"));

  Config remixed = c;
  remixed.data.blend = "1 " + a + " 3 " + b;
  resume.run_dir = (dir_ / "remixed").string();
  run_training(remixed, resume);
  // Steps 1-3: 24 sequences at 3:1 (18 + 6); steps 4-6: 24 at 1:3 (6 + 18), counted afresh.
  std::ifstream in(dir_ / "remixed" / "checkpoints" / "step_6" / "state.json");
  const nlohmann::json sources = nlohmann::json::parse(in).at("loader").at("sources");
  EXPECT_EQ(sources[0].at("sequences"), 6);
  EXPECT_EQ(sources[1].at("sequences"), 18);
  EXPECT_EQ(sources[0].at("offset"), (18 + 6) * 32);
  EXPECT_EQ(sources[1].at("offset"), (6 + 18) * 32);
}

// data.shuffle: data.train in another order each epoch. The run reads other sequences than in
// order (its losses differ), two data-parallel ranks train one rank's run, it stops and resumes
// bit for bit (through sharded checkpoints, whose state.json carries the loader's position as
// the whole format's does), and a checkpoint resumed with shuffling switched off is an error
// naming both.
TEST_F(TrainTest, ShuffledDataTrainsEveryLayoutAlikeAndResumes) {
  Config c = config(6);
  c.train.eval_every = 0;
  c.train.save_every = 3;
  c.train.checkpoint_format = "sharded";
  run_training(c, options("in_order"));
  c.data.shuffle = true;
  const TrainSummary one = run_training(c, options("one"));
  EXPECT_NE(one.layout_report.find("passes over this run, each pass in its own order"),
            std::string::npos)
      << one.layout_report;
  const auto shuffled = metrics("one"), in_order = metrics("in_order");
  ASSERT_EQ(shuffled.size(), in_order.size());
  EXPECT_NE(shuffled[0].at("loss"), in_order[0].at("loss"));

  expect_dp2_trains_one_ranks_run_and_resumes(c);

  Config plain = c;
  plain.data.shuffle = false;
  const std::string e = resume_error(plain, "one", 3);
  EXPECT_NE(e.find("written by a run reading data.train, shuffled (data.shuffle = true) by seed 11 "
                   "(train.seed); this run reads data.train, in order"),
            std::string::npos)
      << e;

  // data.seed: the orders' own seed. Equal to train.seed it is the same run, bit for bit; another
  // data.seed reads other sequences (the same initialisation, another first loss); another
  // train.seed over the same data.seed reads the same ones (the loader's first 12 sequences).
  Config same = c;
  same.data.seed = c.train.seed;
  run_training(same, options("data_seed_same"));
  expect_same_run(metrics("one"), metrics("data_seed_same"));
  Config reorder = c;
  reorder.data.seed = 99;
  run_training(reorder, options("data_seed_99"));
  EXPECT_NE(metrics("data_seed_99")[0].at("loss"), metrics("one")[0].at("loss"));
  const auto first_sequences = [](const Config& config) {
    TrainData data(config, 4, config.model.seq_len, 0, 1);
    std::vector<int32_t> in(4 * config.model.seq_len), tg(in.size()), all;
    for (int i = 0; i < 3; ++i) {
      data.next_batch(in.data(), tg.data());
      all.insert(all.end(), in.begin(), in.end());
    }
    return all;
  };
  Config sweep = reorder;
  sweep.train.seed = c.train.seed + 1;
  EXPECT_EQ(first_sequences(sweep), first_sequences(reorder));
  sweep.data.seed = -1;  // the orders of train.seed 12
  EXPECT_NE(first_sequences(sweep), first_sequences(reorder));
  // Resuming a shuffled run under another order's seed would reread and skip sequences: refused,
  // naming both seeds and the data.seed that keeps the order.
  Config other = c;
  other.train.seed = c.train.seed + 1;
  const std::string e2 = resume_error(other, "one", 3);
  EXPECT_NE(e2.find("shuffled (data.shuffle = true) by seed 11 (train.seed); this run reads "
                    "data.train, shuffled (data.shuffle = true) by seed 12 (train.seed)"),
            std::string::npos)
      << e2;
  EXPECT_NE(e2.find("or set data.seed = 11 to keep its data order"), std::string::npos) << e2;
  other.data.seed = 11;  // ... which resumes
  TrainOptions o = options("one_reseeded");
  o.resume = (dir_ / "one" / "checkpoints" / "step_3").string();
  EXPECT_NO_THROW(run_training(other, o));
}

// train.batch_rampup (Megatron-LM's --rampup-batch-size "4 4 40" to 16): the steps' batches are
// the rule's, 4 4 4 4 8 8 12 16 16, with the metrics' tokens their running sum; two data-parallel
// ranks train one rank's run and a run stopped mid-ramp resumes bit for bit; a pipeline (1F1B,
// and interleaved: each step's schedule made for its micro-batches) trains it too. A START that
// does not split into every rank's micro-batches is refused by name.
TEST_F(TrainTest, BatchRampupGrowsTheBatchAndEveryLayoutFollowsIt) {
  Config c = config(9);
  c.model.n_layers = 4;  // interleaved pp 2: two chunks a rank
  c.train.batch_size = 16;
  c.train.micro_batch_size = 2;
  c.train.batch_rampup = "4 4 40";
  c.train.eval_every = 0;
  c.train.save_every = 3;
  const TrainSummary one = run_training(c, options("one"));
  const auto records = metrics("one");
  ASSERT_EQ(records.size(), 9u);
  const std::vector<int64_t> batches = {4, 4, 4, 4, 8, 8, 12, 16, 16};
  int64_t tokens = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    tokens += batches[i] * c.model.seq_len;
    EXPECT_EQ(records[i].at("batch_size").get<int64_t>(), batches[i]) << "step " << i + 1;
    EXPECT_EQ(records[i].at("tokens").get<int64_t>(), tokens) << "step " << i + 1;
  }
  // The LR schedule follows the sequences consumed, in full batches of 16 (Megatron-LM's by
  // samples): warm-up over 3 × 16 = 48 sequences (steps 1-9 consume 4 8 12 16 24 32 44 60 76),
  // cosine from 48 to the run's 76 sequences.
  {
    const double lr = c.train.lr, warmup = static_cast<double>(c.train.warmup_steps) * 16,
                 total = 76, min_lr = lr * c.train.min_lr_ratio;
    double consumed = 0;
    for (size_t i = 0; i < batches.size(); ++i) {
      const double done = consumed;
      consumed += static_cast<double>(batches[i]);
      const double want =
          done < warmup ? lr * std::min(consumed, warmup) / warmup
                        : min_lr + (lr - min_lr) * 0.5 *
                                       (1 + std::cos(M_PI * (done - warmup) / (total - warmup)));
      EXPECT_NEAR(records[i].at("lr").get<double>(), want, 1e-6 * lr) << "step " << i + 1;
    }
    EXPECT_EQ(c.train.lr_schedule, "cosine");
  }
  EXPECT_NE(one.layout_report.find("train.batch_rampup: the batch grows from 4 by 4 to 16 over "
                                   "the first 40 sequences (steps 1-7)"),
            std::string::npos)
      << one.layout_report;
  // The ramp's first passes over data.train: 76 sequences of 32 of the run, not 9 × 16.
  EXPECT_NE(one.layout_report.find("0.04 passes over this run"), std::string::npos)
      << one.layout_report;
  expect_dp2_trains_one_ranks_run_and_resumes(c);
  for (const char* schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    Config pp = c;
    pp.runtime.ranks = 2;
    pp.runtime.threads_per_rank = 1;
    pp.parallel.pp = 2;
    pp.parallel.schedule = schedule;
    if (std::string(schedule) == "interleaved") pp.parallel.virtual_stages = 2;
    const std::string run = std::string("pp2_") + schedule;
    run_training(pp, options(run));
    expect_losses_near("one", run, 1e-5);
  }
  Config bad = c;
  bad.train.batch_rampup = "6 4 40";
  const std::string e = error_of([&] { run_training(bad, options("bad")); });
  EXPECT_NE(e.find("train.batch_rampup: train.batch_size - START = 10 is not a multiple of "
                   "INCREMENT = 4"),
            std::string::npos)
      << e;
  bad.train.batch_rampup = "6 2 40";
  bad.parallel.dp = 2;
  bad.runtime.ranks = 2;
  EXPECT_NE(error_of([&] { run_training(bad, options("bad")); })
                .find("START = 6 and INCREMENT = 2 must be multiples of train.micro_batch_size × "
                      "parallel.dp = 4"),
            std::string::npos);
}

TEST_F(TrainTest, RecomputeAndAccumulationKeepTheRun) {
  // Recomputation changes memory, not numbers: full (here by its deprecated spelling) and
  // selective.
  run_training(config(5), options("plain"));
  Config c = config(5);
  c.train.recompute = true;  // parallel.recompute = "full"
  run_training(c, options("recompute"));
  expect_same_run(metrics("plain"), metrics("recompute"));
  c = config(5);
  c.parallel.recompute = "selective";
  run_training(c, options("selective"));
  expect_same_run(metrics("plain"), metrics("selective"));
}

TEST_F(TrainTest, ResumeAutoWithoutCheckpointStartsFresh) {
  TrainOptions o = options("fresh");
  o.resume = "auto";
  EXPECT_EQ(run_training(config(4), o).start_step, 0);
}

TEST_F(TrainTest, CheckpointOfAnotherShapeIsAClearError) {
  TrainOptions o = options("shape");
  o.stop_after = 2;
  run_training(config(4), o);
  Config other = config(4);
  other.model.d_model = 64;
  TrainOptions r = options("shape");
  r.resume = "auto";
  try {
    run_training(other, r);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step_2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[256, 32]"), std::string::npos) << msg;
  }
  // Nothing already saved is lost.
  EXPECT_TRUE(fs::exists(dir_ / "shape" / "checkpoints" / "step_2" / "model.safetensors"));
}

TEST_F(TrainTest, MissingDataIsAClearError) {
  Config c = config(4);
  c.data.train = (dir_ / "nope" / "*.bin").string();
  try {
    run_training(c, options("missing"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.train"), std::string::npos) << e.what();
  }
}

TEST_F(TrainTest, CorruptShardIsAClearError) {
  const fs::path bad = dir_ / "bad.bin";
  std::ofstream(bad) << "this is not a token shard, just text that is long enough to be read";
  Config c = config(4);
  c.data.train = bad.string();
  try {
    run_training(c, options("corrupt"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.bin"), std::string::npos) << e.what();
  }
}

// A token id past model.vocab_size fails the run naming the shard and the vocabulary — on CPU
// ranks and on a GPU alike: the loader checks every id on the host (data/loader.h) before the
// batch goes up, and the GPU's kernels, told so, do not check again (a wait per op).
TEST_F(TrainTest, TokensOutsideTheVocabularyFailNamingTheShard) {
  for (const char* device : {"cpu", "cuda"}) {
    if (std::string(device) == "cuda" && !cuda_available()) continue;
    SCOPED_TRACE(device);
    Config c = config(4);
    c.runtime.device = device;
    c.model.vocab_size = 40;  // the corpus's digits and signs are ASCII, past 40
    try {
      run_training(c, options(std::string("vocab_") + device));
      FAIL() << "expected an error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("train"), std::string::npos) << msg;  // the shard's name
      EXPECT_NE(msg.find(".bin"), std::string::npos) << msg;
      EXPECT_NE(msg.find("vocabulary [0, 40)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("model.vocab_size"), std::string::npos) << msg;
    }
  }
}

// The validation loader checks its ids too (so that evaluation's kernels may skip their own
// checks, a wait each on a GPU): a bad id in a validation shard fails the first evaluation,
// naming that shard, on CPU ranks and on the GPU.
TEST_F(TrainTest, ValidationTokensOutsideTheVocabularyFailNamingTheShard) {
  std::vector<uint16_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 200);
  tokens[70] = 300;  // in the first evaluation's batches
  fs::create_directories(dir_ / "bad_val");
  write_shard((dir_ / "bad_val" / "val_000.bin").string(), tokens);
  for (const char* device : {"cpu", "cuda"}) {
    if (std::string(device) == "cuda" && !cuda_available()) continue;
    SCOPED_TRACE(device);
    Config c = config(4);
    c.runtime.device = device;
    c.data.val = (dir_ / "bad_val" / "val_*.bin").string();
    try {
      run_training(c, options(std::string("bad_val_") + device));
      FAIL() << "expected an error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("val_000.bin"), std::string::npos) << msg;
      EXPECT_NE(msg.find("vocabulary [0, 256)"), std::string::npos) << msg;
    }
  }
}

// train.keep_checkpoints = K keeps the newest K complete checkpoints after each save (0, the
// default, keeps them all); an incomplete one (a save cut short) is left alone, and the run
// resumes from what is kept.
TEST_F(TrainTest, KeepCheckpointsRemovesTheOldestAfterEachSave) {
  auto steps_in = [&](const std::string& run) {
    std::vector<std::string> names;
    for (const std::string& p : list_checkpoints((dir_ / run / "checkpoints").string()))
      names.push_back(fs::path(p).filename().string());
    return names;
  };
  Config all = config(8);
  all.train.save_every = 2;
  run_training(all, options("all"));
  EXPECT_EQ(steps_in("all"), (std::vector<std::string>{"step_2", "step_4", "step_6", "step_8"}));

  Config kept = all;
  kept.train.keep_checkpoints = 2;
  TrainOptions stop = options("kept");
  stop.stop_after = 6;
  run_training(kept, stop);
  EXPECT_EQ(steps_in("kept"), (std::vector<std::string>{"step_4", "step_6"}));
  fs::create_directories(dir_ / "kept" / "checkpoints" / "step_5.tmp");  // a save cut short
  kept.train.steps = 10;
  TrainOptions resume = options("kept");
  resume.resume = "auto";
  EXPECT_EQ(run_training(kept, resume).start_step, 6);
  EXPECT_EQ(steps_in("kept"), (std::vector<std::string>{"step_8", "step_10"}));
  EXPECT_TRUE(fs::exists(dir_ / "kept" / "checkpoints" / "step_5.tmp"));

  // Resumed from an earlier checkpoint of its directory, a run prunes only up to the step it
  // saved: the later checkpoints are another timeline's and stay.
  Config one = all;
  one.train.keep_checkpoints = 1;
  TrainOptions back = options("all");
  back.resume = (dir_ / "all" / "checkpoints" / "step_4").string();
  back.stop_after = 6;
  EXPECT_EQ(run_training(one, back).start_step, 4);
  EXPECT_EQ(steps_in("all"), (std::vector<std::string>{"step_6", "step_8"}));
}

// A damaged validation shard stops the run before its first step, not at the first evaluation.
TEST_F(TrainTest, DamagedValidationShardFailsBeforeTraining) {
  fs::resize_file(dir_ / "data" / "val_000000.bin", 1000);  // inside the 1024-byte header
  Config c = config(8);
  c.train.eval_every = 6;
  try {
    run_training(c, options("val"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("val_000000.bin"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(metrics("val").empty());  // not one step was taken
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Checkpoints record each tensor file's length and digest. A file that is not as written — a
// flipped bit in its data or its header, cut short, or another checkpoint's — is an error that
// names the checkpoint, the file and the checkpoint before it, both when resuming and in
// verify_checkpoint; nothing of it reaches the model, and the intact file resumes as before.
TEST_F(TrainTest, DamagedCheckpointFileIsNamedNeverResumedFrom) {
  Config c = config(4);
  c.train.save_every = 2;
  run_training(c, options("run"));
  const fs::path checkpoints = dir_ / "run" / "checkpoints";
  const fs::path step_4 = checkpoints / "step_4", step_2 = checkpoints / "step_2";
  ASSERT_EQ(verify_checkpoint(step_4.string()).size(), 2u);  // model and optimizer
  const std::string model = read_bytes(step_4 / "model.safetensors");
  const std::string moments = read_bytes(step_4 / "optimizer.safetensors");

  struct Damage {
    const char* what;
    const char* file;
    std::function<void()> apply;
    const char* says;
  };
  const Damage damages[] = {
      {"a bit in the weights", "model.safetensors",
       [&] {
         std::string b = model;
         b[b.size() / 2] ^= 0x10;
         write_bytes(step_4 / "model.safetensors", b);
       },
       "is not what was written"},
      {"a byte of the header", "optimizer.safetensors",
       [&] {
         std::string b = moments;
         b[20] ^= 0x01;
         write_bytes(step_4 / "optimizer.safetensors", b);
       },
       "is not what was written"},
      {"cut short", "optimizer.safetensors",
       [&] {
         write_bytes(step_4 / "optimizer.safetensors", moments.substr(0, moments.size() / 2));
       },
       "were written (truncated"},
      {"another checkpoint's", "model.safetensors",
       [&] {
         fs::copy_file(step_2 / "model.safetensors", step_4 / "model.safetensors",
                       fs::copy_options::overwrite_existing);
       },
       "is not what was written"},
  };
  TrainOptions resume = options("run");
  resume.resume = "auto";
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.what);
    write_bytes(step_4 / "model.safetensors", model);
    write_bytes(step_4 / "optimizer.safetensors", moments);
    d.apply();
    for (const std::string& msg : {error_of([&] { run_training(config(6), resume); }),
                                   error_of([&] { verify_checkpoint(step_4.string()); })}) {
      EXPECT_NE(msg.find(step_4.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(d.file), std::string::npos) << msg;
      EXPECT_NE(msg.find(d.says), std::string::npos) << msg;
      EXPECT_NE(msg.find("--resume " + step_2.string()), std::string::npos) << msg;
    }
    EXPECT_EQ(verify_checkpoint(step_2.string()).size(), 2u);  // the earlier one is intact
  }
  write_bytes(step_4 / "model.safetensors", model);
  write_bytes(step_4 / "optimizer.safetensors", moments);
  EXPECT_EQ(run_training(config(6), resume).start_step, 4);
}

// A checkpoint from before digests existed (no "files" in state.json) still resumes; there is
// nothing to verify it against, which verify_checkpoint says.
// A checkpoint written before state.json's loader.sources (data.train's position in loader.shard,
// .offset and .epoch alone) resumes on the same sequences: bit for bit the run not stopped.
TEST_F(TrainTest, CheckpointFromBeforeLoaderSourcesResumesInOrder) {
  Config c = config(6);
  c.train.eval_every = 0;
  run_training(c, options("straight"));
  TrainOptions stop = options("old");
  stop.stop_after = 3;
  run_training(c, stop);
  const fs::path state = dir_ / "old" / "checkpoints" / "step_3" / "state.json";
  nlohmann::json j = nlohmann::json::parse(read_bytes(state));
  ASSERT_EQ(j.at("loader").at("sources").size(), 1u);
  EXPECT_EQ(j.at("loader").at("offset"), 3 * 8 * 32);  // in order: the token offset
  j["loader"].erase("sources");
  write_bytes(state, j.dump(2));
  // The same without the config a checkpoint records (which says how its run read): no position
  // per source is data.train in order, so a shuffled run may not take it.
  fs::create_directories(dir_ / "no_config" / "checkpoints");
  fs::copy(state.parent_path(), dir_ / "no_config" / "checkpoints" / "step_3",
           fs::copy_options::recursive);
  fs::copy(dir_ / "old" / "metrics.jsonl", dir_ / "no_config" / "metrics.jsonl");
  nlohmann::json bare = j;
  bare.erase("config");
  write_bytes((dir_ / "no_config" / "checkpoints" / "step_3" / "state.json").string(),
              bare.dump(2));
  TrainOptions resume = options("old");
  resume.resume = "auto";
  EXPECT_EQ(run_training(c, resume).start_step, 3);
  expect_same_run(metrics("straight"), metrics("old"));
  Config shuffled = c;
  shuffled.data.shuffle = true;
  EXPECT_NE(resume_error(shuffled, "no_config", 3)
                .find("reading data.train, in order; this run reads data.train, shuffled"),
            std::string::npos);
  TrainOptions bare_resume = options("no_config");
  bare_resume.resume = "auto";
  EXPECT_EQ(run_training(c, bare_resume).start_step, 3);
  expect_same_run(metrics("straight"), metrics("no_config"));
}

TEST_F(TrainTest, CheckpointWithoutDigestsStillResumes) {
  Config c = config(4);
  c.train.save_every = 2;
  run_training(c, options("old"));
  const fs::path state = dir_ / "old" / "checkpoints" / "step_4" / "state.json";
  nlohmann::json j = nlohmann::json::parse(read_bytes(state));
  ASSERT_TRUE(j.contains("files"));
  j.erase("files");
  write_bytes(state, j.dump(2));
  TrainOptions resume = options("old");
  resume.resume = "auto";
  EXPECT_EQ(run_training(config(6), resume).start_step, 4);
  const std::string dir = state.parent_path().string();
  EXPECT_NE(error_of([&] { verify_checkpoint(dir); }).find("records no file digests"),
            std::string::npos);
  // Nor does a state.json make Loom read files outside its checkpoint.
  j["files"] = {{"../../data/train_000000.bin", {{"bytes", 1}, {"xxh3_64", "0000000000000000"}}}};
  write_bytes(state, j.dump(2));
  EXPECT_NE(
      error_of([&] { verify_checkpoint(dir); }).find("not a file of the checkpoint directory"),
      std::string::npos);
}

}  // namespace
}  // namespace loom

