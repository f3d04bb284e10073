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
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/export.h"
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

// Every file under `dir`, by its path relative to it, with its bytes.
std::map<std::string, std::string> files_under(const fs::path& dir) {
  std::map<std::string, std::string> out;
  if (fs::is_regular_file(dir)) {
    std::ifstream in(dir, std::ios::binary);
    out[""] = std::string(std::istreambuf_iterator<char>(in), {});
    return out;
  }
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[fs::relative(e.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

// `loom checkpoint export` reads a checkpoint one parameter at a time (CheckpointReader): from a
// sharded one, each parameter is put together from the runs of the shards that hold it (tensor-
// parallel blocks, ZeRO chunks that start and end mid-row, pipeline stages, interleaved chunks)
// with the whole-model checkpoint's bits, so the files exported from the two checkpoints of one
// run are byte for byte the same — GPT-2 for transformers (fp32, bf16, split over several files)
// and llm.c's. A damaged shard is named before anything is written.
TEST_F(ShardedCheckpoint, ExportsTheWholeCheckpointsFilesParameterByParameter) {
  for (const Layout& l : {kLayouts[5], kLayouts[6], kLayouts[7]}) {
    SCOPED_TRACE(l.name);
    const std::string name = std::string("export_") + l.name;
    train(name + "_w", l, "whole", 3);
    train(name + "_s", l, "sharded", 3);
    const std::string whole = (root_ / (name + "_w") / "checkpoints" / "step_3").string();
    const std::string sharded = (root_ / (name + "_s") / "checkpoints" / "step_3").string();
    ASSERT_TRUE(is_sharded_checkpoint(sharded));

    const Config c = config(l, "whole");
    const FlatModelState w = load_whole(whole, c);
    Gpt2 layout(model_config_of(c));
    layout.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
    const CheckpointReader reader(sharded);
    EXPECT_EQ(reader.names().size(), layout.params().parameters().size());
    EXPECT_EQ(reader.state().step, 3);
    for (const auto& p : layout.params().parameters()) {
      const Tensor got = reader.read(p->name);
      ASSERT_EQ(got.shape(), p->full_shape) << p->name;
      EXPECT_TRUE(std::equal(got.data<float>(), got.data<float>() + got.numel(),
                             w.values.data<float>() + p->offset))
          << p->name;
    }

    struct Export {
      const char* format;
      bool bf16;
      int64_t max_shard_bytes;
    };
    for (const Export& x : {Export{"hf", false, kDefaultMaxShardBytes}, Export{"hf", true, 20000},
                            Export{"llmc", false, kDefaultMaxShardBytes}}) {
      SCOPED_TRACE(std::string(x.format) + (x.bf16 ? " bf16 " : " ") +
                   std::to_string(x.max_shard_bytes));
      const fs::path from_whole = root_ / (name + "_w") / "out";
      const fs::path from_shards = root_ / (name + "_s") / "out";
      export_checkpoint(whole, x.format, from_whole.string(), x.bf16, x.max_shard_bytes);
      export_checkpoint(sharded, x.format, from_shards.string(), x.bf16, x.max_shard_bytes);
      const auto a = files_under(from_whole), b = files_under(from_shards);
      // (~118 kB of bf16 tensors over files of at most 20 kB: 7 files and the index)
      const bool split = x.max_shard_bytes < kDefaultMaxShardBytes;
      EXPECT_EQ(a.size(), split ? 9u : x.format == std::string("hf") ? 2u : 1u);
      EXPECT_EQ(a.count(split ? "model-00007-of-00007.safetensors" : "model.safetensors"),
                x.format == std::string("hf") ? 1u : 0u);
      EXPECT_TRUE(a == b);
    }
  }

  // A bit of a shard flipped: the export names the file and writes nothing.
  const std::string ckpt = (root_ / "export_dp2_tp2_zero2_s" / "checkpoints" / "step_3").string();
  {
    const fs::path f = fs::path(ckpt) / "shard_2.safetensors";
    std::fstream io(f, std::ios::binary | std::ios::in | std::ios::out);
    io.seekg(100);
    const char b = static_cast<char>(io.get());
    io.seekp(100);
    io.put(static_cast<char>(b ^ 4));
  }
  const fs::path out = root_ / "damaged_export";
  std::string e = error_of([&] { export_checkpoint(ckpt, "hf", out.string()); });
  EXPECT_NE(e.find("shard_2.safetensors is not what was written"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
  // A slice of the last parameter pointing past its shard's arrays (state.json carries no
  // digest): the export fails at that parameter, after writing the others, and leaves nothing.
  const std::string other = (root_ / "export_pp2_tp2_s" / "checkpoints" / "step_3").string();
  nlohmann::json state;
  {
    std::ifstream in(fs::path(other) / "state.json");
    state = nlohmann::json::parse(in);
  }
  std::string last;
  for (nlohmann::json& shard : state["shards"])
    for (nlohmann::json& s : shard["slices"])
      if (s[0] == "ln_f.weight" && last.empty()) {
        s[7] = s[7].get<int64_t>() + 1000000000;
        last = s[0];
      }
  ASSERT_EQ(last, "ln_f.weight");
  std::ofstream(fs::path(other) / "state.json") << state.dump();
  e = error_of([&] { export_checkpoint(other, "hf", out.string()); });
  EXPECT_NE(e.find("tensor 'values' has"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
}

}  // namespace
}  // namespace loom
