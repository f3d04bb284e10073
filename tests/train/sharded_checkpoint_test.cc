// Sharded checkpoints (train.checkpoint_format = "sharded") through the trainer: under every kind
// of layout the ranks' shards hold exactly the bits of the whole-model checkpoint of the same
// run, a run stopped and resumed from them under its own layout equals the uninterrupted run bit
// for bit, and resumed under another layout it equals the same resume from the whole-model
// checkpoint bit for bit (the reshard moves bits, it computes nothing).
#include "checkpoint/sharded_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "data/dataset.h"
#include "harness/error_of.h"
#include "models/gpt2.h"
#include "train/trainer.h"

namespace loom {
namespace {
namespace fs = std::filesystem;
using testutil::error_of;

struct Layout {
  const char* name;
  int ranks, tp, pp, zero;
  int virtual_stages = 1;  // > 1: the interleaved schedule, several parts per rank
};

class ShardedCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("loom_sharded_ckpt_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    synthesize_addition((root_ / "data").string(), 40000, 4000, 3);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static Config config(const Layout& l, const std::string& format) {
    Config c = parse_config(R"(
[model]
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 4
n_heads = 2
[train]
steps = 6
batch_size = 8
micro_batch_size = 2
lr = 3e-3
warmup_steps = 2
eval_every = 0
save_every = 0
seed = 9
[runtime]
threads_per_rank = 1
)",
                            "sharded_test.toml");
    c.data.train = (root_ / "data" / "train_*.bin").string();
    c.train.checkpoint_format = format;
    c.runtime.ranks = l.ranks;
    c.parallel.tp = l.tp;
    c.parallel.pp = l.pp;
    c.parallel.zero = l.zero;
    c.parallel.virtual_stages = l.virtual_stages;
    if (l.virtual_stages > 1) c.parallel.schedule = "interleaved";
    c.parallel.bucket_mb = 0.01;
    resolve_layout(c);
    return c;
  }

  static TrainSummary train(const std::string& run, const Layout& l, const std::string& format,
                            int64_t stop_after = 0, const std::string& resume = "") {
    TrainOptions o;
    o.run_dir = (root_ / run).string();
    o.progress = false;
    o.stop_after = stop_after;
    o.resume = resume;
    return run_training(config(l, format), o);
  }

  static std::vector<nlohmann::json> losses(const std::string& run) {
    std::ifstream in(root_ / run / "metrics.jsonl");
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json r = nlohmann::json::parse(line);
      out.push_back({r["step"], r["loss"], r["grad_norm"]});
    }
    return out;
  }

  // A checkpoint's parameters and moments, whole, as one device would load them.
  static FlatModelState load_whole(const std::string& checkpoint, const Config& c) {
    Gpt2 model(model_config_of(c));
    model.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
    const int64_t n = model.params().numel();
    FlatModelState s{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                     Tensor::zeros({n}, DType::kF32)};
    (void)load_checkpoint(checkpoint, model.params(), s);
    return s;
  }

  static bool same_bits(const Tensor& a, const Tensor& b) {
    return a.numel() == b.numel() &&
           std::equal(a.data<float>(), a.data<float>() + a.numel(), b.data<float>());
  }

  static fs::path root_;
};
fs::path ShardedCheckpoint::root_;

const Layout kLayouts[] = {
    {"dp2", 2, 1, 1, 0},       {"dp2_zero1", 2, 1, 1, 1},
    {"dp2_zero3", 2, 1, 1, 3}, {"tp2", 2, 2, 1, 0},
    {"pp2", 2, 1, 2, 0},       {"dp2_tp2_zero2", 4, 2, 1, 2},
    {"pp2_tp2", 4, 2, 2, 0},   {"pp2_interleaved", 2, 1, 2, 1, 2},
};

// Saved at step 3 under each layout, the shards hold the whole-model checkpoint's bits, and the
// run resumed from them under the same layout ends as the uninterrupted run, bit for bit.
TEST_F(ShardedCheckpoint, HoldsTheWholeCheckpointsBitsAndResumesBitForBit) {
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE(l.name);
    const std::string name = l.name;
    train(name + "_straight", l, "sharded");
    train(name + "_whole", l, "whole", 3);
    train(name + "_sharded", l, "sharded", 3);
    const std::string sharded = (root_ / (name + "_sharded") / "checkpoints" / "step_3").string();
    ASSERT_TRUE(is_sharded_checkpoint(sharded));
    EXPECT_FALSE(fs::exists(fs::path(sharded) / "model.safetensors"));
    EXPECT_EQ(verify_checkpoint(sharded).size(), static_cast<size_t>(l.ranks));
    const Config c = config(l, "whole");
    const FlatModelState w =
        load_whole((root_ / (name + "_whole") / "checkpoints" / "step_3").string(), c);
    const FlatModelState s = load_whole(sharded, c);
    EXPECT_TRUE(same_bits(w.values, s.values));
    EXPECT_TRUE(same_bits(w.exp_avg, s.exp_avg));
    EXPECT_TRUE(same_bits(w.exp_avg_sq, s.exp_avg_sq));
    EXPECT_EQ(train(name + "_sharded", l, "sharded", 0, "auto").start_step, 3);
    EXPECT_EQ(losses(name + "_sharded"), losses(name + "_straight"));
  }
}

// Written under one layout and resumed under another, a sharded checkpoint gives each rank the
// same bits as the whole-model checkpoint does: the two resumed runs are identical.
TEST_F(ShardedCheckpoint, ReshardsToAnotherLayoutAsTheWholeCheckpointDoes) {
  const Layout one{"one", 1, 1, 1, 0};
  const std::pair<Layout, Layout> moves[] = {
      {kLayouts[5], one},          // dp2 × tp2 with ZeRO-2 -> one device
      {kLayouts[3], kLayouts[4]},  // tp2 -> pp2
      {kLayouts[6], kLayouts[2]},  // pp2 × tp2 -> dp2 with ZeRO-3
      {one, kLayouts[6]},          // one device -> pp2 × tp2
      {kLayouts[7], kLayouts[1]},  // two chunks per rank (interleaved) -> ZeRO-1
  };
  for (const auto& [from, to] : moves) {
    const std::string name = std::string(from.name) + "_to_" + to.name;
    SCOPED_TRACE(name);
    train(name + "_w", from, "whole", 3);
    train(name + "_s", from, "sharded", 3);
    train(name + "_w", to, "whole", 0, "auto");
    EXPECT_EQ(train(name + "_s", to, "whole", 0, "auto").start_step, 3);
    EXPECT_EQ(losses(name + "_s"), losses(name + "_w"));
    EXPECT_EQ(losses(name + "_s").size(), 6u);
  }
}

// What a damaged or incomplete sharded checkpoint says.
TEST_F(ShardedCheckpoint, DamageIsNamed) {
  const Layout dp2{"dp2", 2, 1, 1, 1};
  train("damaged", dp2, "sharded", 3);
  const fs::path ckpt = root_ / "damaged" / "checkpoints" / "step_3";
  const Config c = config(dp2, "whole");
  // One bit of rank 1's shard.
  {
    const fs::path f = ckpt / "shard_1.safetensors";
    std::fstream io(f, std::ios::binary | std::ios::in | std::ios::out);
    io.seekg(static_cast<std::streamoff>(fs::file_size(f) - 8));
    const char b = static_cast<char>(io.get());
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) - 8));
    io.put(static_cast<char>(b ^ 1));
  }
  std::string e = error_of([&] { load_whole(ckpt.string(), c); });
  EXPECT_NE(e.find("shard_1.safetensors is not what was written"), std::string::npos) << e;
  // A slice dropped from the index: the elements it held are missing.
  fs::remove_all(root_ / "damaged");
  train("damaged", dp2, "sharded", 3);
  nlohmann::json state;
  {
    std::ifstream in(ckpt / "state.json");
    state = nlohmann::json::parse(in);
  }
  const std::string dropped = state["shards"][0]["slices"][0][0];
  state["shards"][0]["slices"].erase(0);
  std::ofstream(ckpt / "state.json") << state.dump();
  e = error_of([&] { load_whole(ckpt.string(), c); });
  EXPECT_NE(e.find("its shards hold"), std::string::npos) << e;
  EXPECT_NE(e.find("'" + dropped + "'"), std::string::npos) << e;
}

}  // namespace
}  // namespace loom
