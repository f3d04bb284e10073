// Parameters: named tensors with gradients, stored in flat buffers.
//
// Names are stable whatever the layout ("blocks.3.attn.qkv.weight"): they are the checkpoint
// keys, the sharding keys and the RNG stream names. All values live in one flat buffer and all
// gradients in another, each parameter a view into them, so zeroing, the global norm, the
// optimizer and (later) bucketed all-reduce and ZeRO sharding work on contiguous memory.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace loom {

enum class InitKind { kNormal, kZeros, kOnes };

struct Parameter {
  std::string name;
  Shape shape;
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;
  // AdamW's decoupled weight decay applies to weight matrices (2-D and above) only: not to
  // biases, not to LayerNorm gains (docs/training.md).
  bool weight_decay = false;
  int64_t offset = 0;  // element offset in the flat buffers
  Tensor value;        // view into ParameterStore::values()
  Tensor grad;         // view into ParameterStore::grads()

  int64_t numel() const { return shape_numel(shape); }
};

class ParameterStore {
 public:
  // Registers a parameter; returns a pointer that stays valid for the store's lifetime.
  // Tensors exist only after allocate().
  Parameter* add(const std::string& name, const Shape& shape, InitKind init, float init_std = 0.02f);

  // Allocates the flat value and gradient buffers (gradients zeroed) and makes the views.
  void allocate(DType dtype, Device device);
  // Initialises every value from (seed, name, global index): see tensor/rng.h.
  void initialize(uint64_t seed);

  void zero_grads();
  const std::vector<std::unique_ptr<Parameter>>& parameters() const { return params_; }
  Parameter* find(const std::string& name) const;  // nullptr if absent
  Parameter& get(const std::string& name) const;   // throws loom::Error naming it
  int64_t numel() const { return numel_; }
  Tensor& values() { return values_; }
  Tensor& grads() { return grads_; }
  bool allocated() const { return values_.defined(); }

 private:
  std::vector<std::unique_ptr<Parameter>> params_;
  int64_t numel_ = 0;
  Tensor values_;
  Tensor grads_;
};

}  // namespace loom
