#include "checkpoint/checkpoint_reader.h"

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/json_number.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/sharded_checkpoint.h"

namespace loom {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace checkpoint_io;

// A sharded checkpoint's slices by parameter (parsed once) and its files, each open for
// positioned reads. Where a parameter's elements are (its runs, one or more a row) is worked out
// when it is read: a 27 B model's rows number millions, too many to keep all at once.
struct CheckpointReader::Sharded {
  std::vector<std::string> file_names;  // in state.json's order
  std::map<std::string, std::vector<std::pair<size_t, ShardSlice>>> slices;  // by parameter
  std::vector<std::unique_ptr<SafetensorsIndex>> files;                      // file_names, open
};

CheckpointReader::CheckpointReader(const std::string& dir)
    : dir_(dir), model_(read_checkpoint_model(dir)) {
  const json j = read_state_json(dir);
  try {
    state_ = training_state_of(dir, j);
    // The model's parameters and their shapes (offsets only, no values): each must be in the
    // checkpoint with the shape state.json records, as load_checkpoint requires.
    Gpt2 layout(model_);
    layout.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{1, false, false});
    const json* recorded = nullptr;
    if (j.contains("model") && j["model"].contains("parameters"))
      recorded = &j["model"]["parameters"];
    for (const auto& p : layout.params().parameters()) {
      if (recorded != nullptr) {
        if (!recorded->contains(p->name))
          fail("checkpoint ", dir, ": has no parameter '", p->name,
               "' (a checkpoint of another model?)");
        const Shape shape = json_integers<int64_t>((*recorded)[p->name]);
        if (shape != p->full_shape)
          fail("checkpoint ", dir, ": '", p->name, "' has shape ", shape_str(shape),
               " but the model expects ", shape_str(p->full_shape));
      }
      shapes_[p->name] = p->full_shape;
      names_.push_back(p->name);
    }
    if (j.value("format", std::string()) == "sharded") {
      sharded_ = std::make_unique<Sharded>();
      ShardSlices all = shard_slices(dir, j);
      sharded_->file_names = std::move(all.files);
      for (auto& [file, slice] : all.slices) {
        const std::string name = slice.name;
        sharded_->slices[name].emplace_back(file, std::move(slice));
      }
      for (const std::string& file : sharded_->file_names) {
        verify_file(dir, file, j);
        sharded_->files.push_back(
            std::make_unique<SafetensorsIndex>((fs::path(dir) / file).string()));
      }
    } else {
      verify_file(dir, "model.safetensors", j);
      whole_ = std::make_unique<SafetensorsIndex>((fs::path(dir) / "model.safetensors").string());
    }
  } catch (const json::exception& e) {
    fail("checkpoint ", dir, ": state.json is not a Loom checkpoint's: ", e.what());
  }
}

CheckpointReader::~CheckpointReader() = default;

const Shape& CheckpointReader::shape(const std::string& name) const {
  const auto it = shapes_.find(name);
  if (it == shapes_.end()) fail("checkpoint ", dir_, ": the model has no parameter '", name, "'");
  return it->second;
}

Tensor CheckpointReader::read(const std::string& name) const {
  const Shape& want = shape(name);
  if (whole_ != nullptr) {
    const SafetensorsEntry* e = whole_->find(name);
    if (e == nullptr)
      fail("checkpoint ", dir_, ": model.safetensors has no tensor '", name,
           "' (a checkpoint of another model?)");
    if (e->shape != want || e->dtype != DType::kF32)
      fail("checkpoint ", dir_, ": '", name, "' has shape ", shape_str(e->shape),
           " but the model expects ", shape_str(want), " (f32)");
    return whole_->read(name);
  }
  // A sharded one: every row of the parameter (as a 2-D matrix) from the runs that hold it.
  Tensor out = Tensor::empty(want, DType::kF32, Device::cpu());
  const int64_t rows = want.empty() ? 1 : want[0];
  const int64_t cols = rows == 0 ? 0 : out.numel() / rows;
  float* dst = out.data<float>();
  ShardRuns runs;
  runs.files = sharded_->file_names;
  if (const auto it = sharded_->slices.find(name); it != sharded_->slices.end())
    for (const auto& [file, slice] : it->second) runs.add(dir_, file, slice);
  for (int64_t r = 0; r < rows; ++r)
    runs.copy_row(dir_, name, r, 0, cols, [&](size_t f, int64_t at, int64_t n, int64_t to) {
      sharded_->files[f]->read_f32("values", at, n, dst + r * cols + to);
    });
  return out;
}

}  // namespace loom
