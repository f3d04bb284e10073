// ParamHooks — where a parallel strategy steps into a model's forward and backward without the
// model knowing about communication (models stay pure math; parallel/ implements the hooks).
//
// A model calls, for every parameter unit u (ParameterStore::units()):
//   forward:  before_forward(u) ... uses u's values ... after_forward(u)
//   backward: before_backward(u) ... uses u's values, accumulates u's gradients ... after_backward(u)
// after_backward(u) means u's gradients for this backward are final: data parallelism starts
// their all-reduce there (overlapping the rest of backward), ZeRO-3 gathers u's values in
// before_* and frees them in after_*. Units are visited in one fixed order per pass, the same
// on every rank (GPT-2: forward root, blocks 0..L-1, with root closed last; backward root,
// blocks L-1..0, root closed last), so collectives issued from hooks match across ranks.
#pragma once

#include <cstddef>

namespace loom {

class ParamHooks {
 public:
  virtual ~ParamHooks() = default;
  virtual void before_forward(size_t /*unit*/) {}
  virtual void after_forward(size_t /*unit*/) {}
  virtual void before_backward(size_t /*unit*/) {}
  virtual void after_backward(size_t /*unit*/) {}
};

}  // namespace loom
