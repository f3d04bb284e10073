// A checkpoint's parameters read one at a time — whole or sharded — for the tools that must not
// hold the whole model: `loom checkpoint export` of a model of tens of GB holds one parameter
// (and what it writes of it) at a time.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"

namespace loom {

class CheckpointReader {
 public:
  // Reads state.json and checks the files holding the parameters against their recorded
  // digests, reading each through once without keeping it (a whole checkpoint's
  // model.safetensors, a sharded one's shards; not a whole checkpoint's optimizer moments).
  // Throws loom::Error naming the checkpoint and the file.
  explicit CheckpointReader(const std::string& checkpoint_dir);
  ~CheckpointReader();

  const std::string& dir() const { return dir_; }
  const Gpt2Config& model() const { return model_; }
  const TrainingState& state() const { return state_; }
  // The model's parameters, in its order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return shapes_.count(name) > 0; }
  // The whole parameter's shape, as state.json records it; fails naming a missing one.
  const Shape& shape(const std::string& name) const;
  // The whole parameter, host f32, read from the files now (positioned reads of its bytes; from
  // several threads at once too).
  Tensor read(const std::string& name) const;

 private:
  struct Sharded;
  std::string dir_;
  Gpt2Config model_;
  TrainingState state_;
  std::vector<std::string> names_;
  std::map<std::string, Shape> shapes_;
  std::unique_ptr<SafetensorsIndex> whole_;  // a whole checkpoint's model.safetensors
  std::unique_ptr<Sharded> sharded_;
};

}  // namespace loom
