// The normalisation in front of a pre-norm block's branches and of the LM head: LayerNorm
// (GPT-2) or RMSNorm (Llama) behind one interface, so a block is written once for both.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "nn/context.h"
#include "nn/parameter.h"

namespace loom {

class Norm {
 public:
  virtual ~Norm() = default;
  virtual Tensor forward(Context& ctx, const Tensor& x) = 0;
  // forward for an output that only a Linear reads (LayerNorm: written straight in the 16-bit
  // type the Linear keeps its input in, on a GPU at bf16 / fp16; RMSNorm: forward itself).
  virtual Tensor forward_for_matmul(Context& ctx, const Tensor& x) = 0;
  virtual Tensor backward(Context& ctx, const Tensor& dy) = 0;
  // backward plus dresidual, the gradient of the skip connection around a pre-norm branch.
  virtual Tensor backward_adding(Context& ctx, const Tensor& dy, const Tensor& dresidual) = 0;
  // The last forward's output again from the cached input, bitwise (selective recomputation).
  virtual Tensor recompute_output(Context& ctx) = 0;
  virtual void clear_cache() = 0;
  virtual void collect_cache(std::vector<Tensor*>& out) = 0;
  // Its parameters (sequence parallelism all-reduces their gradients over tp).
  virtual std::vector<Parameter*> parameters() const = 0;
};

// LayerNorm (weight + bias, eps 1e-5) or, with `rms`, RMSNorm (weight only, `eps`), named `name`.
std::unique_ptr<Norm> make_norm(ParameterStore& store, const std::string& name, int64_t channels,
                                bool rms, double eps);

}  // namespace loom
