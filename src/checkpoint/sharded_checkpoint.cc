#include "checkpoint/sharded_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/json_number.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/safetensors.h"

namespace loom {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace checkpoint_io;

namespace {

// A parameter seen as a 2-D matrix: its first dimension, and the product of the others.
std::pair<int64_t, int64_t> matrix_of(const Shape& shape) {
  if (shape.empty()) return {1, 1};
  int64_t cols = 1;
  for (size_t d = 1; d < shape.size(); ++d) cols *= shape[d];
  return {shape[0], cols};
}

// Where the rows of a (local) parameter sit in the whole one: its pieces, or itself whole.
struct Block {
  int64_t local_row, rows, row, col;
};

std::vector<Block> blocks_of(const Parameter& p) {
  // A shard without pieces (a vocabulary shard that is all padding) holds nothing of the whole.
  if (p.pieces.empty() && p.shape == p.full_shape) return {{0, matrix_of(p.shape).first, 0, 0}};
  LOOM_CHECK_MSG(p.shape.size() <= 2, "sharded parameters are at most 2-D");
  std::vector<Block> out;
  for (const ShardPiece& piece : p.pieces)
    out.push_back({piece.local_row, piece.rows, piece.region.offset[0],
                   piece.region.offset.size() > 1 ? piece.region.offset[1] : 0});
  return out;
}

std::string shard_file(int rank) {
  return "shard_" + std::to_string(rank) + ".safetensors";
}
std::string shard_index(int rank) {
  return "shard_" + std::to_string(rank) + ".json";
}

json slice_json(const ShardSlice& s) {
  return json::array({s.name, s.row, s.col, s.rows, s.cols, s.begin, s.count, s.at});
}

ShardSlice slice_from(const std::string& dir, const json& j) {
  try {
    return {j.at(0).get<std::string>(),     json_integer<int64_t>(j.at(1)),
            json_integer<int64_t>(j.at(2)), json_integer<int64_t>(j.at(3)),
            json_integer<int64_t>(j.at(4)), json_integer<int64_t>(j.at(5)),
            json_integer<int64_t>(j.at(6)), json_integer<int64_t>(j.at(7))};
  } catch (const json::exception&) {
    fail("checkpoint ", dir,
         ": a slice in state.json is not [name, row, col, rows, cols, begin, "
         "count, at]: ",
         j.dump());
  }
}

}  // namespace

std::vector<ShardSlice> slices_of(const ParameterStore& store,
                                  const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                  const std::set<std::string>& skip) {
  std::vector<ShardSlice> out;
  int64_t at = 0;  // where the range starts in the concatenated arrays
  for (const auto& [lo, hi] : ranges) {
    for (const auto& p : store.parameters()) {
      if (skip.count(p->name)) continue;
      const int64_t a = std::max(lo, p->offset) - p->offset;
      const int64_t b = std::min(hi, p->offset + p->numel()) - p->offset;
      if (a >= b) continue;
      const int64_t cols = matrix_of(p->shape).second;
      for (const Block& block : blocks_of(*p)) {
        const int64_t first = block.local_row * cols, last = first + block.rows * cols;
        const int64_t x = std::max(a, first), y = std::min(b, last);
        if (x >= y) continue;
        out.push_back({p->name, block.row, block.col, block.rows, cols, x - first, y - x,
                       at + p->offset + x - lo});
      }
    }
    at += hi - lo;
  }
  return out;
}

std::string checkpoint_tmp_dir(const std::string& checkpoints_dir, int64_t step) {
  return (fs::path(checkpoints_dir) / ("step_" + std::to_string(step) + ".tmp")).string();
}

std::string begin_sharded_checkpoint(const std::string& checkpoints_dir, int64_t step) {
  return make_tmp_dir(checkpoints_dir, step).string();
}

void write_shard(const std::string& tmp_dir, int rank, const std::vector<ShardSlice>& slices,
                 const FlatModelState& arrays) {
  json index = {{"slices", json::array()}};
  for (const ShardSlice& s : slices) index["slices"].push_back(slice_json(s));
  if (!slices.empty()) {
    std::vector<std::pair<std::string, Tensor>> tensors = {{"values", arrays.values}};
    if (arrays.exp_avg.defined()) {
      tensors.emplace_back("exp_avg", arrays.exp_avg);
      tensors.emplace_back("exp_avg_sq", arrays.exp_avg_sq);
    }
    const FileDigest digest =
        save_safetensors((fs::path(tmp_dir) / shard_file(rank)).string(), tensors,
                         {{"format", "loom-checkpoint-shard"}, {"rank", std::to_string(rank)}});
    index["file"] = shard_file(rank);
    index["digest"] = digest_json(digest);
  }
  write_text_file(fs::path(tmp_dir) / shard_index(rank), index.dump() + "\n");
}

std::string finish_sharded_checkpoint(const std::string& tmp_dir, int ranks,
                                      const ParameterStore& whole, const Gpt2Config& model,
                                      const TrainingState& state, bool has_optimizer) {
  json shards = json::array(), files = json::object();
  std::map<std::string, int64_t> held;  // elements of each parameter in some slice
  for (int r = 0; r < ranks; ++r) {
    const fs::path index_path = fs::path(tmp_dir) / shard_index(r);
    std::ifstream in(index_path);
    if (!in) fail("sharded checkpoint ", tmp_dir, ": rank ", r, " wrote no ", shard_index(r));
    const json index = json::parse(in);
    if (!index.contains("file")) continue;  // a rank that holds nothing
    for (const json& s : index["slices"])
      held[s.at(0).get<std::string>()] += json_integer<int64_t>(s.at(6));
    shards.push_back({{"file", index["file"]}, {"slices", index["slices"]}});
    files[index["file"].get<std::string>()] = index["digest"];
  }
  for (const auto& p : whole.parameters())
    if (held[p->name] != p->numel())  // a layout's bug, caught before the checkpoint exists
      fail("sharded checkpoint ", tmp_dir, ": the ranks' slices of ", p->name, " hold ",
           held[p->name], " elements, it has ", p->numel());
  json j = state_json(state, whole, model, has_optimizer);
  j["format"] = "sharded";
  j["shards"] = shards;
  j["files"] = files;
  write_text_file(fs::path(tmp_dir) / "state.json", j.dump(1) + "\n");
  for (int r = 0; r < ranks; ++r) fs::remove(fs::path(tmp_dir) / shard_index(r));
  std::string final_dir = tmp_dir.substr(0, tmp_dir.size() - 4);  // "step_N.tmp" -> "step_N"
  publish(tmp_dir, final_dir);
  return final_dir;
}

bool is_sharded_checkpoint(const std::string& checkpoint_dir) {
  return read_state_json(checkpoint_dir).value("format", std::string()) == "sharded";
}

TrainingState load_sharded_checkpoint_into(const std::string& dir, const ParameterStore& store,
                                           FlatModelState& into) {
  return load_sharded_checkpoint_into(dir, {{&store, &into}});
}

namespace {

TrainingState load_sharded(const std::string& dir, const std::vector<ShardTarget>& targets);

}  // namespace

TrainingState load_sharded_checkpoint_into(const std::string& dir,
                                           const std::vector<ShardTarget>& targets) {
  // A key missing from state.json or of another type (nlohmann's out_of_range / type_error) is
  // the checkpoint's error, named, not an exception no caller expects (fuzz_checkpoint).
  try {
    return load_sharded(dir, targets);
  } catch (const json::exception& e) {
    fail("checkpoint ", dir, ": state.json is not a sharded checkpoint's: ", e.what());
  }
}

namespace checkpoint_io {

void ShardRuns::add(const std::string& dir, size_t file, const ShardSlice& s) {
  if (s.cols < 1 || s.count < 0 || s.begin < 0 || s.begin + s.count > s.rows * s.cols)
    fail("checkpoint ", dir, ": ", files[file], "'s slice of '", s.name,
         "' is inconsistent: ", slice_json(s).dump());
  for (int64_t e = s.begin; e < s.begin + s.count;) {
    const int64_t k = e / s.cols, row_end = std::min(s.begin + s.count, (k + 1) * s.cols);
    rows[s.name][s.row + k].push_back(
        {s.col + e - k * s.cols, s.col + row_end - k * s.cols, file, s.at + e - s.begin});
    e = row_end;
  }
}

ShardSlices shard_slices(const std::string& dir, const json& j) {
  ShardSlices out;
  const json& shards = j.at("shards");
  for (size_t f = 0; f < shards.size(); ++f) {
    out.files.push_back(shards[f].at("file").get<std::string>());
    for (const json& sj : shards[f].at("slices")) out.slices.emplace_back(f, slice_from(dir, sj));
  }
  return out;
}

ShardRuns shard_runs(const std::string& dir, const json& j, const std::set<std::string>& wanted) {
  const ShardSlices all = shard_slices(dir, j);
  ShardRuns out;
  out.files = all.files;
  for (const auto& [file, s] : all.slices)
    if (wanted.count(s.name)) out.add(dir, file, s);
  return out;
}

}  // namespace checkpoint_io

namespace {

TrainingState load_sharded(const std::string& dir, const std::vector<ShardTarget>& targets) {
  const json j = read_state_json(dir);
  std::set<std::string> wanted;
  for (const auto& [store, into] : targets)
    if (into->exp_avg.defined() && !j.value("has_optimizer", false))
      fail("checkpoint ", dir, ": holds no optimizer state, cannot resume training");
  for (const auto& [store, into] : targets)
    for (const auto& p : store->parameters()) {
      const json& shapes = j.at("model").at("parameters");
      if (!shapes.contains(p->name))
        fail("checkpoint ", dir, ": has no parameter '", p->name,
             "' (a checkpoint of another model?)");
      const Shape recorded = json_integers<int64_t>(shapes[p->name]);
      if (recorded != p->full_shape)
        fail("checkpoint ", dir, ": '", p->name, "' has shape ", shape_str(recorded),
             " but the model expects ", shape_str(p->full_shape));
      wanted.insert(p->name);
    }

  const ShardRuns runs = shard_runs(dir, j, wanted);
  std::map<size_t, SafetensorsFile> loaded;  // only the files the targets need, each read once
  auto array = [&](size_t f, const char* name) -> const Tensor& {
    auto it = loaded.find(f);
    if (it == loaded.end()) it = loaded.emplace(f, load_checked(dir, runs.files[f], j)).first;
    const auto t = it->second.tensors.find(name);
    if (t == it->second.tensors.end() || t->second.dtype() != DType::kF32)
      fail("checkpoint ", dir, ": ", runs.files[f], " has no f32 tensor '", name, "'");
    return t->second;
  };
  for (const auto& [store, into_ptr] : targets)
    for (const auto& p : store->parameters()) {
      FlatModelState& into = *into_ptr;
      const int64_t cols = matrix_of(p->shape).second;
      for (const Block& block : blocks_of(*p))
        for (int64_t i = 0; i < block.rows; ++i)
          runs.copy_row(dir, p->name, block.row + i, block.col, cols,
                        [&](size_t file, int64_t src, int64_t n, int64_t to) {
                          const int64_t dst = p->offset + (block.local_row + i) * cols + to;
                          for (const auto& [name, into_array] :
                               {std::pair<const char*, Tensor*>{"values", &into.values},
                                {"exp_avg", &into.exp_avg},
                                {"exp_avg_sq", &into.exp_avg_sq}}) {
                            if (!into_array->defined()) continue;
                            const Tensor& from = array(file, name);
                            if (src + n > from.numel())
                              fail("checkpoint ", dir, ": ", runs.files[file], "'s slice of '",
                                   p->name, "' lies outside its arrays");
                            std::copy_n(from.data<float>() + src, n,
                                        into_array->data<float>() + dst);
                          }
                        });
    }
  return training_state_of(dir, j);
}

}  // namespace

}  // namespace loom
