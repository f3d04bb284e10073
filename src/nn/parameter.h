// Parameters: named tensors with gradients, stored in flat buffers.
//
// Names are stable whatever the layout ("blocks.3.attn.qkv.weight"): they are the checkpoint
// keys, the sharding keys and the RNG stream names. All values live in one flat buffer and all
// gradients in another, each parameter a view into them, so zeroing, the global norm, the
// optimizer, bucketed all-reduce and ZeRO sharding work on contiguous memory.
//
// Units: parameters are registered in units (begin_unit), the granularity at which data
// parallelism communicates and ZeRO-3 gathers: GPT-2 has a "root" unit (embeddings, final
// LayerNorm) and one unit per block. A unit is a contiguous range of the flat buffers, padded
// (AllocateOptions::unit_multiple) so that it splits into equal, aligned per-rank chunks.
// The flat buffers are optional: ZeRO-2 and ZeRO-3 allocate no full gradient / value buffer and
// bind each unit's views to buffers they manage (bind_unit_values / bind_unit_grads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "layout/region.h"
#include "tensor/tensor.h"

namespace loom {

enum class InitKind { kNormal, kZeros, kOnes };

// Where rows of a sharded parameter's local tensor sit in the full parameter (tensor
// parallelism): local rows [local_row, local_row + rows) are `region` of the full tensor
// (region.global_shape = the full shape; region.offset = where the block starts in it).
// Column blocks (a split of dim 1) are one piece with a non-zero offset in dim 1; a fused QKV
// weight split by heads is three pieces. Local rows that no piece covers (vocabulary padding)
// are zeros.
struct ShardPiece {
  int64_t local_row = 0;
  int64_t rows = 0;
  Region region;
};

struct Parameter {
  std::string name;
  Shape shape;
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;
  // AdamW's decoupled weight decay applies to weight matrices (2-D and above) only: not to
  // biases, not to LayerNorm gains (docs/training.md).
  bool weight_decay = false;
  // A GEMM's weight operand (a Linear's matrix, the LM head's): on a GPU at bf16 / fp16 a
  // training step keeps a 16-bit copy of it (nn/rounded_weights.h).
  bool gemm_operand = false;
  int64_t offset = 0;  // element offset in the flat buffers
  Shape full_shape;    // the unsharded parameter's shape (= shape when not sharded)
  std::vector<ShardPiece> pieces;  // empty: the local tensor is the whole parameter
  Tensor value;        // view into ParameterStore::values()
  Tensor grad;         // view into ParameterStore::grads()

  int64_t numel() const { return shape_numel(shape); }
};

// A group of parameters communicated together: elements [begin, begin + numel) of the flat
// buffers (numel includes the padding after the last parameter).
struct ParamUnit {
  std::string name;
  int64_t begin = 0;
  int64_t numel = 0;
  std::vector<Parameter*> params;
  // A unit of experts that only some ranks hold (expert parallelism, parallel/expert_parallel.h):
  // data parallelism reduces and shards it over the ranks holding the same experts, not over dp.
  bool experts = false;
};

struct AllocateOptions {
  int64_t unit_multiple = 1;  // every unit's numel is a multiple of this (e.g. 16 × dp ranks)
  bool values = true;         // allocate the flat value buffer (false: ZeRO-3)
  bool grads = true;          // allocate the flat gradient buffer (false: ZeRO-2/3)
};

class ParameterStore {
 public:
  // Parameters added from now on belong to a new unit named `name`. Parameters added before any
  // begin_unit() form a unit named "all". `experts`: ParamUnit::experts.
  void begin_unit(const std::string& name, bool experts = false);
  // Registers a parameter; returns a pointer that stays valid for the store's lifetime.
  // Tensors exist only after allocate().
  Parameter* add(const std::string& name, const Shape& shape, InitKind init, float init_std = 0.02f);
  // Registers this rank's shard of a parameter whose full shape is `full_shape`: local tensor
  // `shape`, placed in the full one as `pieces` say. It initialises to exactly those blocks of
  // the full parameter.
  Parameter* add_shard(const std::string& name, const Shape& shape, const Shape& full_shape,
                       std::vector<ShardPiece> pieces, InitKind init, float init_std = 0.02f);

  // Lays out the units (offsets, padding) and allocates the flat buffers that `options` asks
  // for (zeroed), making the parameters' views into them.
  void allocate(DType dtype, Device device, const AllocateOptions& options = {});
  // Initialises every value from (seed, name, global index): see tensor/rng.h.
  void initialize(uint64_t seed);
  // Fills `out` (length elements, host) with what elements [begin, begin + length) of the flat
  // value buffer hold after initialize(seed), padding as zeros, without the flat buffer: how a
  // ZeRO-3 shard initialises exactly like its slice of the full model.
  void initialize_slice(uint64_t seed, int64_t begin, int64_t length, Tensor& out) const;

  // Zeroes the flat gradient buffer (a no-op when there is none).
  void zero_grads();
  void zero_grads(ThreadPool& pool);  // the same, over the pool's threads (Tensor::zero_)

  const std::vector<ParamUnit>& units() const { return units_; }
  // Points the views of unit `u`'s parameters into `buffer` (unit.numel elements, the unit's
  // layout); an undefined buffer unbinds them (a use then fails loudly instead of reading
  // freed memory).
  void bind_unit_values(size_t u, const Tensor& buffer);
  void bind_unit_grads(size_t u, const Tensor& buffer);
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<std::unique_ptr<Parameter>>& parameters() const { return params_; }
  Parameter* find(const std::string& name) const;  // nullptr if absent
  Parameter& get(const std::string& name) const;   // throws loom::Error naming it
  // Elements of the flat buffers, padding included (known after allocate()).
  int64_t numel() const { return numel_; }
  // Elements of the parameters themselves, no padding.
  int64_t parameter_numel() const;
  Tensor& values() { return values_; }  // undefined when allocated without values
  Tensor& grads() { return grads_; }    // undefined when allocated without grads
  bool allocated() const { return allocated_; }

 private:
  std::vector<std::unique_ptr<Parameter>> params_;
  std::vector<ParamUnit> units_;
  bool allocated_ = false;
  DType dtype_ = DType::kF32;
  Device device_ = Device::cpu();
  int64_t numel_ = 0;
  Tensor values_;
  Tensor grads_;
};

}  // namespace loom
