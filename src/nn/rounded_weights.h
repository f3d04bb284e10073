// RoundedWeights — the 16-bit copies of the weights that a GPU's GEMMs read at bf16 / fp16
// matmul precision, made once per optimizer step instead of at every GEMM.
//
// A GEMM given an fp32 weight casts it to the 16-bit type first (a read of 4 bytes and a write of
// 2 per value). A Linear's weight is read by its forward and by its input gradient in every
// micro-batch, so without copies it is cast 2 × micro-batches times a step: at GPT-2 124M that is
// ~1.5 GB of memory traffic per micro-batch, ~1% of a step of 16 sequences of 1024 tokens on an
// H200 but ~20% of the GEMMs' time at one sequence per micro-batch (a pipeline's). Megatron-LM and
// llm.c keep 16-bit parameters beside fp32 master weights for the same reason.
//
// One buffer holds a copy of every parameter marked `gemm_operand` (the Linears' weights, the LM
// head's), allocated when this is made: memory the run holds from its start, 2 bytes a value
// (counted with the parameters, planner/planner.h: rank_state_buffers). A copy is made at its
// first use after invalidate(), so it is taken after whatever brought the values up to date — a
// ZeRO all-gather, which the unit's hooks have the GPU wait for before its forward — and the
// engine (parallel/data_parallel.h) calls invalidate() in each optimizer_step and load_state.
// Nothing else may change the values while copies are in use; a parameter whose values moved to
// another buffer is copied again.
// The copies are the rounding every GEMM made before, bit for bit, so a run is the same with or
// without them (LOOM_CUDA_WEIGHT_COPIES=0 in the environment turns them off, for comparisons).
//
// ZeRO-3 keeps no copies of its own (it holds no whole weights between a unit's forward and its
// backward), but where it gathers the values in bf16 at bf16 matmul precision the gathered bf16
// values are those copies already — the bf16 rounding of the fp32 shard, what each GEMM's cast
// of the widened values gives again: the engine lends them (lend) while the unit is gathered.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "kernels/exec.h"
#include "kernels/ops.h"
#include "nn/context.h"
#include "nn/parameter.h"
#include "tensor/tensor.h"

namespace loom {

class RoundedWeights {
 public:
  // Copies of `store`'s gemm_operand parameters where `ex` rounds GEMM inputs to 16 bits (a GPU
  // at bf16 / fp16; not at fp8, whose Linears quantize their own operands) and the environment
  // does not turn them off; elsewhere none, and of() gives the fp32 values. The store must be
  // allocated, and its parameters stay where they are for this object's lifetime.
  // own_copies = false: none made here, only those lent (ZeRO-3).
  RoundedWeights(const ParameterStore& store, const Exec& ex, bool own_copies = true);

  // p as the 16-bit GEMM ops take it (ops::GemmWeight): with its copy, rounded now if this is
  // its first use since invalidate() (queued on ex's device), or its fp32 values alone where
  // there are no copies or p is not one of them.
  ops::GemmWeight of(const Exec& ex, const Parameter& p);
  // The values changed (an optimizer step): each copy is made again at its next use (and lent
  // ones are forgotten).
  void invalidate();
  // p's copy is `bits` (values of the 16-bit type GEMM inputs are rounded to, p's layout), owned
  // by the caller, until take_back(p): of() gives it instead of a copy of its own.
  void lend(const Parameter& p, const void* bits);
  void take_back(const Parameter& p);

  // Whether there are copies: its own, or lent ones where own_copies was false.
  bool active() const { return buffer_.defined() || lending_; }
  int64_t bytes() const { return active() ? static_cast<int64_t>(buffer_.nbytes()) : 0; }
  // Copies made since this object was created (for tests: once per parameter per step).
  int64_t roundings() const { return roundings_; }

  // Whether LOOM_CUDA_WEIGHT_COPIES=0 is unset in the environment.
  static bool enabled_by_environment();

 private:
  struct Copy {
    int64_t offset = 0;                 // into buffer_, in values
    const float* from = nullptr;        // the values it was made from; null: to be made
  };
  DType dtype_ = DType::kF32;
  bool lending_ = false;
  Tensor buffer_;
  std::unordered_map<const Parameter*, const void*> lent_;
  std::unordered_map<const Parameter*, Copy> copies_;
  int64_t roundings_ = 0;
};

// A Linear's weight as its GEMMs take it: ctx.rounded_weights' copy where a training step set
// one, else the fp32 values.
ops::GemmWeight gemm_weight(Context& ctx, const Parameter& p);

}  // namespace loom
