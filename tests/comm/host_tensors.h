// Small host tensors for the communicator tests: made from values, read back as values.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace loom::testing {

inline Tensor filled(const std::vector<float>& values, Device device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::kF32, device);
  for (size_t i = 0; i < values.size(); ++i) t.data<float>()[i] = values[i];
  return t;
}

inline std::vector<float> values_of(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

}  // namespace loom::testing
