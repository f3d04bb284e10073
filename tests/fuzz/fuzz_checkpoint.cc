// Fuzzes reading a checkpoint (`--resume`, `loom sample`, `loom checkpoint verify|export`), in both
// formats: a small model's whole-model checkpoint and a sharded one of two ranks (each writing
// half of the flat buffers, as ZeRO does) are written once; then each input replaces one of their
// files — byte 0 picks it (kFiles), the rest is the new content. A replaced tensor file gets its
// digest recorded in state.json, as a checkpoint written by a buggy or foreign writer would have
// it, so the reading goes past the digest check into the tensors and the sharded slices.
// Properties: a refusal is a loom::Error; the model shape read can be built (as `loom sample`
// builds it, within the fuzzer's memory limits); a checkpoint that loads sets every parameter
// from the file (each was checked against the model's shapes, each element covered by a slice).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "checkpoint/file_digest.h"
#include "checkpoint/sharded_checkpoint.h"
#include "fuzz_common.h"

namespace {
namespace fs = std::filesystem;
using namespace loom;

struct File {
  bool sharded;
  const char* name;
};
constexpr File kFiles[] = {
    {false, "state.json"}, {false, "model.safetensors"},  {false, "optimizer.safetensors"},
    {true, "state.json"},  {true, "shard_0.safetensors"}, {true, "shard_1.safetensors"}};
constexpr int kNumFiles = sizeof kFiles / sizeof kFiles[0];
constexpr float kPoison = -1234.5f;

struct Checkpoints {
  fs::path dir[2];  // whole-model, sharded
  std::string original[kNumFiles];
  std::unique_ptr<Gpt2> model;
  std::unique_ptr<AdamW> optimizer;
  fs::path path(int f) const { return dir[kFiles[f].sharded] / kFiles[f].name; }
};

Checkpoints& checkpoints() {
  static Checkpoints c = [] {
    Checkpoints made;
    Gpt2Config shape;
    shape.vocab_size = 8;
    shape.max_seq_len = 4;
    shape.d_model = 4;
    shape.n_layers = 1;
    shape.n_heads = 2;
    made.model = std::make_unique<Gpt2>(shape);
    made.model->build(DType::kF32, Device::cpu(), 3);
    made.optimizer = std::make_unique<AdamW>(made.model->params(), AdamWConfig{});
    TrainingState state;
    state.step = 5;
    state.optimizer_steps = 5;
    state.loader_offset = 12;
    state.config_toml = "[model]\nvocab_size = 8\n";
    made.dir[0] = save_checkpoint((fuzz::scratch_dir() / "whole").string(), *made.model,
                                  made.optimizer.get(), state);
    // Two ranks, each the owner of half the flat buffers.
    ParameterStore& store = made.model->params();
    const int64_t n = store.numel(), half = n / 2;
    const std::string sharded = (fuzz::scratch_dir() / "sharded").string();
    const std::string tmp = begin_sharded_checkpoint(sharded, state.step);
    const FlatModelState whole{store.values(), made.optimizer->m(), made.optimizer->v()};
    for (int rank = 0; rank < 2; ++rank) {
      const int64_t begin = rank == 0 ? 0 : half, end = rank == 0 ? half : n;
      write_shard(
          tmp, rank, slices_of(store, {{begin, end}}),
          {whole.values.narrow(begin, end - begin), whole.exp_avg.narrow(begin, end - begin),
           whole.exp_avg_sq.narrow(begin, end - begin)});
    }
    made.dir[1] = finish_sharded_checkpoint(tmp, 2, store, shape, state, true);
    for (int f = 0; f < kNumFiles; ++f) {
      made.original[f] = fuzz::read_file(made.path(f));
      fuzz::seed(std::string(kFiles[f].sharded ? "sharded_" : "") + kFiles[f].name,
                 static_cast<char>(f) + made.original[f]);
    }
    return made;
  }();
  return c;
}

void poison(const Tensor& t) {
  std::fill(t.data<float>(), t.data<float>() + t.numel(), kPoison);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Checkpoints& c = checkpoints();
  const int which = data[0] % kNumFiles;
  const bool sharded = kFiles[which].sharded;
  const std::string_view content(reinterpret_cast<const char*>(data) + 1, size - 1);
  for (int f = 0; f < kNumFiles; ++f)
    fuzz::write_file(c.path(f), f == which ? content : c.original[f]);
  if (std::string_view(kFiles[which].name) != "state.json") {  // record the new file's digest
    const int state_file = sharded ? 3 : 0;
    nlohmann::json state = nlohmann::json::parse(c.original[state_file]);
    const FileDigest d = digest_file(c.path(which).string());
    state["files"][kFiles[which].name] = {{"bytes", d.bytes}, {"xxh3_64", xxh3_hex(d.xxh3)}};
    fuzz::write_file(c.path(state_file), state.dump(2));
  }
  const fs::path& dir = c.dir[sharded];
  fuzz::require(find_latest_checkpoint(dir.parent_path().string()) == dir.string(),
                "the checkpoint is found by its state.json");
  fuzz::accepts([&] { verify_checkpoint(dir.string()); });
  Gpt2Config shape;
  if (fuzz::accepts([&] { shape = read_checkpoint_model(dir.string()); })) {
    Gpt2 model(shape);  // as `loom sample` does: the shape read is one that can be built
    model.build(DType::kF32, Device::cpu(), 1);
  }
  fuzz::accepts(
      [&] { export_checkpoint(dir.string(), "hf", (fuzz::scratch_dir() / "hf").string()); });

  // Poison the model, then load: every value must come from the file.
  for (const auto& p : c.model->params().parameters()) poison(p->value);
  if (!fuzz::accepts([&] { load_checkpoint(dir.string(), *c.model, c.optimizer.get()); })) return 0;
  for (const auto& p : c.model->params().parameters())
    for (int64_t i = 0; i < p->value.numel(); ++i)
      fuzz::require(p->value.data<float>()[i] != kPoison, "every parameter is loaded");
  return 0;
}
